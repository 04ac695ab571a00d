"""Tables of a sweep: per trial, per group (n, mean, 95 % CI, tests), as Markdown or CSV; the
``raymcn table`` command.

Reading is ``experiment``, statistics ``stats``, rendering ``render.render_table`` (the one table
printer). Plots (``plots``, matplotlib) are imported only where plots are written (``run_table``,
``watch``) and never import this module, so the results modules form no cycle.
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
from pathlib import Path
from typing import Any

import pandas as pd

from raymcn.config import Objective, metric_table
from raymcn.results.columns import (
    SEED_KEY,
    STAGE_KEY,
    SWITCH_EPOCH,
    cell_spec,
    is_config_key,
    is_result_column,
    is_timing_column,
    metric_mode,
)
from raymcn.results.confirmation import CANDIDATE, Confirmation, load_confirmation
from raymcn.results.experiment import ExperimentError, load_experiment, sweep_objective
from raymcn.results.origins import confound, made_by, run_origins
from raymcn.results.render import format_cell, render_table
from raymcn.results.stats import counted, group_statistics, pairing_keys

__all__ = ["ExperimentError", "GroupKeyError", "add_table_arguments", "format_statistics", "format_table",
           "group_table", "load_experiment", "main_table", "report", "run_table", "write_tables"]


class GroupKeyError(KeyError):
    """The key to group by is not a column of the table; the message lists the swept keys."""


# --- public: grouping ----------------------------------------------------------------------------
def group_table(df: pd.DataFrame, by: str, metric: str, pair_on: list[str] | None = None) -> pd.DataFrame:
    """Per value of ``by``, over the group's trials *at the full budget* (status done, when the
    table has a status; stopped, running and errored trials are counted but their values left out:
    a stopped trial ran fewer epochs, a running one's values are provisional, an errored one's were
    cut short):

    ``n`` (trials, any status), ``n_stopped`` (stopped early by the scheduler), ``n_finished``
    (full-budget trials with a ``metric``: what the statistics rest on), the statistics of
    ``metric`` from :func:`stats.group_statistics` (``ci95_low``, ``ci95_high``, ``vs_best``,
    ``test``, ``pairs``, ``t``, ``dof``, ``p``, ``p_holm``, ``mde``, ``note``; the note also counts
    the trials left out), then mean and sample std (``ddof=1``; NaN for a group of one) of every
    result column as ``<col>_mean``, ``<col>_std``. Trials without a value are left out of that
    column's mean/std. ``metric``: a column of a listed metric (the sweep's, ``Objective.column``);
    groups are sorted by its mean, best first by its direction. ``pair_on``: as in
    :func:`stats.group_statistics`.

    Raises:
        GroupKeyError: ``by`` is not a column (e.g. it was not swept); the message lists the swept keys.
    """
    if by not in df.columns:
        swept = [c for c in df.columns if is_config_key(c)]
        raise GroupKeyError(f"cannot group by '{by}': not a column of the table "
                            f"(swept keys: {', '.join(swept) or 'none'})")
    cols = [c for c in df.columns if is_result_column(c) and c != by]
    # trials short of the full budget keep their row (and group) but lose their values
    finished = counted(df)
    masked = df.copy()
    masked.loc[~finished, cols] = math.nan
    g = masked.groupby(by, sort=False, dropna=False)
    out = g.size().rename("n").to_frame()
    stopped = df["status"].eq("stopped") if "status" in df else pd.Series(False, index=df.index)
    out["n_stopped"] = stopped.groupby(df[by], sort=False, dropna=False).sum().reindex(out.index).astype(int)
    if metric in df:
        out["n_finished"] = g[metric].count()
    for c in cols:
        out[f"{c}_mean"] = g[c].mean()
        out[f"{c}_std"] = g[c].std(ddof=1)
    key = f"{metric}_mean"
    if key in out:
        out = out.sort_values(key, ascending=metric_mode(metric) == "min", na_position="last", kind="stable")
    if metric in df:
        # positional: group_statistics returns the groups in exactly the order passed
        st = group_statistics(masked, by, metric, order=list(out.index), pair_on=pair_on).drop(
            columns=["n", "mean", "std"])
        left_out = df[~finished].groupby(by, sort=False, dropna=False)["status"].value_counts()
        st["note"] = [_join(note, _not_counted(left_out, g_)) for note, g_ in zip(st["note"], out.index)]
        for i, c in enumerate(st.columns):
            out.insert(3 + i, c, st[c].to_numpy())
    return out.reset_index()


def _not_counted(counts: pd.Series, group: Any) -> str:
    try:
        per_status = counts.loc[group]
    except KeyError:
        return ""
    words = {"error": "errored", "stopped": "stopped-early"}
    return ", ".join(f"{k} {words.get(s, s)} trial{'s' if k > 1 else ''}" for s, k in per_status.items()) + \
        " not counted"


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


STATS_COLUMNS = ("n_stopped", "ci95_low", "ci95_high", "vs_best", "test", "pairs", "t", "dof", "p", "p_holm", "mde",
                 "note")


def means_only(grouped: pd.DataFrame) -> pd.DataFrame:
    """The grouped table without the statistics columns: group key, n, n_finished, mean/std pairs."""
    return grouped.drop(columns=[c for c in STATS_COLUMNS if c in grouped])


# --- public: formatting --------------------------------------------------------------------------
def format_table(df: pd.DataFrame, fmt: str = "md", metric: str | None = None) -> str:
    """``md``: a Markdown pipe table (via ``render.render_table``), numbers right-aligned and
    rounded per column kind (:func:`~raymcn.results.columns.cell_spec`: a metric as its table
    says, losses 4 significant digits), missing values as ``-``, ``X_mean``/``X_std`` pairs as one
    column ``X`` "12.34 ± 1.20", ``ci95_low``/``ci95_high`` (a :func:`group_table`'s interval of
    ``metric``, in its format) as one column ``95% CI (t)`` "[10.1, 14.6]". ``csv``: every column
    at full precision (pairs stay separate).

    Raises:
        ValueError: the table has an interval and ``metric`` is not given.
    """
    if fmt != "md":
        return render_table(df, fmt)
    display: dict[str, Any] = {}
    merged = []  # pre-formatted string columns, right-aligned like the numbers they hold
    for col in df.columns:
        if (col.endswith("_std") and f"{col[:-4]}_mean" in df) or (col == "ci95_high" and "ci95_low" in df):
            continue
        if col.endswith("_mean") and f"{col[:-5]}_std" in df:
            base = col[:-5]
            display[base] = [_pm(base, m, s) for m, s in zip(df[col], df[f"{base}_std"])]
            merged.append(base)
        elif col == "ci95_low" and "ci95_high" in df:
            if metric is None:
                raise ValueError("format_table: the table has a 95% interval; name the metric it is of")
            display["95% CI (t)"] = [_ci(lo, hi, cell_spec(metric)) for lo, hi in zip(df[col], df["ci95_high"])]
            merged.append("95% CI (t)")
        else:
            display[col] = df[col].reset_index(drop=True)
    return render_table(pd.DataFrame(display), "md", spec=cell_spec, right=merged)


def _pm(col: str, mean: Any, std: Any) -> str:
    spec = cell_spec(col)
    return f"{format_cell(mean, spec)} ± {format_cell(std, spec)}"


def _ci(low: Any, high: Any, spec: str) -> str:
    if pd.isna(low) or pd.isna(high):
        return "-"
    return f"[{format_cell(low, spec)}, {format_cell(high, spec)}]"


def format_statistics(grouped: pd.DataFrame, by: str, pair_keys: list[str], metric: str,
                      heading: str | None = None, confirmation: bool = False) -> str:
    """The answer to "which group is best", as Markdown: per group the trials (searched, stopped
    early, at the full budget; a ``confirmation`` shows its seeds instead), mean, 95 % t-interval,
    std, difference to the best group, test, pairs, p, the Holm-adjusted p and the detectable
    difference; below it the rule (naming ``pair_keys``) and each group's note (why an interval
    or a test is missing, why a test is Welch's). ``heading`` replaces the first line."""
    heading = heading or f"{metric} by {by}:"
    if "ci95_low" not in grouped:
        return f"{heading}\n\nno trial reported {metric}: no statistics\n"
    if grouped[f"{metric}_mean"].isna().all():  # e.g. a sweep whose first trials are still running
        return f"{heading}\n\nno trial with a value at the full budget yet\n"
    spec, best = cell_spec(metric), grouped[by].iloc[0]
    tested = grouped["test"] != ""
    counts = {"seeds": grouped["n_finished"]} if confirmation else {
        "trials": grouped["n"], "stopped early": grouped["n_stopped"], "n (full budget)": grouped["n_finished"]}
    view = pd.DataFrame({
        by: grouped[by], **counts,
        "mean": [format_cell(v, spec) for v in grouped[f"{metric}_mean"]],
        "95% CI (t)": [_ci(lo, hi, spec) for lo, hi in zip(grouped["ci95_low"], grouped["ci95_high"])],
        "std": [format_cell(v, spec) for v in grouped[f"{metric}_std"]],
        f"Δ vs {best}": [format_cell(v, "+" + spec) for v in grouped["vs_best"]],
        "test": grouped["test"].where(tested, None),
        "pairs": grouped["pairs"].where(tested).astype("Int64"),
        "p": [format_cell(v, ".2g") for v in grouped["p"]],
        "p (Holm)": [format_cell(v, ".2g") for v in grouped["p_holm"]],
        "detectable Δ": [format_cell(v, spec) for v in grouped["mde"]]})
    table = render_table(view, "md", right=("mean", "95% CI (t)", "std", f"Δ vs {best}", "p", "p (Holm)",
                                            "detectable Δ"))
    paired_on = ", ".join(pair_keys) if pair_keys else "nothing: no other key was swept"
    counted_as = ("seeds = confirmation runs with a value (fresh seeds, full budget, each group its own selected "
                  "configuration)" if confirmation else
                  "n = trials that ran the full budget (schedule.epochs) with a value; trials stopped early ran "
                  "fewer epochs and are counted, never averaged with them")
    pairing = (f"paired t-test over the seeds both ran ({paired_on})" if confirmation else
               f"paired t-test over trials that differ only in {by} (same {paired_on}; repeats of one cell "
               "averaged), Welch's t-test when fewer than 2 pairs form")
    rule = (f"{counted_as}. 95% CI (t) = Student t-interval mean ± t(0.975, n−1)·s/√n. Δ, test and p: against the "
            f"best {by} ({best}), two-sided: {pairing}; p (Holm) adjusts for comparing every group with the best "
            "one, itself picked from these data. Detectable Δ: the smallest true difference this test, with these "
            "n and the spread seen, finds at 80% power (α = 0.05): a larger p says the difference is likely "
            "smaller than that, not that there is none.")
    lines = [heading, "", table.rstrip("\n"), "", *textwrap.wrap(rule, 100)]
    for g, note in zip(grouped[by], grouped["note"]):
        if isinstance(note, str) and note:
            lines += textwrap.wrap(f"- {g}: {note}", 100, subsequent_indent="  ")
    return "\n".join(lines) + "\n"


# --- command line ------------------------------------------------------------------------------------
def add_table_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of ``raymcn table``; returns ``parser`` so callers can chain ``.parse_args``."""
    parser.add_argument("experiment_dir", help="Tune experiment directory (holds raymcn_sweep.yaml and trial dirs)")
    parser.add_argument("--format", choices=("md", "csv"), default="md", help="table format (default md)")
    parser.add_argument("--out", metavar="DIR", help="csv: write every table (the search's trials and groups, the "
                        "confirmation's) as CSV files into DIR instead of one table to stdout")
    parser.add_argument("--group-by", metavar="KEY", default=None,
                        help=f"also print n, mean, 95%% CI and tests against the best group per value of KEY "
                             f"(md default: {STAGE_KEY} when swept; with --format csv only the grouped table "
                             "is printed)")
    parser.add_argument("--no-plots", action="store_true", help="do not write PNG plots into the experiment dir")
    parser.add_argument("--timing", action="store_true",
                        help="md: add the per-step timing columns (time_*_s, samples_per_s); csv always has them")
    return parser


def without_timing(df: pd.DataFrame) -> pd.DataFrame:
    """Drop the step-timing columns (kept in CSV; shown in Markdown with --timing)."""
    return df[[c for c in df.columns if not is_timing_column(c.removesuffix("_mean").removesuffix("_std"))]]


def compact(trials: pd.DataFrame, target: Objective) -> pd.DataFrame:
    """The columns a live view has room for: trial, status, epochs, swept keys, the final and best
    value of the sweep's metric (``target``), the best of each metric the table marks ``compact``
    (the median rank), total_loss, samples/s."""
    shown = [target.metric, *(m for m in metric_table() if m.compact and m != target.metric)]
    keep = ["trial", "status", "epochs", *[c for c in trials.columns if is_config_key(c)],
            f"final_{target.metric.name}", *(f"best_{m.name}" for m in shown), "total_loss", "samples_per_s"]
    return trials[[c for c in keep if c in trials.columns]]


def group_key(trials: pd.DataFrame, requested: str | None) -> str | None:
    """The key to group by: the requested one, else the stage order when it was swept."""
    return requested or (STAGE_KEY if STAGE_KEY in trials else None)


def report(trials: pd.DataFrame, by: str | None, target: Objective, *, timing: bool = False, brief: bool = False,
           heading: str | None = None) -> str:
    """The Markdown report of ``raymcn table`` (and, ``brief``, of ``raymcn watch``): the per-trial
    table, then for ``by`` the statistics table of the sweep's metric (``target``; its first line
    ``heading``, when given) and (unless ``brief``) mean ± std of every result column per group.
    ``brief`` shows the :func:`compact` columns.

    Raises:
        GroupKeyError: ``by`` is not a column.
    """
    grouped = group_table(trials, by, target.column) if by else None
    shown = (lambda df: df) if timing else without_timing
    view = compact(trials, target) if brief else shown(trials.drop(columns=[SWITCH_EPOCH], errors="ignore"))
    parts = [format_table(view, "md")]
    if grouped is not None:
        parts.append(format_statistics(grouped, by, pairing_keys(trials, by), target.column, heading=heading))
        if not brief:
            parts.append(f"mean ± std (ddof=1) over the full-budget trials, grouped by {by}:\n\n"
                         + format_table(shown(means_only(grouped)), "md"))
    return "\n".join(parts)


# --- the confirmation ----------------------------------------------------------------------------------
def confirmation_grouped(conf: Confirmation) -> pd.DataFrame:
    """The confirmation's group table: per candidate (per value of ``per`` when top is 1), paired
    on the seed alone."""
    return group_table(conf.trials, conf.settings.group_column, conf.objective.column, pair_on=[SEED_KEY])


def search_heading(trials: pd.DataFrame, by: str | None, conf: Confirmation | None) -> str | None:
    """The search's statistics heading when a confirmation follows it (None: the default heading)."""
    if conf is None:
        return None
    return (f"Search ({len(trials)} trials; its best per {conf.settings.per} is confirmed below), "
            f"{conf.objective.column} by {by}:")


def confirmation_report(conf: Confirmation) -> str:
    """What was confirmed and why (the selection), the confirmation runs, their statistics and the
    answer line."""
    s, target = conf.settings, conf.objective
    spec = cell_spec(target.column)
    keys = sorted({k for c in conf.candidates for k in c.config if k != s.per})
    selection = pd.DataFrame({
        s.group_column: [c.label for c in conf.candidates],
        **{k: [c.config.get(k) for c in conf.candidates] for k in keys},
        "search mean": [format_cell(c.score, spec) for c in conf.candidates],
        "search trials": [c.trials for c in conf.candidates],
        "selected at": [c.basis for c in conf.candidates]})
    done = int((conf.trials["status"] == "done").sum()) if len(conf.trials) else 0
    parts = [f"Confirmation: {s.what} per {s.per} from the search, each trained again "
             f"over seeds {', '.join(map(str, conf.seeds))} (fresh, the same for every group) at the full budget; "
             f"{done} of {conf.planned} runs done.\n", render_table(selection, "md", right=("search mean",))]
    if len(conf.trials):
        view = compact(conf.trials, target)
        if s.top > 1:
            view.insert(2, CANDIDATE, conf.trials[CANDIDATE])
        parts.append(format_table(view, "md"))
        grouped = confirmation_grouped(conf)
        by = s.group_column
        parts.append(format_statistics(grouped, by, [SEED_KEY], target.column,
                                       heading=f"{target.column} by {by}, confirmation:", confirmation=True))
        parts.append(answer_line(grouped, by, done, conf.planned, target.column, caution=confirmation_caution(conf)))
    return "\n".join(parts)


def confirmation_caution(conf: Confirmation) -> str:
    """What the confirmation's runs differ in (code, environment, data), by group (``origins.confound``)."""
    if not len(conf.trials):
        return ""
    column = conf.settings.group_column
    return confound({str(t): conf.origins.get(str(t)) for t in conf.trials["trial"]},
                   {str(t): str(g) for t, g in zip(conf.trials["trial"], conf.trials[column])})


def search_caution(trials: pd.DataFrame, by: str | None, origins: dict) -> str:
    """What the search's runs differ in (code, environment, data), by ``by``'s group ("" without one)."""
    if by is None or by not in trials:
        return ""
    return confound({str(t): origins.get(str(t)) for t in trials["trial"]},
                   {str(t): str(g) for t, g in zip(trials["trial"], trials[by])})


def answer_line(grouped: pd.DataFrame, by: str, done: int, planned: int, metric: str,
                alpha: float = 0.05, caution: str = "") -> str:
    """The research question's answer in one paragraph, from the confirmation's group table of
    ``metric`` (the sweep's, best group first by its direction): the best group with its mean,
    interval and seeds; the groups it beats (Holm-adjusted p below ``alpha``); the ones it cannot
    be told from, with the difference this many seeds could detect; ``caution``: what the runs
    compared differ in (:func:`confirmation_caution`), said beside the statistics."""
    g = grouped[grouped["n_finished"] > 0]
    if g.empty:
        return "Answer: none yet (no confirmation run has finished).\n"
    spec = cell_spec(metric)
    best = g.iloc[0]
    text = (f"Answer: {best[by]} learns the best joint space by {metric}: {format_cell(best[f'{metric}_mean'], spec)}"
            f", 95% CI {_ci(best['ci95_low'], best['ci95_high'], spec)} over {int(best['n_finished'])} seeds")
    beaten, tied = [], []
    for _, r in g.iloc[1:].iterrows():
        diff = f"{best[by]} ahead by {format_cell(abs(r['vs_best']), spec)}"
        if r["test"] and pd.notna(r["p_holm"]) and r["p_holm"] < alpha:
            beaten.append(f"{r[by]} ({diff}, p Holm {format_cell(r['p_holm'], '.2g')})")
        else:
            why = f"p Holm {format_cell(r['p_holm'], '.2g')}" if r["test"] else "no test"
            detect = f"; detectable Δ {format_cell(r['mde'], spec)}" if pd.notna(r["mde"]) else ""
            tied.append(f"{r[by]} ({diff}, {why}{detect})")
    if beaten:
        text += f"; better than {', '.join(beaten)}"
    if tied:
        text += (f"; not told apart from {', '.join(tied)}: with this many seeds a true difference below the "
                 "detectable Δ would likely go unseen")
    if done < planned:
        text = f"(provisional: {done} of {planned} confirmation runs done) " + text
    return "\n".join(textwrap.wrap(text + "." + (f" {caution}" if caution else ""), 100)) + "\n"


def write_tables(out: str | Path, trials: pd.DataFrame, by: str | None, conf: Confirmation | None,
                 target: Objective) -> list[Path]:
    """Every table of a sweep as CSV files in the folder ``out`` (full precision, every column):
    the search's trials and (grouped ``by``, statistics of ``target``) groups, the confirmation's
    trials and groups. Returns the paths written."""
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tables = {"search_trials.csv": trials}
    if by is not None:
        tables["search_groups.csv"] = group_table(trials, by, target.column)
    if conf is not None and len(conf.trials):
        tables["confirmation_trials.csv"] = conf.trials
        tables["confirmation_groups.csv"] = confirmation_grouped(conf)
    written = []
    for name, df in tables.items():
        df.to_csv(out / name, index=False)
        written.append(out / name)
    return written


def run_table(args: argparse.Namespace) -> int:
    """Print the table (and grouped table), write plots; 0 on success, 2 on a bad directory or key.
    A confirmed sweep prints the search (labelled so) and then its confirmation, whose plots take
    the plain names (the search's get ``search_`` in front)."""
    try:
        trials, curves = load_experiment(args.experiment_dir)
        target = sweep_objective(args.experiment_dir)
    except ExperimentError as e:
        print(f"raymcn table: {e}", file=sys.stderr)
        return 2
    conf = load_confirmation(args.experiment_dir)
    origins = run_origins(args.experiment_dir, trials["trial"])
    by = group_key(trials, args.group_by) if args.format == "md" else args.group_by
    try:
        if args.format == "csv" and getattr(args, "out", None):
            for path in write_tables(args.out, trials, by or group_key(trials, None), conf, target):
                print(f"table: {path}", file=sys.stderr)
        elif args.format == "csv" and conf is not None and not args.group_by:
            # the confirmation's group table is the answer: that is what a pipe gets
            print(format_table(confirmation_grouped(conf), "csv"), end="")
        elif args.format == "csv":
            # csv goes to a file or a pipe: exactly one table on stdout, notes on stderr
            print(format_table(group_table(trials, by, target.column) if by else trials, "csv"), end="")
        else:
            phases = {"search": origins, **({"confirmation": conf.origins} if conf is not None else {})}
            print("Where these numbers come from (each run's record: docs/sweeps.md, \"Where the numbers come from\"):\n"
                  + "\n".join(made_by(phases)) + "\n")
            print(report(trials, by, target, timing=getattr(args, "timing", False),
                         heading=search_heading(trials, by, conf)))
            if conf is None and (said := search_caution(trials, by, origins)):
                print("\n".join(textwrap.wrap(said, 100)) + "\n")
            if conf is not None:
                print(confirmation_report(conf))
    except GroupKeyError as e:
        print(f"raymcn table: {e.args[0]}", file=sys.stderr)
        return 2
    notes = sys.stderr if args.format == "csv" else sys.stdout
    if not args.no_plots:
        from raymcn.results.plots import write_plots  # matplotlib only when plots are wanted

        skipped = lambda msg: print(f"skipped {msg}", file=notes)  # noqa: E731
        where = Path(args.experiment_dir).expanduser()
        written = write_plots(where, trials, curves, target, on_skip=skipped,
                              prefix="search_" if conf is not None else "")
        if conf is not None and len(conf.trials):
            written += write_plots(where, conf.trials, conf.curves, conf.objective, on_skip=skipped,
                                   by=conf.settings.group_column, pair_on=[SEED_KEY], phase="confirmation")
        for path in written:
            print(f"plot: {path}", file=notes)
    return 0


def main_table(argv: list[str] | None = None) -> int:
    """``raymcn table EXPERIMENT_DIR [--format md|csv] [--group-by KEY] [--no-plots] [--timing]``."""
    parser = add_table_arguments(argparse.ArgumentParser(prog="raymcn table", description=__doc__.splitlines()[0]))
    return run_table(parser.parse_args(argv))
