"""Results layer on a hand-built Tune experiment directory (no Ray): table values, statuses,
sort order, Markdown/CSV output, grouped mean ± std, plots and the ``raymcn table`` entry point.
The statistics are tested in test_results_stats.py, the live view in test_watch.py."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import yaml
from tune_dirs import metrics_for

from raymcn.config import DEFAULT_OBJECTIVE, metric_names, objective
from raymcn.results import ExperimentError, format_table, group_table, load_experiment, main_table
from raymcn.results.plots import write_plots

EPOCHS = 4
R10 = "text_to_video_R@10"
TARGET = objective(DEFAULT_OBJECTIVE)  # each trial's best R@10: what these sweep files (no sweep.metric) optimize
# trial id -> (stage order, lr, R@10 per reported epoch, errored)
TRIALS = {
    "a0001_00000": ("AV_T", 1e-4, [10.0, 20.0, 30.0, 25.0], False),  # done, best != final
    "a0001_00001": ("joint", 3e-4, [15.0, 25.0, 35.0, 40.0], False),  # done, the best trial
    "a0001_00002": ("VT_A", 1e-3, [5.0, 8.0], False),  # stopped early (+ a half-written line)
    "a0001_00003": ("AV_T", 3e-5, [12.0, 18.0, 14.0], True),  # errored after 3 epochs
    "a0001_00004": ("joint", 1e-5, [20.0, 22.0, 24.0, 26.0], False),  # loss keys missing in some rows
    "a0001_00005": ("VT_A", 2e-4, [], True),  # errored before its first report
}
NO_ROWS_DIR = "trial_fn_a0001_00005_5_lr=0.0002"  # its id can only come from the dir name


def make_row(tid: str, epoch: int, r10: float) -> dict:
    row = {"epoch": epoch, **metrics_for(r10), "total_loss": 5.0 / epoch, "contrastive_loss": 3.0 / epoch,
           "cluster_loss": 1.5 / epoch, "recon_loss": 0.5 / epoch,
           "time_data_s": 0.01 * epoch, "time_forward_s": 0.02 * epoch, "time_loss_s": 0.003,
           "time_backward_s": 0.04, "time_optimizer_s": 0.005, "samples_per_s": 100.0 * epoch,
           "trial_id": tid, "time_total_s": 60.0 * epoch, "time_this_iter_s": 60.0,
           "training_iteration": epoch, "done": False, "timestamp": 1_700_000_000 + epoch,
           "config": {"optim.lr": 1.0}}  # Tune nests the config in each row; the table must ignore it
    if tid == "a0001_00004":
        if epoch <= 2:
            del row["cluster_loss"]  # e.g. a term that starts later
        if epoch == EPOCHS:
            del row["recon_loss"]  # absent from the final row -> final value NaN
    return row


@pytest.fixture()
def exp_dir(tmp_path):
    exp = tmp_path / "sweep-test"
    exp.mkdir()
    (exp / "raymcn_sweep.yaml").write_text(yaml.safe_dump(
        {"schedule": {"epochs": EPOCHS, "stage_order": "joint"}, "sweep": {"space": {}}}))
    (exp / "train").mkdir()  # the sweep's Train storage: not a trial
    for i, (tid, (order, lr, r10s, errored)) in enumerate(TRIALS.items()):
        d = exp / (NO_ROWS_DIR if not r10s else f"trial_fn_{tid}_{i}_lr={lr}")
        d.mkdir()
        (d / "params.json").write_text(json.dumps({"optim.lr": lr, "schedule.stage_order": order,
                                                   "data.batch_size": 8}))
        if r10s:
            lines = [json.dumps(make_row(tid, e, r)) for e, r in enumerate(r10s, start=1)]
            if tid == "a0001_00002":
                lines.append('{"epoch": 3, "text_to_vid')  # a running trial's half-written line
            (d / "result.json").write_text("\n".join(lines) + "\n")
        if errored:
            (d / "error.txt").write_text("RuntimeError: boom")
    return exp


def by_trial(df: pd.DataFrame) -> pd.DataFrame:
    return df.set_index("trial")


def test_one_row_per_trial_and_curves(exp_dir):
    trials, curves = load_experiment(exp_dir)
    assert len(trials) == len(TRIALS)
    assert set(trials["trial"]) == set(list(TRIALS)[:-1]) | {NO_ROWS_DIR}
    assert {"optim.lr", "schedule.stage_order", "data.batch_size"} <= set(trials.columns)
    assert "config" not in curves and "config" not in trials
    # curves: one row per reported epoch (the half-written line is skipped)
    assert len(curves) == sum(len(v[2]) for v in TRIALS.values())
    assert not curves.duplicated(["trial", "epoch"]).any()
    assert curves[curves.trial == "a0001_00001"][R10].tolist() == [15.0, 25.0, 35.0, 40.0]


def test_final_and_best_values(exp_dir):
    t = by_trial(load_experiment(exp_dir)[0])
    for tid, (_, _, r10s, _) in TRIALS.items():
        if not r10s:
            continue
        final, best_r10 = metrics_for(r10s[-1]), max(r10s)
        for m in metric_names():
            assert t.loc[tid, f"final_{m}"] == pytest.approx(final[m])
        assert t.loc[tid, f"best_{R10}"] == pytest.approx(best_r10)
        best = metrics_for(best_r10)  # every metric is best at the best R@10's epoch (tune_dirs.metrics_for)
        for m in metric_names():  # by each one's direction: the lowest MedR, the highest R@1
            assert t.loc[tid, f"best_{m}"] == pytest.approx(best[m])
        n = len(r10s)
        assert t.loc[tid, "epochs"] == n
        assert t.loc[tid, "total_loss"] == pytest.approx(5.0 / n)
        assert t.loc[tid, "time_data_s"] == pytest.approx(0.01 * n)  # last row's step mean
        assert t.loc[tid, "samples_per_s"] == pytest.approx(100.0 * n)
        assert t.loc[tid, "wall_s"] == pytest.approx(60.0 * n)
    # a trial that reported nothing has a row of NaN metrics
    assert t.loc[NO_ROWS_DIR, "epochs"] == 0 and math.isnan(t.loc[NO_ROWS_DIR, f"best_{R10}"])
    # loss keys missing in some rows: final = the last epoch's row, NaN if absent there
    assert t.loc["a0001_00004", "cluster_loss"] == pytest.approx(1.5 / EPOCHS)
    assert math.isnan(t.loc["a0001_00004", "recon_loss"])
    assert "time_total_s" not in t.columns and "time_this_iter_s" not in t.columns  # Tune's clocks


def test_sort_order_and_status(exp_dir):
    trials = load_experiment(exp_dir)[0]
    assert trials["trial"].tolist() == ["a0001_00001", "a0001_00000", "a0001_00004", "a0001_00003",
                                        "a0001_00002", NO_ROWS_DIR]  # best R@10 40, 30, 26, 18, 8, NaN
    status = dict(zip(trials["trial"], trials["status"]))
    assert status == {"a0001_00001": "done", "a0001_00000": "done", "a0001_00004": "done",
                      "a0001_00003": "error", "a0001_00002": "stopped", NO_ROWS_DIR: "error"}
    running = by_trial(load_experiment(exp_dir, running_trial_ids={"a0001_00002"})[0])
    assert running.loc["a0001_00002", "status"] == "running"


def test_epochs_missing_from_tunes_file_come_from_the_runs_metrics_csv(exp_dir):
    """After the driver's reboot Tune's result.json of a resumed trial starts where it resumed (and
    misses what Tune had not yet copied into the sweep's folder); the trial's Train run wrote every
    epoch into its metrics.csv, which fills the gaps. Tune's rows win where both have an epoch."""
    import csv

    tid = "a0001_00001"
    trial = next(exp_dir.glob(f"trial_fn_{tid}_*"))
    whole = load_experiment(exp_dir)[1]
    table = exp_dir / "train" / f"train-{tid}" / "metrics.csv"
    table.parent.mkdir(parents=True)
    rows = [{k: v for k, v in make_row(tid, e, r).items() if isinstance(v, float) or k == "epoch"}
            for e, r in enumerate(TRIALS[tid][2], start=1)]
    with table.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({**r, "total_loss": 99.0} for r in rows)  # told apart from Tune's rows below
    (trial / "result.json").write_text(json.dumps(make_row(tid, 3, TRIALS[tid][2][2])) + "\n")  # resumed at 3
    trials, curves = load_experiment(exp_dir)
    mine = curves[curves["trial"] == tid]
    assert mine["epoch"].tolist() == [1, 2, 3, 4]
    assert mine[R10].tolist() == whole[whole["trial"] == tid][R10].tolist()
    assert mine["total_loss"].tolist() == [99.0, 99.0, 5.0 / 3, 99.0]
    assert by_trial(trials).loc[tid, "status"] == "done"


def test_a_trial_stopped_while_paused_is_stopped_not_running(exp_dir):
    """Tune's last saved state still calls a trial HyperBand stopped while it was paused PAUSED;
    raymcn's record of how that Tune run ended corrects it, until a later Tune run saves a newer
    state (a resumed sweep, whose trials are running again)."""
    state = {"trial_data": [[json.dumps({"trial_id": "a0001_00002", "status": "PAUSED"}), "{}"]]}
    (exp_dir / "experiment_state-2024-01-01_00-00-00.json").write_text(json.dumps(state))
    assert by_trial(load_experiment(exp_dir)[0]).loc["a0001_00002", "status"] == "running"
    (exp_dir / "raymcn_trial_status.jsonl").write_text(json.dumps(
        {"trial": "a0001_00002", "status": "TERMINATED", "tune_state": "experiment_state-2024-01-01_00-00-00.json"}))
    assert by_trial(load_experiment(exp_dir)[0]).loc["a0001_00002", "status"] == "stopped"
    (exp_dir / "experiment_state-2024-01-02_00-00-00.json").write_text(json.dumps(state))  # resumed since
    assert by_trial(load_experiment(exp_dir)[0]).loc["a0001_00002", "status"] == "running"


def test_markdown_and_csv(exp_dir):
    trials = load_experiment(exp_dir)[0]
    md = format_table(trials, "md")
    lines = md.strip().splitlines()
    assert len(lines) == 2 + len(TRIALS)
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    assert header[:3] == ["trial", "status", "epochs"]
    assert f"best_{R10}" in header and "final_text_to_video_MedR" in header and "total_loss" in header
    best_row = [c.strip() for c in lines[2].strip("|").split("|")]  # first data row = best trial
    assert best_row[0] == "a0001_00001"
    assert best_row[header.index(f"best_{R10}")] == "40.00"
    assert best_row[header.index("total_loss")] == "1.25"  # 5/4 at 4 significant digits
    assert best_row[header.index("optim.lr")] == "0.0003"
    assert "| - |" in md  # missing values
    csv = format_table(trials, "csv")
    back = pd.read_csv(io.StringIO(csv))
    assert list(back.columns) == list(trials.columns)
    assert back[f"best_{R10}"].tolist()[:5] == [40.0, 30.0, 26.0, 18.0, 8.0]
    with pytest.raises(ValueError, match="html"):
        format_table(trials, "html")


def test_group_mean_std_match_numpy(exp_dir):
    trials = load_experiment(exp_dir)[0]
    g = group_table(trials, "schedule.stage_order", f"best_{R10}").set_index("schedule.stage_order")
    assert list(g.index) == ["joint", "AV_T", "VT_A"]  # by mean best R@10 of full-budget trials: 33, 30, none
    for order in ("AV_T", "joint", "VT_A"):
        members = [v for v in TRIALS.values() if v[0] == order]
        assert g.loc[order, "n"] == len(members)  # every trial, any status
        # errored and stopped-early trials are listed per trial but left out of the group's values
        best = np.array([max(r) for _, _, r, errored in members if len(r) == EPOCHS and not errored])
        assert g.loc[order, "n_finished"] == best.size
        if best.size == 0:
            assert math.isnan(g.loc[order, f"best_{R10}_mean"])
            continue
        assert g.loc[order, f"best_{R10}_mean"] == pytest.approx(np.mean(best))
        if best.size > 1:  # sample std, ddof=1 (pandas' default)
            assert g.loc[order, f"best_{R10}_std"] == pytest.approx(np.std(best, ddof=1))
        else:
            assert math.isnan(g.loc[order, f"best_{R10}_std"])
    assert "1 errored trial not counted" in g.loc["AV_T", "note"]
    assert g.loc["VT_A", "n_stopped"] == 1 and "1 stopped-early trial" in g.loc["VT_A", "note"]
    md = format_table(g.reset_index(), "md", f"best_{R10}")
    joint = np.array([40.0, 26.0])
    assert f"{joint.mean():.2f} ± {joint.std(ddof=1):.2f}" in md  # "33.00 ± 9.90"
    assert f"best_{R10} |" in md and f"best_{R10}_std" not in md.splitlines()[0]
    csv = pd.read_csv(io.StringIO(format_table(g.reset_index(), "csv")))
    assert {f"best_{R10}_mean", f"best_{R10}_std", "n", "ci95_low", "ci95_high", "p", "p_holm"} <= set(csv.columns)
    with pytest.raises(KeyError, match="loss.margin"):
        group_table(trials, "loss.margin", f"best_{R10}")


def _is_png(path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_plots(exp_dir):
    trials, curves = load_experiment(exp_dir)
    paths = write_plots(exp_dir, trials, curves, TARGET)
    assert sorted(p.name for p in paths) == ["best_by_stage_order.png", "learning_curves.png", "metric_vs_lr.png"]
    assert all(p.parent == exp_dir and _is_png(p) for p in paths)
    assert not list(exp_dir.glob(".*.tmp"))  # written via a temporary file, renamed over the target
    skipped = []
    paths = write_plots(exp_dir, trials.drop(columns=["optim.lr"]), curves, TARGET, on_skip=skipped.append)
    assert len(paths) == 2 and skipped == ["metric_vs_lr.png: optim.lr was not swept"]


def test_switch_epoch_from_params_base_config_and_default(exp_dir):
    t = by_trial(load_experiment(exp_dir)[0])
    # the sweep YAML has epochs 4 and no stage1_fraction: the config default 0.5 applies
    assert t.loc["a0001_00000", "switch_epoch"] == pytest.approx(2.0)  # AV_T
    assert math.isnan(t.loc["a0001_00001", "switch_epoch"])  # joint: one stage
    (exp_dir / "raymcn_sweep.yaml").write_text(yaml.safe_dump({"schedule": {"epochs": 10, "stage1_fraction": 0.3}}))
    assert by_trial(load_experiment(exp_dir)[0]).loc["a0001_00000", "switch_epoch"] == pytest.approx(3.0)


def test_learning_curves_mark_the_stage_switch(exp_dir):
    from raymcn.results.plots import learning_curves_figure

    trials, curves = load_experiment(exp_dir)
    fig = learning_curves_figure(trials, curves, TARGET)
    panels = {ax.get_title(loc="left").split(":")[0]: ax for ax in fig.axes if ax.get_visible()}
    assert sorted(panels) == ["AV_T", "VT_A", "joint"]

    def vertical_lines(ax):
        return [line.get_xdata()[0] for line in ax.get_lines()
                if len(set(line.get_xdata())) == 1 and line.get_linestyle() == "--"]

    assert vertical_lines(panels["AV_T"]) == [pytest.approx(2.0)]  # 0.5 × 4 epochs
    assert vertical_lines(panels["joint"]) == []
    texts = [t.get_text() for t in panels["AV_T"].texts]
    assert texts == ["+ text (epoch 2)"] and [t.get_text() for t in panels["VT_A"].texts] == ["+ audio (epoch 2)"]
    assert panels["AV_T"].get_title(loc="left") == "AV_T: 2 trials"  # one reported, one errored after 3 epochs


def test_best_by_order_error_bars_are_the_95_ci(tmp_path):
    from raymcn.results.plots import best_by_order_figure
    from raymcn.results.stats import t_interval

    values = {"joint": [30.0, 34.0, 31.0], "AV_T": [20.0, 25.0, 22.0], "VT_A": [10.0]}
    rows = [{"trial": f"{o}{i}", "status": "done", "schedule.stage_order": o, "run.seed": i, f"best_{R10}": v}
            for o, vs in values.items() for i, v in enumerate(vs)]
    fig = best_by_order_figure(pd.DataFrame(rows), TARGET)
    ax = fig.axes[0]
    bars = [c for c in ax.containers if c.has_yerr]
    spans = sorted(tuple(seg[:, 1]) for bar in bars for seg in bar.lines[2][0].get_segments())
    expected = sorted([t_interval(values["AV_T"]), t_interval(values["joint"])])
    assert len(spans) == 2 and all(s == pytest.approx(e) for s, e in zip(spans, expected))
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks[0].startswith("AV_T\nn=3\np=") and ticks[1] == "VT_A\nn=1\nno test"
    assert ticks[2] == "joint\nn=3\nbest mean"
    assert "no CI (n=1)" in [t.get_text() for t in ax.texts]


def test_missing_or_empty_dir_names_path(tmp_path, capsys):
    missing = tmp_path / "no-such-sweep"
    with pytest.raises(ExperimentError, match=str(missing)):
        load_experiment(missing)
    empty = tmp_path / "empty-sweep"
    (empty / "train").mkdir(parents=True)
    with pytest.raises(ExperimentError, match=str(empty)):
        load_experiment(empty)
    assert main_table([str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err


def test_main_table(exp_dir, capsys):
    assert main_table([str(exp_dir)]) == 0
    out = capsys.readouterr().out
    assert f"best_{R10}" in out and "a0001_00001" in out and "40.00" in out
    assert "grouped by schedule.stage_order" in out and "33.00 ± 9.90" in out
    assert "best_text_to_video_R@10 by schedule.stage_order:" in out and "| Δ vs joint |" in out
    assert out.count("plot: ") == 3 and (exp_dir / "learning_curves.png").exists()
    assert main_table([str(exp_dir), "--format", "csv", "--no-plots"]) == 0
    captured = capsys.readouterr()
    back = pd.read_csv(io.StringIO(captured.out))  # stdout is exactly one CSV table
    assert len(back) == len(TRIALS) and f"best_{R10}" in back
    assert main_table([str(exp_dir), "--format", "csv", "--group-by", "schedule.stage_order", "--no-plots"]) == 0
    assert pd.read_csv(io.StringIO(capsys.readouterr().out))["n"].sum() == len(TRIALS)
    assert main_table([str(exp_dir), "--group-by", "nope.key", "--no-plots"]) == 2
    assert "nope.key" in capsys.readouterr().err


def test_results_imports_neither_ray_nor_torch():
    code = ("import sys, raymcn.results.table, raymcn.results.plots, raymcn.results.watch, raymcn.results.stats; "
            "sys.exit(1 if any(m.split('.')[0] in ('ray', 'torch') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
