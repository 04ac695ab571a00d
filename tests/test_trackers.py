"""run.trackers of a single run (train/monitor/trackers.py): every epoch's metrics in MLflow and
TensorBoard, a resumed run continuing its MLflow run, a missing tracker dropped with a warning,
the Train controller's callback that feeds them (the Ray run that writes them:
tests/test_train_ray.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from raymcn.config import ConfigError, load_config
from raymcn.train.monitor.trackers import Trackers


def mlflow_history(run_dir: Path, metric: str) -> list[float]:
    """The values of ``metric`` in the run's MLflow store, by epoch."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
    return [m.value for m in sorted(client.get_metric_history(run_id, metric), key=lambda m: m.step)]


def tensorboard_history(run_dir: Path, metric: str) -> list[float]:
    """The values of ``metric`` in the run's TensorBoard event files, by epoch (read as TensorBoard does)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [e.value for e in sorted(events.Scalars(metric), key=lambda e: e.step)]


def epoch_metrics(epoch: int) -> dict[str, float]:
    return {"epoch": float(epoch), "text_to_video_R@10": 10.0 * epoch, "total_loss": 5.0 / epoch}


def test_every_epoch_reaches_mlflow_and_tensorboard_and_a_resume_continues(tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    cfg = load_config(None, ["run.trackers=mlflow,tensorboard", "run.name=r"])
    run_dir = tmp_path / "r"
    first = Trackers(cfg, str(run_dir), say=pytest.fail)
    for epoch in (1, 2):
        first.log(epoch, epoch_metrics(epoch))
    first.close()
    run_id = (run_dir / "mlflow_run_id.txt").read_text()
    resumed = Trackers(cfg, str(run_dir), say=pytest.fail)  # a restart after epoch 2
    resumed.log(3, epoch_metrics(3))
    resumed.close()
    assert (run_dir / "mlflow_run_id.txt").read_text() == run_id  # the same MLflow run
    assert mlflow_history(run_dir, "text_to_video_R_at_10") == [10.0, 20.0, 30.0]  # '@' is not allowed there
    assert tensorboard_history(run_dir, "text_to_video_R@10") == [10.0, 20.0, 30.0]
    from mlflow.tracking import MlflowClient

    params = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}").get_run(run_id).data.params
    assert params["run.trackers"] == "mlflow,tensorboard" and params["optim.lr"] == str(cfg.optim.lr)


def test_a_tracker_that_cannot_start_is_dropped_with_a_warning_and_the_others_go_on(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    said: list[str] = []
    trackers = Trackers(load_config(None, ["run.trackers=wandb,tensorboard"]), str(tmp_path / "r"), say=said.append)
    trackers.log(1, epoch_metrics(1))
    trackers.log(2, epoch_metrics(2))
    trackers.close()
    assert len(said) == 1 and "run.trackers: wandb dropped for this run" in said[0]
    assert "pip install 'raymcn[wandb]'" in said[0]
    assert tensorboard_history(tmp_path / "r", "total_loss") == [5.0, 2.5]


def test_the_controllers_callback_logs_each_epochs_report_and_a_bucket_runs_files_stay_in_its_cache(
        tmp_path, monkeypatch):
    """``launch.TrackersOnController``, as Ray Train's controller gets it (pickled): rank 0's metrics of
    every epoch's report are logged, a mid-epoch checkpoint's report is not, the trackers close
    after the run's last epoch, and a run stored in a bucket writes into the driver's cache."""
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    import pickle

    from mlflow.tracking import MlflowClient

    from raymcn.config import MID_EPOCH_KEY
    from raymcn.train.on_ray.launch import TrackersOnController

    monkeypatch.setenv("RAYMCN_CACHE", str(tmp_path / "cache"))
    cfg = load_config(None, ["run.trackers=mlflow,tensorboard"])
    callback = pickle.loads(pickle.dumps(TrackersOnController(cfg, "s3://bucket/runs/r", epochs=2)))
    monkeypatch.setenv("RAYMCN_CACHE", str(tmp_path / "controller"))  # the driver's setting counts
    mid_epoch = {MID_EPOCH_KEY: 1.0, "epoch": 1.0, "global_step": 3.0, "text_to_video_R@10": -1.0}
    for reports in ([mid_epoch, mid_epoch], [epoch_metrics(1), epoch_metrics(1)], [mid_epoch],
                    [epoch_metrics(2), {**epoch_metrics(2), "total_loss": 99.0}]):
        callback.after_report(run_context=None, metrics=reports, checkpoint=None)
    folder = tmp_path / "cache" / "trackers" / "r"
    assert mlflow_history(folder, "text_to_video_R_at_10") == [10.0, 20.0]
    assert tensorboard_history(folder, "total_loss") == [5.0, 2.5]  # rank 0's, not rank 1's
    run_id = (folder / "mlflow_run_id.txt").read_text().strip()
    assert MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}").get_run(run_id).info.status == "FINISHED"
    assert not (tmp_path / "controller").exists()


def test_the_controllers_warning_about_a_tracker_is_marked_for_the_terminal(tmp_path, monkeypatch, capsys):
    """The controller's output reaches the terminal only as a tagged line (``monitor/console.py``)."""
    import sys

    from raymcn.train.monitor.console import TAG
    from raymcn.train.on_ray.launch import TrackersOnController

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    callback = TrackersOnController(load_config(None, ["run.trackers=wandb"]), str(tmp_path / "r"), epochs=1)
    callback.after_report(run_context=None, metrics=[epoch_metrics(1)], checkpoint=None)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"{TAG}warning: run.trackers: wandb dropped for this run"), line


def test_a_run_without_workers_feeds_its_trackers_from_its_rank(tmp_path):
    """Ray Train's local mode (``scale.num_workers=0``) calls no callback: the in-process rank logs
    every epoch, the same values as metrics.csv."""
    pytest.importorskip("tensorboard")
    import pandas as pd
    from conftest import TINY

    from raymcn.cli import preset_path
    from raymcn.train.on_ray import launch

    cfg = load_config(preset_path(), ["scale.num_workers=0", *TINY, "schedule.epochs=2", "run.trackers=tensorboard"])
    launch.fit(cfg, tmp_path / "local")
    table = pd.read_csv(tmp_path / "local" / "metrics.csv")
    assert tensorboard_history(tmp_path / "local", "total_loss") == pytest.approx(list(table["total_loss"]))
    assert len(table) == 2


def test_unknown_trackers_are_refused_naming_the_allowed_ones():
    with pytest.raises(ConfigError, match="run.trackers=mlflow,neptune: a comma-separated subset of mlflow, wandb"):
        load_config(None, ["run.trackers=mlflow,neptune"])
