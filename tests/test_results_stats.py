"""Statistics of the grouped table on fixed inputs, against hand-computed numbers (closed-form t
distributions for small df, Holm's adjustment); the pairing rule,
small-n handling, the Markdown contract of the statistics table, the one table renderer, and the
layering of the results package (no cycle, allowed imports only)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from raymcn.results.render import render_table
from raymcn.results.stats import (
    PAIRED,
    WELCH,
    compare,
    detectable_difference,
    group_statistics,
    holm,
    pairing_keys,
    t_interval,
)
from raymcn.results.table import format_statistics, group_table

R10 = "best_text_to_video_R@10"
T975 = {1: 12.706204736174707, 3: 3.182446305284263, 4: 2.7764451051977987}  # Student t tables


def t_cdf_df3(t: float) -> float:
    """Closed form of Student's t CDF with 3 degrees of freedom (independent of scipy)."""
    return 0.5 + (t / (math.sqrt(3) * (1 + t * t / 3)) + math.atan(t / math.sqrt(3))) / math.pi


# --- interval ---------------------------------------------------------------------------------------
def test_t_interval_hand_checked():
    low, high = t_interval([1, 2, 3, 4, 5])  # mean 3, s = √2.5, se = √0.5
    half = T975[4] * math.sqrt(2.5) / math.sqrt(5)
    assert (low, high) == pytest.approx((3 - half, 3 + half))
    assert (low, high) == pytest.approx((1.0367568, 4.9632432))
    assert t_interval([10.0, 14.0]) == pytest.approx((12 - T975[1] * 2, 12 + T975[1] * 2))  # n = 2: wide
    assert all(math.isnan(v) for v in t_interval([7.0]))  # n = 1: no spread, no interval
    assert all(math.isnan(v) for v in t_interval([np.nan, 7.0]))  # NaN is not a value
    assert t_interval([5.0, 5.0, 5.0]) == (5.0, 5.0)  # no spread: the point itself
    assert t_interval([1, 2, 3, 4, 5], confidence=0.99)[1] > high


# --- tests ---------------------------------------------------------------------------------------------
def seeds(*s):
    return pd.Index(s, name="run.seed")


def test_paired_t_test_hand_checked():
    # differences -2, -3, -2, -3: mean -2.5, sd √(1/3), t = -2.5 / (sd/2) = -8.660, df 3
    a = pd.Series([28.0, 31, 29, 30], index=seeds(1, 2, 3, 4))
    b = pd.Series([30.0, 34, 31, 33], index=seeds(1, 2, 3, 4))
    c = compare(a, b)
    t = -2.5 / (math.sqrt(1 / 3) / 2)
    assert (c.test, c.pairs, c.dof) == (PAIRED, 4, 3)
    assert c.diff == pytest.approx(-2.5) and c.t == pytest.approx(t)
    assert c.p == pytest.approx(2 * (1 - t_cdf_df3(abs(t))), rel=1e-9)  # 0.003216
    assert c.note == ""
    # the pairing follows the seed, not the row order
    assert compare(a.iloc[::-1], b).p == pytest.approx(c.p)


def test_paired_df2_closed_form_and_repeats_averaged():
    # seed 1 ran twice in the first group (4 and 6): averaged to 5 before pairing
    a = pd.Series([4.0, 6.0, 15.0, 24.5], index=seeds(1, 1, 2, 3))
    b = pd.Series([10.0, 20.0, 30.0], index=seeds(1, 2, 3))
    c = compare(a, b)
    d = np.array([5 - 10, 15 - 20, 24.5 - 30])
    t = d.mean() / (d.std(ddof=1) / math.sqrt(3))
    assert (c.test, c.pairs) == (PAIRED, 3) and c.t == pytest.approx(t)
    assert c.p == pytest.approx(1 - abs(t) / math.sqrt(t * t + 2))  # exact two-sided p for df = 2
    assert c.note == ""  # a repeat is averaged, not left out


def test_unpaired_trials_are_named_and_nan_keys_never_pair():
    a = pd.Series([28.0, 31, 29, 99], index=seeds(1, 2, 3, np.nan))
    b = pd.Series([30.0, 34, 31, 33], index=seeds(1, 2, 3, 4))
    c = compare(a, b)
    assert (c.test, c.pairs) == (PAIRED, 3)
    assert c.note == "2 unpaired trial(s) left out of the paired test"  # a's NaN seed and b's seed 4


def test_welch_when_no_pairs_form():
    lr = pd.MultiIndex.from_tuples([(1, 2e-4), (2, 5e-4), (3, 7e-4), (4, 1e-4)], names=["run.seed", "optim.lr"])
    best_idx = pd.MultiIndex.from_tuples([(1, 1e-3), (2, 1e-3), (3, 1e-3)], names=["run.seed", "optim.lr"])
    a, b = np.array([3.0, 4.5, 6.0, 7.0]), np.array([1.0, 2.0, 2.5])
    c = compare(pd.Series(a, index=lr), pd.Series(b, index=best_idx))
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size  # Welch–Satterthwaite by hand
    assert c.test == WELCH and c.pairs == 0
    assert c.t == pytest.approx((a.mean() - b.mean()) / math.sqrt(va + vb))
    assert c.dof == pytest.approx((va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1)))
    assert c.p == pytest.approx(0.025341986, rel=1e-6)  # t = 3.3594 on 4.30 df
    assert "no trial shares seed and config" in c.note and "Welch" in c.note
    one_pair = compare(pd.Series(a[:2], index=seeds(1, 9)), pd.Series(b[:2], index=seeds(1, 8)))
    assert one_pair.test == WELCH and one_pair.pairs == 1 and one_pair.note.startswith("only 1 pair")
    nothing = compare(pd.Series(a), pd.Series(b))  # no key at all in the index
    assert nothing.test == WELCH and nothing.note.startswith("no swept key to pair on")


def test_small_n_and_no_spread_give_no_p_value():
    c = compare(pd.Series([5.0], index=seeds(1)), pd.Series([7.0, 9.0], index=seeds(2, 3)))
    assert c.test == "" and math.isnan(c.p) and "n = 1 vs 2" in c.note and c.diff == pytest.approx(-3.0)
    const = compare(pd.Series([5.0, 6.0], index=seeds(1, 2)), pd.Series([7.0, 8.0], index=seeds(1, 2)))
    assert const.test == PAIRED and math.isnan(const.p) and "no spread" in const.note  # both differences -2


def test_holm_against_hand_computation():
    """Sorted 0.005, 0.01, 0.03, 0.04, 0.20 (m = 5): 5·0.005, 4·0.01, 3·0.03, max(0.09, 2·0.04),
    max(0.09, 1·0.20), back in the order given."""
    p = np.array([0.01, 0.04, 0.03, 0.20, 0.005])
    assert holm(p) == pytest.approx([0.04, 0.09, 0.09, 0.20, 0.025])
    with_nan = holm([0.02, np.nan, 0.04])
    assert with_nan[0] == pytest.approx(0.04) and math.isnan(with_nan[1]) and with_nan[2] == pytest.approx(0.04)
    assert holm([]).size == 0


# --- detectable difference ----------------------------------------------------------------------------
def test_detectable_difference_against_hand_computation():
    """Hand values: the textbook approximation δ ≈ (t(0.975, dof) + t(0.8, dof))·SE, which for
    large dof is (1.95996 + 0.84162)·SE = 2.8016·SE. For 10 pairs: t(0.975, 9) = 2.2622,
    t(0.8, 9) = 0.8834 (tables), so δ ≈ 3.1456·SE; the exact noncentral-t value lies within 1 %."""
    from scipy import stats as st

    assert detectable_difference(1.0, 10_000) == pytest.approx(1.95996 + 0.84162, rel=1e-3)
    assert detectable_difference(0.5, 9) == pytest.approx(0.5 * (2.2622 + 0.8834), rel=0.01)
    for se, dof in ((1.0, 1), (0.3, 2), (2.0, 4), (1.0, 9)):
        delta = detectable_difference(se, dof)
        crit = st.t.ppf(0.975, dof)  # at δ the test rejects with probability 0.8 exactly
        power = st.nct.sf(crit, dof, delta / se) + np.nan_to_num(st.nct.cdf(-crit, dof, delta / se))
        assert power == pytest.approx(0.8, abs=1e-6)
        assert delta >= (crit + st.t.ppf(0.8, dof)) * se * 0.999  # never below the approximation's
    assert detectable_difference(2.0, 9) == pytest.approx(2 * detectable_difference(1.0, 9))  # scales with SE
    assert math.isnan(detectable_difference(0.0, 5)) and math.isnan(detectable_difference(1.0, 0))


def test_paired_mde_uses_the_spread_of_the_differences():
    best = pd.Series([30.0, 34, 31, 33], index=pd.Index([1, 2, 3, 4], name="run.seed"))
    other = best - pd.Series([1.0, 3, 2, 2], index=best.index)
    c = compare(other, best)
    d = np.array([1.0, 3, 2, 2])
    assert c.test == PAIRED and c.mde == pytest.approx(detectable_difference(d.std(ddof=1) / 2, 3))


def test_pair_on_seed_alone_pairs_groups_with_their_own_configurations():
    """A confirmation: each order runs its own lr, on the same seeds. Pairing on every swept key
    would find no pair; pair_on=["run.seed"] pairs the seeds present in both groups and leaves
    the others out."""
    rows = [("joint", 1e-3, s, v, "done") for s, v in zip((11, 12, 13, 14), (30.0, 34, 31, 33))]
    rows += [("AV_T", 3e-3, s, v, "done") for s, v in zip((11, 12, 13, 15), (28.0, 31, 29, 40))]
    df = pd.DataFrame(rows, columns=["schedule.stage_order", "optim.lr", "run.seed", R10, "status"])
    assert group_statistics(df, "schedule.stage_order", R10).loc["AV_T", "test"] == WELCH
    g = group_statistics(df, "schedule.stage_order", R10, pair_on=["run.seed"])
    assert g.loc["AV_T", "test"] == PAIRED and g.loc["AV_T", "pairs"] == 3  # seeds 11, 12, 13 only
    assert g.loc["AV_T", "vs_best"] == pytest.approx(np.mean([28 - 30, 31 - 34, 29 - 31]))
    assert "2 unpaired trial(s) left out" in g.loc["AV_T", "note"]


# --- per group ---------------------------------------------------------------------------------------
def trials_frame() -> pd.DataFrame:
    """joint (best) and AV_T share seed and lr (paired); AV_T also has a trial stopped early (a
    smaller budget: never in a mean, however good); AT_V has other lrs (Welch); VT_A has one
    finished trial and a running one (n = 1, no interval, no test)."""
    rows = [("joint", 1e-3, s, v, "done") for s, v in zip((1, 2, 3, 4), (30.0, 34, 31, 33))]
    rows += [("AV_T", 1e-3, s, v, "done") for s, v in zip((1, 2, 3, 4), (28.0, 31, 29, 30))]
    rows += [("AV_T", 1e-3, 1, 99.0, "stopped")]
    rows += [("AT_V", lr, s, v, "done") for s, lr, v in zip((1, 2, 3), (2e-4, 5e-4, 7e-4), (20.0, 25, 22))]
    rows += [("VT_A", 1e-3, 1, 15.0, "done"), ("VT_A", 1e-3, 2, 40.0, "running")]
    df = pd.DataFrame(rows, columns=["schedule.stage_order", "optim.lr", "run.seed", R10, "status"])
    return df.assign(trial=[f"t{i}" for i in range(len(df))], epochs=4)


def test_group_statistics_rule_and_numbers():
    df = trials_frame()
    assert pairing_keys(df, "schedule.stage_order") == ["optim.lr", "run.seed"]
    g = group_statistics(df, "schedule.stage_order", R10)
    assert list(g.index) == ["joint", "AV_T", "AT_V", "VT_A"]  # best mean first (running VT_A's 40 not counted)
    joint = np.array([30.0, 34, 31, 33])
    half = T975[3] * joint.std(ddof=1) / 2
    assert (g.loc["joint", "ci95_low"], g.loc["joint", "ci95_high"]) == pytest.approx((32 - half, 32 + half))
    assert g.loc["joint", "test"] == "" and math.isnan(g.loc["joint", "p"])
    assert g.loc["AV_T", "test"] == PAIRED and g.loc["AV_T", "pairs"] == 4
    assert g.loc["AV_T", "vs_best"] == pytest.approx(-2.5)  # the stopped trial's 99 in neither mean nor pairs
    assert g.loc["AV_T", "n"] == 4 and g.loc["AV_T", "mean"] == pytest.approx(29.5)
    assert g.loc["AT_V", "test"] == WELCH and g.loc["AT_V", "pairs"] == 0
    assert g.loc["VT_A", "n"] == 1 and math.isnan(g.loc["VT_A", "ci95_low"]) and g.loc["VT_A", "test"] == ""
    assert "n = 1: no interval" in g.loc["VT_A", "note"]
    assert g["p_holm"].iloc[1:3].to_numpy() == pytest.approx(holm(g["p"].iloc[1:3].to_numpy()))
    assert math.isnan(g.loc["VT_A", "p_holm"])  # no test, not counted in the Holm family
    two = group_statistics(df[df["run.seed"] <= 2], "schedule.stage_order", R10)
    assert "n = 2: interval uses t(0.975, 1) = 12.71" in two.loc["joint", "note"]


def test_group_statistics_follows_metric_direction():
    df = trials_frame().rename(columns={R10: "best_text_to_video_MedR"})
    g = group_statistics(df, "schedule.stage_order", metric="best_text_to_video_MedR")
    assert g.index[0] == "VT_A"  # lowest MedR is best (its single finished trial, 15)


def test_group_table_and_statistics_markdown():
    df = trials_frame()
    grouped = group_table(df, "schedule.stage_order", metric=R10)
    assert grouped["n"].tolist() == [4, 5, 3, 2] and grouped["n_finished"].tolist() == [4, 4, 3, 1]
    assert grouped["n_stopped"].tolist() == [0, 1, 0, 0]
    notes = grouped.set_index("schedule.stage_order")["note"]
    assert "1 running trial not counted" in notes["VT_A"] and "1 stopped-early trial not counted" in notes["AV_T"]
    md = format_statistics(grouped, "schedule.stage_order", ["optim.lr", "run.seed"], metric=R10)
    lines = md.splitlines()
    assert lines[0] == f"{R10} by schedule.stage_order:"
    header = [c.strip() for c in lines[2].strip("|").split("|")]
    assert header == ["schedule.stage_order", "trials", "stopped early", "n (full budget)", "mean", "95% CI (t)",
                      "std", "Δ vs joint", "test", "pairs", "p", "p (Holm)", "detectable Δ"]
    rows = {r[0]: r for r in ([c.strip() for c in line.strip("|").split("|")] for line in lines[4:8])}
    half = T975[3] * np.std([30.0, 34, 31, 33], ddof=1) / 2
    assert rows["joint"][4:6] == ["32.00", f"[{32 - half:.2f}, {32 + half:.2f}]"]
    assert rows["AV_T"][1:4] == ["5", "1", "4"]
    assert rows["AV_T"][7:10] == ["-2.50", "paired t", "4"]
    d = np.array([28.0, 31, 29, 30]) - np.array([30.0, 34, 31, 33])
    assert float(rows["AV_T"][12]) == pytest.approx(detectable_difference(d.std(ddof=1) / 2, 3), abs=0.006)
    assert rows["AT_V"][8] == "Welch t" and rows["VT_A"][5] == "-" and rows["VT_A"][8] == "-"
    assert "same optim.lr, run.seed" in md.replace("\n", " ")
    assert "- VT_A: n = 1: no interval" in md


# --- rendering ---------------------------------------------------------------------------------------
def test_render_table_markdown_and_csv():
    rows = [{"name": "a|b", "x": 1.23456, "n": 3, "s": "1 ± 2"}, {"name": "c", "x": float("nan"), "n": 4, "s": None}]
    md = render_table(rows, spec={"x": ".2f"}, right=["s"])
    assert md.splitlines() == ["| name | x | n | s |", "|---|---:|---:|---:|",
                               "| a\\|b | 1.23 | 3 | 1 ± 2 |", "| c | - | 4 | - |"]
    assert render_table(pd.DataFrame(rows), "csv").splitlines()[1] == "a|b,1.23456,3,1 ± 2"
    with pytest.raises(ValueError, match="html"):
        render_table(rows, "html")


# --- layering ------------------------------------------------------------------------------------------
RESULTS = Path(__file__).resolve().parents[1] / "raymcn" / "results"
ALLOWED_THIRD_PARTY = {"numpy", "pandas", "scipy", "statsmodels", "matplotlib", "yaml"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_results_layering_no_cycle_allowed_imports():
    import sys

    graph = {}
    for path in RESULTS.glob("*.py"):
        imports = _imports(path)
        raymcn = {m for m in imports if m.startswith("raymcn")}
        # the config, the record files' reader (raymcn/provenance: stdlib and storage) and results itself
        records = {m for m in raymcn if m == "raymcn.provenance" or m.startswith("raymcn.provenance.")}
        assert raymcn - records <= {"raymcn.config"} | {f"raymcn.results.{p.stem}" for p in RESULTS.glob("*.py")}, \
            path.name
        other = {m.split(".")[0] for m in imports - raymcn} - set(sys.stdlib_module_names) - {"__future__"}
        assert other <= ALLOWED_THIRD_PARTY, (path.name, other)
        graph[path.stem] = {m.rsplit(".", 1)[1] for m in raymcn if m.startswith("raymcn.results.")}
    assert "table" not in graph["plots"] and "plots" not in graph["stats"]
    visiting, done = set(), set()

    def visit(node, trail):
        assert node not in visiting, f"import cycle: {' -> '.join(trail + [node])}"
        if node in done:
            return
        visiting.add(node)
        for dep in graph.get(node, ()):
            visit(dep, trail + [node])
        visiting.discard(node)
        done.add(node)

    for module in graph:
        visit(module, [])
