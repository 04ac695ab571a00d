"""Statistics of a grouped sweep: per group n, mean, 95 % t-interval; each group against the best.

The lab's question is "which stage order learns the best joint space"; a mean over a handful of
seeds answers it only with its uncertainty. Per group (by default per ``schedule.stage_order``) of
one per-trial value (the sweep's ``sweep.metric``; by default ``best_text_to_video_R@10``):

Only trials at the full budget count (:func:`counted`: status done, i.e. ran every epoch of
``schedule.epochs``). A trial the scheduler stopped early was measured at a smaller budget: beside
full-budget trials it would make its group look worse for that reason alone, so it is listed and
counted per group but never enters a mean. Running and errored trials are listed too; their values
are provisional or cut short.

* **Interval**: Student t-interval of the mean, ``mean ± t(0.975, n−1) · s / √n`` (``s`` with
  ddof=1). Seeds are few and their spread unknown, so the t (not the normal) quantile. n = 1 has
  no spread and gets no interval; n = 2 gets the honest, wide one (t(0.975, 1) = 12.71).
* **Test against the best group** (the best mean in the metric's direction, from the table of
  metrics: the highest R@K, the lowest rank), two-sided:
  paired t-test (``scipy.stats.ttest_rel``) on *pairs*, else Welch's t-test
  (``scipy.stats.ttest_ind(equal_var=False)``) on all trials of the two groups.
* **Pairing rule**: two trials pair when they differ only in the grouping key, i.e. they share
  ``run.seed`` and the value of every other key in their ``params.json`` (the swept keys). A
  stage-order difference is then measured on the same seed and configuration, so seed-to-seed
  variation cancels. Several trials in one cell (same group, same keys: repeats without a seed in
  the space) are averaged into one value first. The paired test needs ≥ 2 pairs; with fewer
  (random or BOHB search gives configurations that never repeat) the Welch test is used and the
  ``note`` column says why.
* **Multiplicity**: the best group is chosen from the same data and compared k − 1 times, so
  ``p_holm`` (Holm's step-down adjustment over those comparisons) is reported next to ``p``.
* **Detectable difference** (``mde``): the smallest true difference the same test, with this many
  trials and the spread observed, would find at 80 % power (two-sided, α = 0.05): the δ where the
  noncentral t (noncentrality δ/SE) exceeds the critical t with probability 0.8. "No significant
  difference" with an ``mde`` of 3 R@10 points says only that the difference is likely below 3.

Pure functions of DataFrames; scipy for the t distribution and the tests, statsmodels for Holm's
adjustment, both imported on first use (scipy.stats costs about half a second, and every
``raymcn`` command imports the results layer to build its parser).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from raymcn.results.columns import is_config_key, metric_mode

CONFIDENCE = 0.95
ALPHA, POWER = 0.05, 0.8  # of the detectable difference
PAIRED, WELCH = "paired t", "Welch t"
COUNTED = ("done",)  # trials at the full budget; stopped ones ran fewer epochs, running ones are provisional
STAT_COLUMNS = ("n", "mean", "std", "ci95_low", "ci95_high", "vs_best", "test", "pairs", "t", "dof", "p",
                "p_holm", "mde", "note")


def t_interval(values, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """(low, high) of the Student t-interval for the mean of ``values`` (NaNs dropped):
    ``mean ± t((1+confidence)/2, n−1) · s/√n`` with ``s`` the ddof=1 standard deviation.
    (nan, nan) when fewer than 2 values; (mean, mean) when all values are equal."""
    x = np.asarray(values, dtype=float)
    x = x[~np.isnan(x)]
    if x.size < 2:
        return math.nan, math.nan
    mean, sem = float(x.mean()), float(x.std(ddof=1)) / math.sqrt(x.size)
    if sem == 0.0:  # scipy rejects a zero scale; the interval of identical values is the point
        return mean, mean
    from scipy import stats as st

    low, high = st.t.interval(confidence, df=x.size - 1, loc=mean, scale=sem)
    return float(low), float(high)


def holm(pvalues) -> np.ndarray:
    """Holm's step-down adjusted p-values (statsmodels' ``multipletests(method="holm")``), in the
    order given; NaN stays NaN and is not counted in the family."""
    p = np.asarray(pvalues, dtype=float)
    out = np.full(p.shape, np.nan)
    ok = ~np.isnan(p)
    if ok.any():
        from statsmodels.stats.multitest import multipletests

        out[ok] = multipletests(p[ok], method="holm")[1]
    return out


def detectable_difference(se: float, dof: float, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest true difference a two-sided t-test at level ``alpha`` detects with probability
    ``power``, given the standard error ``se`` of the difference and the test's degrees of freedom:
    the δ > 0 with P(|T| > t(1 − α/2, dof)) = power for T noncentral t(dof, δ/se). NaN when
    ``se`` or ``dof`` gives no test. (For large dof this tends to (z(1−α/2) + z(power))·se =
    2.80·se; for 4 pairs (dof 3) it is 4.26·se, for 10 pairs 3.15·se.)"""
    if not (se > 0 and dof >= 1 and math.isfinite(se) and math.isfinite(dof)):
        return math.nan
    from scipy import optimize
    from scipy import stats as st

    crit = st.t.ppf(1 - alpha / 2, dof)

    def shortfall(delta: float) -> float:
        nc = delta / se
        wrong_side = st.nct.cdf(-crit, dof, nc)  # ~0 for delta > 0; scipy gives NaN far out in the tail
        return st.nct.sf(crit, dof, nc) + (0.0 if math.isnan(wrong_side) else wrong_side) - power

    high = (crit + st.t.ppf(power, dof) + 10) * se  # power there is ~1
    return float(optimize.brentq(shortfall, 0.0, high, xtol=1e-12 * se, rtol=1e-10))


@dataclass(frozen=True)
class Comparison:
    """One group against the best: ``diff`` = mean(group) − mean(best) (paired: mean of the
    per-pair differences); ``test`` is PAIRED, WELCH or "" (no test); ``mde`` is the test's
    :func:`detectable_difference`; ``note`` says why not paired, or why no test."""

    test: str
    pairs: int
    diff: float
    t: float
    dof: float
    p: float
    note: str
    mde: float = math.nan


def compare(values: pd.Series, best: pd.Series) -> Comparison:
    """Test ``values`` (one group's trials) against ``best`` (the best group's trials).

    Both Series hold the metric (NaN = no value, left out), indexed by the trials' pairing keys
    (one index level per key, as :func:`group_statistics` builds them); an index without a name
    means there is nothing to pair on. Trials with a NaN key never pair. At least 2 pairs: paired
    t-test on the per-cell means; else Welch's t-test over all values; else no test.
    """
    from scipy import stats as st

    values, best = values.dropna(), best.dropna()
    diff = float(values.mean() - best.mean()) if len(values) and len(best) else math.nan
    cells = _cell_means(values).to_frame("a").join(_cell_means(best).to_frame("b"), how="inner")
    if len(cells) >= 2:
        d = (cells["a"] - cells["b"]).to_numpy()
        left_out = _unpaired(values, cells.index) + _unpaired(best, cells.index)
        note = f"{left_out} unpaired trial(s) left out of the paired test" if left_out else ""
        if np.ptp(d) == 0:  # t = ±inf or 0/0: a t-test says nothing about a constant difference
            return Comparison(PAIRED, len(cells), float(d.mean()), math.nan, len(d) - 1, math.nan,
                              _join(f"all {len(d)} paired differences equal {d[0]:.4g}: no spread, no p-value", note))
        r = st.ttest_rel(cells["a"], cells["b"])
        mde = detectable_difference(float(d.std(ddof=1)) / math.sqrt(len(d)), len(d) - 1)
        return Comparison(PAIRED, len(cells), float(d.mean()), float(r.statistic), float(r.df), float(r.pvalue),
                          note, mde)
    if not _pairable(values):
        why = "no swept key to pair on"
    else:
        why = "no trial shares seed and config with the best" if cells.empty else "only 1 pair"
    if len(values) < 2 or len(best) < 2:
        return Comparison("", len(cells), diff, math.nan, math.nan, math.nan,
                          f"{why}; Welch needs n >= 2 on both sides (n = {len(values)} vs {len(best)}): no test")
    if values.std(ddof=1) == 0 and best.std(ddof=1) == 0:
        return Comparison(WELCH, len(cells), diff, math.nan, math.nan, math.nan,
                          f"{why}; both groups constant: no spread, no p-value")
    r = st.ttest_ind(values, best, equal_var=False)
    se = math.sqrt(values.var(ddof=1) / len(values) + best.var(ddof=1) / len(best))
    return Comparison(WELCH, len(cells), diff, float(r.statistic), float(r.df), float(r.pvalue),
                      f"{why}: Welch's t-test over all trials", detectable_difference(se, float(r.df)))


def _pairable(s: pd.Series) -> bool:
    return isinstance(s.index, pd.MultiIndex) or s.index.name is not None


def _cell_means(s: pd.Series) -> pd.Series:
    """One value per pairing cell: repeats of one configuration and seed are averaged."""
    if not _pairable(s):
        return s.iloc[0:0]  # nothing to pair on
    return s.groupby(level=list(range(s.index.nlevels)), dropna=True).mean()


def _unpaired(s: pd.Series, paired: pd.Index) -> int:
    """Trials of ``s`` whose cell is not among the ``paired`` cells (NaN keys included)."""
    return int((~s.index.isin(paired)).sum())


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def counted(trials: pd.DataFrame) -> pd.Series:
    """True for the trials whose values enter the statistics: status done, i.e. at the full budget
    (all trials when the frame has no status). A stopped trial ran fewer epochs, a running trial's
    values are provisional and an errored one's were cut short; all are still listed in the
    per-trial table."""
    if "status" not in trials:
        return pd.Series(True, index=trials.index)
    return trials["status"].isin(COUNTED)


def pairing_keys(trials: pd.DataFrame, by: str) -> list[str]:
    """The keys two trials must share to pair: every config key in the table except ``by``
    (``run.seed`` among them when the sweep sets it per trial)."""
    return [c for c in trials.columns if is_config_key(c) and c != by]


def group_statistics(trials: pd.DataFrame, by: str, metric: str, order: list | None = None,
                     pair_on: list[str] | None = None) -> pd.DataFrame:
    """Per value of ``by``, statistics of ``metric`` over the :func:`counted` trials that have a value.

    ``pair_on``: the keys two trials must share to pair (default :func:`pairing_keys`: every other
    swept key). A confirmation pairs on ``run.seed`` alone: each group runs its own best
    configuration, and the same seeds.

    Returns one row per group (index = the group value, name ``by``) with :data:`STAT_COLUMNS`:
    ``n`` (trials with a value), ``mean``, ``std`` (ddof=1), ``ci95_low``/``ci95_high``
    (:func:`t_interval`), and against the best group (``order[0]`` if given, else the best mean by
    :func:`metric_mode`): ``vs_best`` (difference, group − best), ``test`` (:data:`PAIRED`,
    :data:`WELCH` or ""), ``pairs`` (pairs formed), ``t``, ``dof``, ``p`` (two-sided), ``p_holm``
    and ``note`` (why the interval or test is missing, or why not paired). The best group's
    comparison columns are empty and its note says it is the reference. Rows follow ``order`` if
    given, else best mean first, groups without values last.

    Raises:
        KeyError: ``by`` or ``metric`` is not a column.
    """
    for col in (by, metric):
        if col not in trials.columns:
            raise KeyError(f"'{col}' is not a column of the table")
    keys = pairing_keys(trials, by) if pair_on is None else [k for k in pair_on if k in trials.columns]
    trials = trials.assign(**{metric: trials[metric].where(counted(trials))})
    indexed = trials.set_index(keys)[[by, metric]] if keys else trials[[by, metric]].reset_index(drop=True)
    groups = {g: part[metric].astype(float) for g, part in indexed.groupby(by, sort=False, dropna=False)}
    means = {g: v.mean() for g, v in groups.items()}
    if order is None:
        order = sorted(groups, key=lambda g: (math.isnan(means[g]),
                                              -means[g] if metric_mode(metric) == "max" else means[g]))
    best = order[0] if order and not math.isnan(means[order[0]]) else None
    rows = []
    for g in order:
        v = groups[g].dropna()
        low, high = t_interval(v)
        row = {by: g, "n": len(v), "mean": v.mean() if len(v) else math.nan,
               "std": v.std(ddof=1) if len(v) > 1 else math.nan, "ci95_low": low, "ci95_high": high}
        notes = [_interval_note(len(v))]
        if best is None or g == best or len(v) == 0:
            row.update(vs_best=math.nan, test="", pairs=0, t=math.nan, dof=math.nan, p=math.nan, mde=math.nan)
        else:
            c = compare(groups[g], groups[best])
            row.update(vs_best=c.diff, test=c.test, pairs=c.pairs, t=c.t, dof=c.dof, p=c.p, mde=c.mde)
            notes.append(c.note)
        row["note"] = _join(*notes)
        rows.append(row)
    out = pd.DataFrame(rows, columns=[by, *STAT_COLUMNS[:-3], "mde", "note"]).set_index(by)
    out.insert(len(out.columns) - 2, "p_holm", holm(out["p"].to_numpy(float)))
    return out


def _interval_note(n: int) -> str:
    if n == 0:
        return "no trial with a value at the full budget"
    if n == 1:
        return "n = 1: no interval (one value has no spread)"
    if n == 2:  # t(0.975, 1) = tan(0.475 π) = 12.71: the interval is about 9 times the std wide
        return "n = 2: interval uses t(0.975, 1) = 12.71, hence wide"
    return ""
