"""run.trackers of a single run (train/monitor/trackers.py) and of a sweep's trials (sweep/trackers.py):
every epoch's metrics in MLflow and TensorBoard under the results table's names (spelled by
``config.tracker_name``, the one mapping: MLflow refuses '@', tensorboardX turns it into '_'),
TensorBoard by default, a resumed run continuing its MLflow run, a missing tracker dropped with a
warning, the Train controller's callback that feeds them (the Ray runs that write them:
tests/test_train_ray.py, tests/test_ray_results.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from raymcn.config import BEST, ConfigError, load_config, metric_names, tracker_name
from raymcn.train.monitor.trackers import Trackers


def mlflow_history(run_dir: Path, metric: str) -> list[float]:
    """The values of ``metric`` in the run's MLflow store, by epoch."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
    return [m.value for m in sorted(client.get_metric_history(run_id, metric), key=lambda m: m.step)]


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files of ``folder`` (a run's ``tensorboard`` folder, a
    sweep's trial folder), tag -> (step, value) by step, read as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: sorted((e.step, e.value) for e in events.Scalars(tag)) for tag in events.Tags()["scalars"]}


def tensorboard_history(folder: Path, metric: str) -> list[float]:
    """The values of ``metric`` in the TensorBoard event files of ``folder``, by epoch."""
    return [value for _, value in tensorboard_scalars(folder)[metric]]


def table_names() -> list[str]:
    """Every metric of the table and its best so far, as each epoch reports them (``text_to_video_R@10``)."""
    return [name for m in metric_names() for name in (m, BEST + m)]


def epoch_metrics(epoch: int) -> dict[str, float]:
    values = {"epoch": float(epoch), "text_to_video_R@10": 10.0 * epoch, "total_loss": 5.0 / epoch}
    values.update({name: 100.0 * epoch + i for i, name in enumerate(table_names()) if name not in values})
    return values


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
    assert tracker_name("text_to_video_R@10") == "text_to_video_R_at_10"  # '@' is not allowed there
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    for name in table_names():  # every metric of the table and its best, by the one mapping, in both
        expected = [epoch_metrics(e)[name] for e in (1, 2, 3)]
        assert mlflow_history(run_dir, tracker_name(name)) == expected, name
        assert [v for _, v in scalars[tracker_name(name)]] == expected, name
    assert [step for step, _ in scalars["text_to_video_R_at_10"]] == [1, 2, 3]  # the epoch is the step
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
    assert tensorboard_history(tmp_path / "r" / "tensorboard", "total_loss") == [5.0, 2.5]


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
    assert tensorboard_history(folder / "tensorboard", "total_loss") == [5.0, 2.5]  # rank 0's, not rank 1's
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


@pytest.mark.ray  # (its data stream is Ray Data's, which joins the suite's instance or starts one)
def test_a_run_without_workers_feeds_its_trackers_from_its_rank_and_tensorboard_is_on_by_default(ray_local, tmp_path):
    """Ray Train's local mode (``scale.num_workers=0``) calls no callback: the in-process rank logs
    every epoch, the same values as metrics.csv; with no ``run.trackers`` set, to TensorBoard, every
    metric of the table and its best so far by the names the table gives them."""
    pytest.importorskip("tensorboard")
    import pandas as pd
    from conftest import TINY

    from raymcn.cli import preset_path
    from raymcn.train.on_ray import launch

    cfg = load_config(preset_path(), ["scale.num_workers=0", *TINY, "schedule.epochs=2"])
    assert cfg.run.trackers == "tensorboard"
    launch.fit(cfg, tmp_path / "local")
    table = pd.read_csv(tmp_path / "local" / "metrics.csv")
    assert len(table) == 2
    scalars = tensorboard_scalars(tmp_path / "local" / "tensorboard")
    for name in ["total_loss", *table_names()]:
        assert [step for step, _ in scalars[tracker_name(name)]] == list(table["epoch"]), name
        assert [value for _, value in scalars[tracker_name(name)]] == pytest.approx(list(table[name])), name
    assert not [tag for tag in scalars if "@" in tag]


def test_a_sweeps_trials_reach_mlflow_and_tensorboard_under_a_runs_names_one_point_per_epoch(tmp_path):
    """The sweep's Tune callbacks (sweep/trackers.py) fed as Tune feeds them: a trial's results, the
    last two after a BOHB pause (Tune's iteration starts again, the epoch goes on). Every metric of
    the table and its best reach MLflow and TensorBoard by the names a run's trackers use, at the
    epoch; Tune's own TensorBoard logger is not added beside raymcn's, with tensorboard in
    ``run.trackers`` or without."""
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    from mlflow.tracking import MlflowClient
    from ray.tune.logger import TBXLoggerCallback
    from ray.tune.utils.callback import _create_default_callbacks

    from raymcn.sweep.trackers import NoTensorBoard, TensorBoardCallback, mlflow_uri, sweep_callbacks

    class Trial:  # what Tune's loggers read of a trial
        config = evaluated_params = {"optim.lr": 0.001}
        local_path = str(tmp_path / "EXP" / "joint-lr1e-3-abc_00000")

        def init_local_path(self):
            Path(self.local_path).mkdir(parents=True, exist_ok=True)

        def __str__(self):
            return "trial_fn_abc_00000"

    exp = str(tmp_path / "EXP")
    callbacks = sweep_callbacks(load_config(None, ["run.trackers=mlflow,tensorboard"]), exp)
    assert [type(c) for c in _create_default_callbacks(list(callbacks)) if isinstance(c, TBXLoggerCallback)] == [
        TensorBoardCallback]
    off = sweep_callbacks(load_config(None, ["run.trackers="]), exp)
    loggers = [type(c) for c in _create_default_callbacks(list(off)) if isinstance(c, TBXLoggerCallback)]
    assert loggers == [NoTensorBoard]
    trial = Trial()
    for c in callbacks:
        c.setup()
    for iteration, epoch in ((1, 1), (2, 2), (1, 2), (2, 3)):  # paused after epoch 2, resumed from its checkpoint
        result = {**epoch_metrics(epoch), "training_iteration": iteration, "trial_id": "abc_00000", "done": False,
                  "checkpoint_path": "/somewhere", "config": Trial.config}
        for c in callbacks:
            if iteration == 1:  # (re)started
                c.on_trial_start(iteration, [trial], trial)
            c.on_trial_result(iteration, [trial], trial, result)
    for c in callbacks:
        c.on_trial_complete(3, [trial], trial)
    client = MlflowClient(tracking_uri=mlflow_uri(exp))
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    scalars = tensorboard_scalars(Path(Trial.local_path))
    for name in ["total_loss", *table_names()]:
        expected = [(e, epoch_metrics(e)[name]) for e in (1, 2, 2, 3)]
        history = client.get_metric_history(run.info.run_id, tracker_name(name))
        assert sorted((m.step, m.value) for m in history) == expected, name
        assert [s for s, _ in scalars[tracker_name(name)]] == [s for s, _ in expected], name
        assert [v for _, v in scalars[tracker_name(name)]] == pytest.approx([v for _, v in expected]), name  # float32
    assert not [tag for tag in scalars if "@" in tag or tag.startswith("ray/")]
    quiet = Trial()
    quiet.local_path = str(tmp_path / "EXP-off" / "trial")
    for c in off:  # run.trackers="": Tune's logger replaced by one that writes nothing
        c.on_trial_start(1, [quiet], quiet)
        c.on_trial_result(1, [quiet], quiet, {**epoch_metrics(1), "training_iteration": 1})
        c.on_trial_complete(1, [quiet], quiet)
    assert not (tmp_path / "EXP-off").exists()




def test_unknown_trackers_are_refused_naming_the_allowed_ones():
    with pytest.raises(ConfigError, match="run.trackers=mlflow,neptune: a comma-separated subset of mlflow, wandb"):
        load_config(None, ["run.trackers=mlflow,neptune"])


# --- what made the numbers (raymcn/provenance/): the same record, each tracker's own way --------------------------
def recorded_entry(checkout, monkeypatch) -> dict:
    """A driver's entry for the checkout fixture (its commit and its uncommitted change), as a run writes one."""
    from raymcn.provenance import collect

    monkeypatch.setattr(collect, "PACKAGE_DIR", checkout.package)
    return {"command": ["raymcn", "train"], "code": collect.code_identity(), "environment": collect.environment(),
            "host": collect.host(), "data": {}, "seeds": {"run.seed": 1}}


def tensorboard_texts(folder: Path) -> dict[str, list[str]]:
    """Every text of TensorBoard's text plugin in ``folder``'s event files, tag -> texts by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [e.tensor_proto.string_val[0].decode() for e in sorted(events.Tensors(tag), key=lambda e: e.step)]
            for tag in events.Tags()["tensors"]}


class FakeWandb:
    """What a run's trackers call of ``wandb`` (not installed here): ``init``'s arguments kept."""

    def __init__(self):
        self.inits: list[dict] = []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, *args, **kwargs):
        pass

    def finish(self):
        pass


def test_a_runs_record_reaches_mlflows_own_tags_wandbs_config_and_tensorboards_text(tmp_path, checkout, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    import sys

    from mlflow.tracking import MlflowClient

    from raymcn.provenance import record
    from raymcn.provenance.describe import changes_text

    entry = recorded_entry(checkout, monkeypatch)
    run_dir = tmp_path / "r"
    record.append(str(run_dir), entry)
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    cfg = load_config(None, ["run.trackers=mlflow,wandb,tensorboard", "run.name=r"])
    trackers = Trackers(cfg, str(run_dir), say=pytest.fail)
    trackers.log(1, epoch_metrics(1))
    trackers.close()
    run_id = (run_dir / "mlflow_run_id.txt").read_text()
    tags = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}").get_run(run_id).data.tags
    assert tags["mlflow.source.git.commit"] == checkout.commit and tags["mlflow.source.type"] == "LOCAL"
    assert tags["raymcn.uncommitted_changes"] == changes_text(entry["code"]) != "none"
    (init,) = wandb.inits
    assert init["config"]["provenance/commit"] == checkout.commit and init["config"]["optim.lr"] == cfg.optim.lr
    (text,) = tensorboard_texts(run_dir / "tensorboard")["raymcn/provenance/text_summary"]
    assert f"commit {checkout.commit[:7]} with uncommitted changes" in text and "raymcn_provenance.jsonl" in text
    # resumed on a new commit: the MLflow run's tag follows, the record keeps both
    record.append(str(run_dir), {**entry, "code": {**entry["code"], "commit": "f" * 40}})
    resumed = Trackers(cfg, str(run_dir), say=pytest.fail)
    resumed.log(2, epoch_metrics(2))
    resumed.close()
    tags = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}").get_run(run_id).data.tags
    assert tags["mlflow.source.git.commit"] == "f" * 40
    assert len(tensorboard_texts(run_dir / "tensorboard")["raymcn/provenance/text_summary"]) == 2


def test_a_sweeps_record_reaches_each_trials_mlflow_run_wandb_config_and_tensorboard_text(tmp_path, checkout,
                                                                                       monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    from mlflow.tracking import MlflowClient
    from ray.air.integrations import wandb as rays_wandb

    from raymcn.provenance import record
    from raymcn.sweep.trackers import mlflow_uri, sweep_callbacks

    exp = tmp_path / "EXP"
    record.append(str(exp), recorded_entry(checkout, monkeypatch))

    class Trial:  # what Tune's loggers read of a trial
        config = evaluated_params = {"optim.lr": 0.001}
        local_path = str(exp / "joint-lr1e-3-abc_00000")
        trial_id, experiment_dir_name = "abc_00000", "EXP"

        def init_local_path(self):
            Path(self.local_path).mkdir(parents=True, exist_ok=True)

        def __str__(self):
            return "trial_fn_abc_00000"

    trial = Trial()
    for c in sweep_callbacks(load_config(None, ["run.trackers=mlflow,tensorboard"]), str(exp)):
        c.setup()
        c.on_trial_start(1, [trial], trial)
        c.on_trial_result(1, [trial], trial, {**epoch_metrics(1), "training_iteration": 1, "config": Trial.config})
        c.on_trial_complete(1, [trial], trial)
    client = MlflowClient(tracking_uri=mlflow_uri(str(exp)))
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.data.tags["mlflow.source.git.commit"] == checkout.commit
    (text,) = tensorboard_texts(Path(Trial.local_path))["raymcn/provenance/text_summary"]
    assert f"commit {checkout.commit[:7]}" in text
    monkeypatch.setattr(rays_wandb, "wandb", FakeWandb())  # Ray's callback needs wandb importable
    (_, logger) = sweep_callbacks(load_config(None, ["run.trackers=wandb"]), str(exp))
    started: list[dict] = []
    monkeypatch.setattr(logger, "_start_logging_actor", lambda trial, excluded, **init: started.append(init))
    logger.log_trial_start(trial)
    (init,) = started
    assert init["config"]["provenance/commit"] == checkout.commit and init["config"]["optim.lr"] == 0.001
    assert init["group"] == "EXP" and logger.kwargs.get("config") is None  # the next trial gets its own
