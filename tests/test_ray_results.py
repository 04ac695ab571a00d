"""A sweep's folder read by Ray's, TensorBoard's and MLflow's own tools, by the names the results
table uses: Tune's ``ExperimentAnalysis`` and ``Tuner.restore`` find the best trial by
``sweep.metric`` (its ``best_`` form too: every epoch reports it) and, through the result's
``checkpoint_path``, the Train checkpoint of its last epoch, which ``raymcn eval`` scores as the
trial did; ``raymcn.sweep.result_grid`` gives Tune's ResultGrid with those checkpoints as
``Result.checkpoint`` and ``best_checkpoints``, for the search and for the confirmation;
TensorBoard's ``EventAccumulator`` and MLflow's client read every metric of the table from every
trial (a single run's: tests/test_train_ray.py, tests/test_trackers.py).

One rehearsed smoke sweep with a confirmation (2 + 4 trials) for all of them: the soak tier (by
hand before a release). The fast tier's part is the grid rehearsal killed and resumed
(tests/test_rehearsals.py, with :func:`reported_best_is_the_best_of_every_epoch` and
:func:`best_trial_and_checkpoint_by_rays_api`) and the Ray-free checks below.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from raymcn.config import BEST, load_config, metric_names, metric_table, objective, tracker_name
from raymcn.train.checkpoints import payload

REPO = Path(__file__).resolve().parents[1]
R10, MEDR = "text_to_video_R@10", "text_to_video_MedR"


# --- the checks, with Ray's API only (shared with the grid rehearsal) ---------------------------------------------
def epochs_of(run_dir: Path) -> dict[int, dict[str, float]]:
    """Epoch -> the metrics of the Train run's ``metrics.csv`` (every epoch it ran, as the run ended)."""
    import pandas as pd

    return {int(row["epoch"]): row for row in pd.read_csv(run_dir / "metrics.csv").to_dict("records")}


def reported_best_is_the_best_of_every_epoch(exp: Path) -> None:
    """Every trial's last Tune result holds, for each metric of the table, its best over all the
    epochs its Train run trained up to that result's (a trial restarted from a checkpoint, or
    paused and resumed, included; one stopped early may have trained on past its last result)."""
    from ray import tune

    analysis = tune.ExperimentAnalysis(str(exp))
    assert analysis.trials
    for trial in analysis.trials:
        last = int(trial.last_result["epoch"])
        epochs = {e: row for e, row in epochs_of(exp / "train" / f"train-{trial.trial_id}").items() if e <= last}
        assert sorted(epochs) == list(range(1, last + 1)), trial
        for m in metric_table():
            best = m.sign * max(m.sign * row[m.name] for row in epochs.values())
            assert trial.last_result[BEST + m.name] == pytest.approx(best), (trial, m.name)


def evaluated(checkpoint: str, threads: int, capsys) -> dict[str, float]:
    """``raymcn eval --checkpoint CHECKPOINT --device cpu --json`` with the trial's thread count."""
    from conftest import last_json

    from raymcn.cli import main

    capsys.readouterr()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert main(["eval", "--checkpoint", checkpoint, "--device", "cpu", "--json"]) == 0
    finally:
        torch.set_num_threads(previous)
    return last_json(capsys.readouterr().out)


def best_trial_and_checkpoint_by_rays_api(exp: Path, metric: str, capsys) -> str:
    """With Ray's API only: the best trial of the sweep in ``exp`` by ``metric`` (a ``sweep.metric``
    value) in its direction, the table's best by it, and its last epoch's Train checkpoint (the
    result's ``checkpoint_path``), which ``raymcn eval`` scores to that trial's metrics of that
    epoch. Returns the checkpoint's path."""
    from ray import tune

    from raymcn.results.experiment import load_experiment

    target = objective(metric)
    best = tune.ExperimentAnalysis(str(exp)).get_best_trial(metric=target.name, mode=target.mode)
    assert best is not None, metric
    trials, _ = load_experiment(exp)
    top = target.metric.sign * (target.metric.sign * trials[target.column]).max()
    assert trials.set_index("trial").loc[best.trial_id, target.column] == top  # (a tie: either is the best)
    path = best.last_result["checkpoint_path"]
    loop = json.loads((Path(path) / payload.META_FILE).read_text())
    assert loop["epoch"] == best.last_result["epoch"] and not loop["progress"]["steps"]  # an epoch's end
    assert Path(path).parent == exp / "train" / f"train-{best.trial_id}"
    threads = load_config(exp / "raymcn_sweep.yaml").scale.torch_threads
    scored = evaluated(path, threads, capsys)
    assert {k: scored[k] for k in metric_names()} == {k: best.last_result[k] for k in metric_names()}
    return path


# --- without Ray ---------------------------------------------------------------------------------------------------
def test_a_train_runs_epoch_checkpoints_are_its_epoch_ends_by_epoch(tmp_path):
    """``result_grid``'s reading of a Train run: its epoch-end checkpoints with their epochs' metrics,
    by epoch; a mid-epoch checkpoint and a folder without its metrics are not among them."""
    from raymcn.sweep.result_grid import epoch_checkpoints

    run = tmp_path / "train-abc"
    for name, metrics in (("checkpoint_2026-01-01_00-00-03.000001", {"epoch": 2.0, R10: 30.0}),
                          ("checkpoint_2026-01-01_00-00-01.000001", {"epoch": 1.0, R10: 40.0}),
                          ("checkpoint_2026-01-01_00-00-04.000001", {"mid_epoch": 1.0, "epoch": 2.0, R10: -1.0}),
                          ("checkpoint_2026-01-01_00-00-05.000001", None)):
        (run / name).mkdir(parents=True)
        if metrics is not None:
            (run / name / payload.METRICS_META_FILE).write_text(json.dumps(metrics))
    kept = epoch_checkpoints(str(run))
    assert [(Path(c.path).name, m["epoch"]) for c, m in kept] == [
        ("checkpoint_2026-01-01_00-00-01.000001", 1.0), ("checkpoint_2026-01-01_00-00-03.000001", 2.0)]
    assert epoch_checkpoints(str(tmp_path / "none")) == []


def test_the_pages_python_session_is_todays():
    """docs/measurements/ray_results.txt (what docs/sweeps.md shows) holds the statements of
    ``tools.ray_results.SESSION`` as they are today: a change to them needs a new capture."""
    from tools.ray_results import OUT, PROMPT, SESSION

    statements = [line[len(PROMPT):] for line in OUT.read_text().splitlines() if line.startswith(PROMPT)]
    assert statements[0].startswith("EXP = ") and statements[1:] == list(SESSION)


# --- one rehearsed sweep with a confirmation (Ray) -------------------------------------------------------------------
@pytest.fixture(scope="module")
def confirmed_sweep(tmp_path_factory) -> Path:
    """The smoke file rehearsed, each stage order's best confirmed over 2 seeds, every tracker but
    W&B on; as the lab runs a sweep (its own process and Ray)."""
    from test_rehearsals import rehearse, sweep_folder

    results = tmp_path_factory.mktemp("ray-results") / "results"
    status, out, _ = rehearse(["--config", str(REPO / "sweeps/smoke.yaml"), "--rehearse",
                               "--set", "sweep.confirm={per: schedule.stage_order, repeats: 2}",
                               "--set", "run.trackers=mlflow,tensorboard"], results)
    assert status == 0, out[-3000:]
    return sweep_folder(results)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.soak  # a sweep of its own, minutes past CI's time (CI's part: the grid rehearsal's, fast tier)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("metric", [f"{BEST}{R10}", f"{BEST}{MEDR}", R10])
def test_ray_finds_the_best_trial_by_the_sweeps_metric_and_its_checkpoint_which_eval_scores_as_the_trial_did(
        confirmed_sweep, metric, capsys):
    """``ray.tune.ExperimentAnalysis`` on the search and on the confirmation: the best trial by a
    ``best_`` metric (higher or lower is better) or a last epoch's, and its checkpoint; and with
    ``Tuner.restore`` (the trainable named ``trial_fn``) the same."""
    from ray import tune

    from raymcn.sweep.tuner import trial_fn

    for exp in (confirmed_sweep, confirmed_sweep / "confirm"):
        reported_best_is_the_best_of_every_epoch(exp)
        path = best_trial_and_checkpoint_by_rays_api(exp, metric, capsys)
        target = objective(metric)
        grid = tune.Tuner.restore(str(exp), trainable=trial_fn).get_results()
        best = grid.get_best_result(metric=target.name, mode=target.mode)
        assert best.metrics["checkpoint_path"] == path and best.checkpoint is None  # Tune holds its path only


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.soak  # a sweep of its own, minutes past CI's time (CI's part: the grid rehearsal's, fast tier)
@pytest.mark.timeout(900)
def test_result_grid_gives_tunes_results_holding_the_train_checkpoints(confirmed_sweep, capsys):
    """``result_grid(EXP)`` and ``result_grid(EXP/confirm)``: Tune's ResultGrid, its default metric the
    sweep's; each result's ``checkpoint`` is its last epoch's (eval scores it to ``Result.metrics``)
    and ``get_best_checkpoint`` its best epoch's (eval scores it to the best R@10 the result reports);
    ``run.init_from`` takes both."""
    from ray.tune import ResultGrid

    from raymcn.results.experiment import load_experiment
    from raymcn.sweep.result_grid import result_grid

    threads = load_config(confirmed_sweep / "raymcn_sweep.yaml").scale.torch_threads
    for exp, trials in ((confirmed_sweep, 2), (confirmed_sweep / "confirm", 4)):
        grid = result_grid(str(exp))
        assert isinstance(grid, ResultGrid) and len(grid) == trials and grid.num_errors == 0
        table, _ = load_experiment(exp)
        best = grid.get_best_result()  # by sweep.metric, each trial's best R@10
        assert best.metrics["trial_id"] == table["trial"].iloc[0]
        for result in grid:
            run_dir = exp / "train" / f"train-{result.metrics['trial_id']}"
            assert result.checkpoint.path == result.metrics["checkpoint_path"]
            assert Path(result.checkpoint.path).parent == run_dir
            kept = [m for _, m in result.best_checkpoints]
            assert kept and all("mid_epoch" not in m for m in kept) and kept[-1]["epoch"] == result.metrics["epoch"]
            assert set(m["epoch"] for m in kept) <= set(float(e) for e in epochs_of(run_dir))
        last = evaluated(best.checkpoint.path, threads, capsys)
        assert {k: last[k] for k in metric_names()} == {k: best.metrics[k] for k in metric_names()}
        top = best.get_best_checkpoint(R10, "max")
        scored = evaluated(top.path, threads, capsys)
        assert scored[R10] == best.metrics[BEST + R10]  # the trial's best epoch is kept (run.checkpoints_to_keep)
        # and a run starts from either (run.init_from, checked by the preflight before Ray starts)
        from raymcn.train.checkpoints import init_from

        sweep_cfg = load_config(exp / "raymcn_sweep.yaml")
        for checkpoint in (best.checkpoint, top):
            assert init_from.problems(sweep_cfg.replace({"run.init_from": checkpoint.path})) == []


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.soak  # a sweep of its own, minutes past CI's time (CI's part: the grid rehearsal's, fast tier)
@pytest.mark.timeout(900)
def test_tensorboard_and_mlflow_read_every_metric_of_the_table_from_every_trial(confirmed_sweep):
    """Each trial's event files in its folder (``tensorboard --logdir EXP``) and its MLflow run in
    the phase's store hold every metric of the table and its best so far, at each epoch, under
    ``tracker_name`` of the table's name, as a run's trackers write them."""
    from mlflow.tracking import MlflowClient
    from test_trackers import table_names, tensorboard_scalars

    from raymcn.sweep.trackers import mlflow_uri

    for exp in (confirmed_sweep, confirmed_sweep / "confirm"):
        client = MlflowClient(tracking_uri=mlflow_uri(exp))
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])  # Ray names one per trial
        folders = [d for d in exp.iterdir() if (d / "result.json").exists()]
        assert len(folders) == len(runs) == len([d for d in (exp / "train").iterdir() if d.is_dir()]) > 1
        for folder in folders:
            trial = json.loads((folder / "result.json").read_text().splitlines()[0])["trial_id"]
            epochs = epochs_of(exp / "train" / f"train-{trial}")
            scalars = tensorboard_scalars(folder)
            assert not [tag for tag in scalars if "@" in tag or tag.startswith("ray/")]
            for name in table_names():
                expected = [(e, epochs[e][name]) for e in sorted(epochs)]
                assert [s for s, _ in scalars[tracker_name(name)]] == [e for e, _ in expected], (folder, name)
                assert [v for _, v in scalars[tracker_name(name)]] == pytest.approx([v for _, v in expected])
                (run,) = [r for r in runs if r.info.run_name.endswith(f"_{trial}")]
                history = client.get_metric_history(run.info.run_id, tracker_name(name))
                assert sorted((m.step, m.value) for m in history) == expected, (trial, name)  # float64, as reported


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.soak  # a sweep of its own, minutes past CI's time (CI's part: the grid rehearsal's, fast tier)
@pytest.mark.timeout(900)
def test_the_pages_python_session_runs_on_a_confirmed_sweep(confirmed_sweep):
    """``tools.ray_results`` (what docs/sweeps.md shows) on this sweep: every statement runs, and the
    result grid's checkpoint is the one Tune's own result names."""
    from tools.ray_results import transcript

    session = transcript(str(confirmed_sweep))
    assert session.splitlines()[-1] == "(None, True)", session  # Tune's own result: no checkpoint, its path
