"""``sweep.metric``: what a sweep optimizes, any metric of the one table (``config/metrics.py``),
its direction and format from that table wherever it is used (no Ray started).

A sweep by the median rank (lower is better) on hand-built experiment folders: its trials, groups,
confirmation, answer, live view and plots take the lowest as the best; Tune is given the metric
and its mode; a sweep saved before the setting existed reads as before. Then the table extended
(R@100, and an upper-quartile rank) as a contributor would: evaluated, formatted, ordered and
usable as ``sweep.metric`` with no other module changed. Last, no module of raymcn but the table
spells a metric's name or looks one up by position. The sweep itself, on Ray, is
``tests/test_rehearsals.py::test_a_shipped_sweep_by_the_median_rank_answers_by_the_lowest``.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import yaml

import raymcn.config.metrics as table_module
from raymcn.config import (
    DEFAULT_OBJECTIVE,
    Config,
    ConfigError,
    Metric,
    load_config,
    load_config_text,
    metric,
    metric_names,
    objective,
    objective_choices,
)
from raymcn.results.confirmation import ConfirmSettings, plan_text, select_candidates, trial_configs
from raymcn.results.experiment import load_experiment, sweep_objective
from raymcn.results.table import answer_line, compact, format_table, group_table, report

ROOT = Path(__file__).resolve().parents[1]
ORDER, LR, SEED = "schedule.stage_order", "optim.lr", "run.seed"
MEDR, R10 = "text_to_video_MedR", "text_to_video_R@10"
BEST_MEDR = objective(f"best_{MEDR}")
# (order, lr) -> (R@10 per epoch, MedR per epoch): R@10 favours joint, the median rank AV_T
SEARCH = {("AV_T", 1e-3): ([20.0, 30.0], [10.0, 14.0]), ("AV_T", 3e-3): ([25.0, 35.0], [16.0, 12.0]),
          ("joint", 1e-3): ([40.0, 50.0], [30.0, 22.0]), ("joint", 3e-3): ([45.0, 55.0], [28.0, 26.0])}


def write_sweep(exp: Path, metric_setting: str | None, epochs: int = 2) -> None:
    """``raymcn_sweep.yaml`` as a sweep writes it (``Config.dump_text``); ``None``: without
    ``sweep.metric``, as a sweep saved before the setting existed."""
    raw = Config().replace({"schedule.epochs": epochs}).to_dict()
    if metric_setting is None:
        del raw["sweep"]["metric"]
    else:
        raw["sweep"]["metric"] = metric_setting
    exp.mkdir(parents=True, exist_ok=True)
    (exp / "raymcn_sweep.yaml").write_text(yaml.safe_dump(raw))


def write_trial(exp: Path, name: str, params: dict, curves: dict[str, list[float]]) -> None:
    """A trial folder whose result.json reports ``curves`` (metric -> value per epoch)."""
    d = exp / name
    d.mkdir(parents=True)
    (d / "params.json").write_text(json.dumps(params))
    epochs = len(next(iter(curves.values())))
    rows = [{"epoch": e, **{k: v[e - 1] for k, v in curves.items()}, "total_loss": 1.0 / e, "trial_id": name,
             "time_total_s": 10.0 * e, "training_iteration": e} for e in range(1, epochs + 1)]
    (d / "result.json").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture()
def by_medr(tmp_path) -> Path:
    """A search of 2 orders x 2 learning rates by ``best_text_to_video_MedR``."""
    exp = tmp_path / "sweep-medr"
    write_sweep(exp, BEST_MEDR.name)
    for (order, lr), (r10s, medrs) in SEARCH.items():
        write_trial(exp, f"{order}-{lr:g}", {ORDER: order, LR: lr}, {R10: r10s, MEDR: medrs})
    return exp


# --- the setting ----------------------------------------------------------------------------------------
def test_the_setting_takes_every_listed_metric_by_its_best_or_last_epoch_and_refuses_others():
    assert Config().sweep.metric == DEFAULT_OBJECTIVE == "best_text_to_video_R@10"
    assert objective_choices() == tuple(n for m in metric_names() for n in (f"best_{m}", m))
    for name in objective_choices():
        target = objective(load_config(overrides=[f"sweep.metric={name}"]).sweep.metric)
        assert target.name == name and target.mode == target.metric.direction
        assert target.column == ("best_" if name.startswith("best_") else "final_") + target.reported
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["sweep.metric=MedR"])
    assert e.value.problems == [f"sweep.metric='MedR': allowed values are {', '.join(objective_choices())}"]


def test_the_settings_reference_lists_every_choice():
    from raymcn.reference import reference

    (row,) = [line for line in reference().splitlines() if line.startswith("| `sweep.metric` |")]
    assert row.startswith("| `sweep.metric` | `best_text_to_video_R@10` | ")
    assert all(f"`{name}`" in row for name in objective_choices())


def test_a_sweep_saved_before_the_setting_existed_resumes_and_tables_as_before(tmp_path):
    """Its raymcn_sweep.yaml has no sweep.metric: it loads (what --resume does) with the default,
    and its table is ordered and answered by each trial's best R@10, as it was."""
    exp = tmp_path / "old-sweep"
    write_sweep(exp, None)
    assert "metric" not in yaml.safe_load((exp / "raymcn_sweep.yaml").read_text())["sweep"]
    assert load_config_text((exp / "raymcn_sweep.yaml").read_text()).sweep.metric == DEFAULT_OBJECTIVE
    for (order, lr), (r10s, medrs) in SEARCH.items():
        write_trial(exp, f"{order}-{lr:g}", {ORDER: order, LR: lr}, {R10: r10s, MEDR: medrs})
    assert sweep_objective(exp) == objective("best_text_to_video_R@10")
    trials, _ = load_experiment(exp)
    assert trials["best_text_to_video_R@10"].tolist() == [55.0, 50.0, 35.0, 30.0]  # highest first
    assert report(trials, ORDER, sweep_objective(exp)).count("best_text_to_video_R@10 by schedule.stage_order:") == 1


def test_a_sweep_file_naming_an_unlisted_metric_is_refused_naming_the_file(tmp_path, capsys):
    from raymcn.results.table import main_table

    exp = tmp_path / "odd"
    write_sweep(exp, BEST_MEDR.name)
    write_trial(exp, "t0", {ORDER: "joint"}, {R10: [1.0]})
    raw = yaml.safe_load((exp / "raymcn_sweep.yaml").read_text())
    raw["sweep"]["metric"] = "best_text_to_video_R@7"
    (exp / "raymcn_sweep.yaml").write_text(yaml.safe_dump(raw))
    assert main_table([str(exp), "--no-plots"]) == 2
    assert capsys.readouterr().err.strip() == (f"raymcn table: {exp / 'raymcn_sweep.yaml'}: sweep.metric="
                                               f"'best_text_to_video_R@7': allowed values are "
                                               f"{', '.join(objective_choices())}")


# --- a sweep by the median rank: the lowest is the best everywhere it is shown ---------------------------------
def test_trials_are_judged_by_their_lowest_median_rank_and_ordered_lowest_first(by_medr):
    trials, _ = load_experiment(by_medr)
    assert sweep_objective(by_medr) == BEST_MEDR
    t = trials.set_index("trial")
    for (order, lr), (_, medrs) in SEARCH.items():
        assert t.loc[f"{order}-{lr:g}", f"best_{MEDR}"] == min(medrs)
        assert t.loc[f"{order}-{lr:g}", f"final_{MEDR}"] == medrs[-1]
    assert trials["trial"].tolist() == ["AV_T-0.001", "AV_T-0.003", "joint-0.001", "joint-0.003"]  # 10, 12, 22, 26
    # by the last epoch's median rank instead (sweep.metric without best_): 12, 14, 22, 26
    write_sweep(by_medr, MEDR)
    assert load_experiment(by_medr)[0]["trial"].tolist() == ["AV_T-0.003", "AV_T-0.001", "joint-0.001",
                                                             "joint-0.003"]


def test_groups_statistics_and_cells_follow_the_median_rank(by_medr):
    trials, _ = load_experiment(by_medr)
    g = group_table(trials, ORDER, BEST_MEDR.column)
    assert g[ORDER].tolist() == ["AV_T", "joint"] and g[f"best_{MEDR}_mean"].tolist() == [11.0, 24.0]
    assert g.loc[1, "vs_best"] == pytest.approx(13.0)
    text = report(trials, ORDER, BEST_MEDR)
    assert f"best_{MEDR} by schedule.stage_order:" in text and "| Δ vs AV_T |" in text
    assert "| AV_T | 2 | 0 | 2 | 11.0 |" in text  # the table's one decimal for a rank
    md = format_table(g, "md", BEST_MEDR.column)
    assert "| 11.0 ± 1.4 |" in md.replace("  ", " ")
    with pytest.raises(ValueError, match="name the metric"):
        format_table(g, "md")
    brief = compact(trials, BEST_MEDR)
    assert [c for c in brief.columns if "text_to_video" in c] == [f"final_{MEDR}", f"best_{MEDR}"]
    assert [c for c in compact(trials, objective(DEFAULT_OBJECTIVE)).columns if "text_to_video" in c] == [
        "final_text_to_video_R@10", "best_text_to_video_R@10", f"best_{MEDR}"]  # the default view, as before


def confirm(exp: Path, values: dict[str, list[float]]) -> None:
    """The confirmation of ``exp``'s search: its candidates (by the sweep's metric) over seeds 2
    and 3, the median rank of each run given by ``values`` (per order, per seed)."""
    settings = ConfirmSettings(ORDER, 1, 2)
    picked = select_candidates(load_experiment(exp)[0], settings, 2, sweep_objective(exp))
    where = exp / "confirm"
    write_sweep(where, sweep_objective(exp).name)
    (where / "confirm_plan.yaml").write_text(plan_text(settings, picked, [2, 3]))
    for i, cfg in enumerate(trial_configs(picked, [2, 3])):
        medr = values[cfg[ORDER]][cfg[SEED] - 2]
        write_trial(where, f"{cfg[ORDER]}-c{i}", cfg, {R10: [50.0, 60.0], MEDR: [medr + 5, medr]})


def test_the_confirmation_selects_and_answers_by_the_lowest(by_medr):
    from raymcn.results.summary import sweep_summary

    picked = {c.group: c for c in select_candidates(load_experiment(by_medr)[0], ConfirmSettings(ORDER, 1, 2), 2,
                                                    BEST_MEDR)}
    assert picked["AV_T"].config[LR] == 1e-3 and picked["AV_T"].score == 10.0  # by R@10 it would be 3e-3
    assert picked["joint"].config[LR] == 1e-3 and picked["joint"].score == 22.0
    confirm(by_medr, {"AV_T": [9.0, 11.0], "joint": [20.0, 23.0]})
    text = sweep_summary(by_medr, plots=False)
    assert f"best_{MEDR} by schedule.stage_order, confirmation over seeds 2 and 3: 4 of 4 runs done" in text
    answer = " ".join(text[text.index("Answer: "):].split())
    assert answer.startswith(f"Answer: AV_T learns the best joint space by best_{MEDR}: 10.0, 95% CI [")
    assert "AV_T ahead by 11.5" in answer
    grouped = group_table(load_experiment(by_medr / "confirm")[0], ORDER, BEST_MEDR.column, pair_on=[SEED])
    assert answer_line(grouped, ORDER, 4, 4, BEST_MEDR.column).startswith("Answer: AV_T ")


def test_the_live_view_and_the_plots_follow_the_median_rank(by_medr):
    from raymcn.results.plots import best_by_order_figure, learning_curves_figure, write_plots
    from raymcn.results.watch import refresh

    text, _ = refresh(by_medr, None, False, None, "12:00")
    header = next(line for line in text.splitlines() if line.startswith("| trial |"))
    assert [c.strip() for c in header.split("|") if "text_to_video" in c] == [f"final_{MEDR}", f"best_{MEDR}"]
    first = next(line for line in text.splitlines() if line.startswith("| AV_T-0.001 |"))
    assert "| 14.0 | 10.0 |" in first  # lowest first, in the table's format
    trials, curves = load_experiment(by_medr)
    fig = best_by_order_figure(trials, BEST_MEDR)
    ax = fig.axes[0]
    assert [t.get_text().split("\n")[0] for t in ax.get_xticklabels()] == ["AV_T", "joint"]
    assert ax.get_xticklabels()[0].get_text().endswith("best mean")
    assert ax.get_ylabel() == f"best_{MEDR} (lower is better)" and ax.get_title() == f"best {MEDR} per stage order"
    assert learning_curves_figure(trials, curves, BEST_MEDR)._supylabel.get_text() == f"{MEDR} (lower is better)"
    assert len(write_plots(by_medr, trials, curves, BEST_MEDR)) == 3


# --- Tune is given the metric and its direction ------------------------------------------------------------
class FakeTuner:
    """Tune's Tuner as the sweep builds it, recording its TuneConfig; ``fit`` returns ``grid``."""

    made: list = []
    grid: list = []

    def __init__(self, trainable, tune_config=None, run_config=None, param_space=None):
        FakeTuner.made.append(tune_config)

    def fit(self):
        return FakeTuner.grid


def fake_grid(histories: dict[str, list[float]], name: str) -> list:
    """A ResultGrid of finished trials, each with its history of ``name``."""
    results = [SimpleNamespace(error=None, metrics={name: h[-1], "trial_id": tid}, config={ORDER: tid},
                               metrics_dataframe=pd.DataFrame({name: h})) for tid, h in histories.items()]
    grid = type("Grid", (list,), {})(results)
    grid.errors = []
    grid._experiment_analysis = SimpleNamespace(trials=[SimpleNamespace(trial_id=t, status="TERMINATED")
                                                        for t in histories])
    return grid


@pytest.mark.parametrize("setting, best", [(f"best_{MEDR}", "A"), (MEDR, "B"), ("best_text_to_video_R@10", "B")])
def test_tune_gets_the_metric_and_its_mode_and_the_best_trial_is_by_them(tmp_path, monkeypatch, setting, best):
    """A's median rank reached 10 and ended at 25, B's ended at 15 (R@10: A 20 at best, B 30):
    Tune's metric and mode are the table's, and the sweep's best trial is by the best epoch or
    the last one, as the setting says."""
    pytest.importorskip("ray")
    from raymcn.sweep import tuner

    cfg = load_config(ROOT / "sweeps/smoke.yaml", [f"sweep.metric={setting}"])
    target = objective(setting)
    history = {MEDR: {"A": [30.0, 10.0, 25.0], "B": [20.0, 18.0, 15.0]}, R10: {"A": [5.0, 20.0, 10.0],
                                                                              "B": [10.0, 20.0, 30.0]}}
    monkeypatch.setattr(tuner, "_trainable", lambda *args: "trainable")
    monkeypatch.setattr(tuner.tune, "Tuner", FakeTuner)
    FakeTuner.made, FakeTuner.grid = [], fake_grid(history[target.reported], target.reported)
    result = tuner.run_sweep(cfg, str(tmp_path / "exp"), inputs=SimpleNamespace())
    tuner.run_confirmation(cfg, str(tmp_path / "exp"), [{ORDER: "joint", SEED: 2}], "plan", inputs=SimpleNamespace())
    assert [(c.metric, c.mode) for c in FakeTuner.made] == [(target.reported, target.mode)] * 2
    assert result.best_config == {ORDER: best}


# --- one more metric: a row of the table, nothing else ----------------------------------------------------------
def _upper_quartile_rank(ranks, total: int) -> float:
    return float(np.percentile(ranks, 75)) + 1.0


EXTRA = (Metric("R@100", "recall at 100", "max", ".2f", True, lambda ranks, total: 100.0 * float((ranks < 100).sum())
                / total),
         Metric("Q3R", "the upper-quartile rank", "min", ".3f", False, _upper_quartile_rank))


@pytest.fixture()
def extended(monkeypatch):
    """The table with R@100 and an upper-quartile rank (lower is better) added as a contributor
    adds them: rows of METRICS, no other module touched."""
    monkeypatch.setattr(table_module, "METRICS", table_module.METRICS + EXTRA)
    return table_module.metric_table()


def test_a_metric_added_to_the_table_is_evaluated(extended):
    import torch
    from test_eval_sharded import _eval_set, _model

    from raymcn.train.evaluate import embed_eval_set, evaluate, ranks_of_matches

    got = evaluate(_model(), _eval_set(), torch.device("cpu"))
    assert list(got) == [*metric_names(), "eval_size"] and metric_names()[-2:] == ("text_to_video_R@100",
                                                                                   "text_to_video_Q3R")
    embedded = embed_eval_set(_model(), _eval_set(), torch.device("cpu"))
    ranks = ranks_of_matches(embedded[:, 0], embedded[:, 1]).numpy()
    assert got["text_to_video_R@100"] == pytest.approx(100.0 * len(ranks) / got["eval_size"])  # the absent: misses
    assert got["text_to_video_Q3R"] == pytest.approx(np.percentile(ranks, 75) + 1)
    from raymcn.data.evalsets import _msrvtt_total

    _, note = _msrvtt_total(968, None)  # the MSR-VTT note states each metric's rule from the table
    assert "R@1/R@5/R@10/R@50/R@100 divide by 1000" in note and "MedR/MeanR/Q3R are over the 968 present" in note


def test_a_metric_added_to_the_table_is_a_sweep_metric_shown_formatted_and_ordered(extended, tmp_path):
    from raymcn.train.monitor.console import epoch_line

    q3r = "text_to_video_Q3R"
    assert load_config(overrides=[f"sweep.metric=best_{q3r}"]).sweep.metric == f"best_{q3r}"
    assert objective(f"best_{q3r}").mode == "min" and objective("best_text_to_video_R@100").mode == "max"
    assert epoch_line(1, 2, {q3r: 12.25}, metric(q3r)) == "epoch 1/2  Q3R 12.250"
    exp = tmp_path / "sweep-q3r"
    write_sweep(exp, f"best_{q3r}")
    for i, (order, q3rs) in enumerate([("AV_T", [9.5, 7.25]), ("AV_T", [8.0, 8.5]), ("joint", [4.0, 6.0]),
                                       ("joint", [5.0, 3.75])]):
        write_trial(exp, f"t{i}", {ORDER: order, LR: [1e-3, 3e-3][i % 2]},
                    {"text_to_video_R@100": [50.0, 60.0 + i], q3r: q3rs})
    trials, _ = load_experiment(exp)
    assert {f"final_{q3r}", f"best_{q3r}", "final_text_to_video_R@100", "best_text_to_video_R@100"} <= set(trials)
    assert trials[f"best_{q3r}"].tolist() == [3.75, 4.0, 7.25, 8.0]  # each trial's lowest, lowest first
    assert trials["best_text_to_video_R@100"].tolist() == [63.0, 62.0, 60.0, 61.0]
    target = sweep_objective(exp)
    # the live view: the sweep's metric in its table format (3 decimals), beside the median rank (none reported)
    assert format_table(compact(trials, target), "md").splitlines()[2] == \
        "| t3 | done | 2 | joint | 0.003 | 3.750 | 3.750 | - | 0.5 |"
    g = group_table(trials, ORDER, target.column, pair_on=[LR])
    assert g[ORDER].tolist() == ["joint", "AV_T"] and g[f"best_{q3r}_mean"].tolist() == [3.875, 7.625]
    assert "| joint | 2 | 0 | 2 | 3.875 | [" in report(trials, ORDER, target)


# --- nothing but the table knows a metric ------------------------------------------------------------------------
METRIC_NAME = re.compile(r"R@\d|MedR|MeanR")
TABLE_CALLS = {"metric_table", "metric_names", "objective_choices"}  # the table's tuples, read by a call


def _position(node: ast.expr) -> bool:
    """A constant integer index (``0``, ``-1``)."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool)


def strings_and_lookups(path: Path) -> tuple[list[str], list[str]]:
    """(every string literal of ``path`` that is not a docstring, every lookup of a metric by its
    position in the table: one of its tuples, or a name ending in METRICS, at a constant index)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
               and id(n) not in docstrings]
    lookups = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Subscript) and _position(n.slice):
            called = isinstance(n.value, ast.Call)
            inner = n.value.func if called else n.value
            name = getattr(inner, "id", None) or getattr(inner, "attr", None) or ""
            if (called and name in TABLE_CALLS) or (not called and name.endswith("METRICS")):
                lookups.append(ast.unparse(n))
    return strings, lookups


def test_the_checker_finds_a_spelled_metric_and_a_positional_lookup(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""Mentions MedR in a docstring: allowed."""\nfrom raymcn.config import metric_names\n'
                   'def mode(c):\n    return "min" if c.endswith("MedR") else "max"\nlast = metric_names()[-1]\n'
                   'first = RETRIEVAL_METRICS[0]\nfine = metrics["epoch"], rows[-1]\n')
    strings, lookups = strings_and_lookups(bad)
    assert [s for s in strings if METRIC_NAME.search(s)] == ["MedR"]
    assert sorted(lookups) == ["RETRIEVAL_METRICS[0]", "metric_names()[-1]"]


def test_no_module_but_the_table_spells_a_metric_or_looks_one_up_by_position():
    """A direction decided by a name's spelling (``endswith("MedR")``) or a metric found by its
    position (``RETRIEVAL_METRICS[-1]``) breaks silently when the table grows."""
    table = ROOT / "raymcn" / "config" / "metrics.py"
    found = {}
    for path in sorted((ROOT / "raymcn").rglob("*.py")):
        if path == table:
            continue
        strings, lookups = strings_and_lookups(path)
        spelled = [s for s in strings if METRIC_NAME.search(s)]
        if spelled or lookups:
            found[str(path.relative_to(ROOT))] = spelled + lookups
    assert found == {}
