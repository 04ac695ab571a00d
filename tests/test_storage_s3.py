"""`run.storage_path` as a bucket URI, against an S3-compatible server (moto's server mode) that
this module starts on 127.0.0.1: a run's config and checkpoints, a crash resumed from the bucket
(by URI and with `--resume latest`), a sweep, and the results table read from the bucket.

Ray reaches the server through the usual AWS variables (AWS_ENDPOINT_URL, credentials), which the
Ray workers inherit from this process, as on a cluster they come from each node's environment.
"""

from __future__ import annotations

import pytest
from conftest import TINY, last_json, stop_shared_ray

from bench import services
from raymcn.cli import main

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def bucket():
    """An S3 server on 127.0.0.1 with one empty bucket; yields its URI. Stops the server after."""
    if not services.MOTO.exists():
        pytest.skip("moto's server is not installed (the test extras install moto[server])")
    # The suite's shared Ray instance started before this module's variables were set: its workers
    # would not see the server. One started after them (ray_local, next) does; it is stopped with the
    # server, so no later module's workers keep the dead server's address.
    stop_shared_ray()
    with services.s3_server("raymcn-test") as uri:
        yield uri
    stop_shared_ray()


def _keys(uri: str) -> list[str]:
    import pyarrow.fs as pafs

    from raymcn import storage

    fs, path = storage.filesystem(uri)
    return sorted(i.path.removeprefix(path + "/") for i in fs.get_file_info(pafs.FileSelector(path, recursive=True)))



def test_a_run_checkpoints_to_the_bucket_and_resumes_from_it(bucket, ray_local, monkeypatch, capsys):
    runs = f"{bucket}/runs"
    common = ["--num-workers", "1", "--json", *[a for kv in TINY for a in ("--set", kv)],
              "--set", "scale.cpus_per_worker=1", "--set", f"run.storage_path={runs}", "--set", "run.trackers=mlflow"]
    monkeypatch.setenv("RAYMCN_FAULT", "raise_after_epoch=2")  # a crash no restart follows
    assert main(["train", *common, "--set", "scale.max_failures=0"]) != 0
    monkeypatch.delenv("RAYMCN_FAULT")
    capsys.readouterr()
    (run,) = {k.split("/")[0] for k in _keys(runs)}
    keys = _keys(f"{runs}/{run}")
    assert "raymcn_config.yaml" in keys and any(k.endswith("/state.pt") for k in keys), keys

    assert main(["train", "--resume", "latest", "--set", f"run.storage_path={runs}", "--set", "scale.max_failures=3",
                 "--json"]) == 0
    out = last_json(capsys.readouterr().out)
    assert out["run_dir"] == f"{runs}/{run}" and out["epochs"] == 3  # continued in the bucket, from epoch 2
    # run.trackers: MLflow's SQLite store in the driver's cache, not in the bucket, one MLflow run
    # over both attempts, ending with the last epoch's metrics
    from mlflow.tracking import MlflowClient

    from raymcn.config import DEFAULT_OBJECTIVE, Config, default_cache_dir, objective, tracker_name

    DEFAULT_METRIC = objective(DEFAULT_OBJECTIVE).reported

    assert not [k for k in _keys(f"{runs}/{run}") if "mlflow" in k]
    folder = default_cache_dir(Config()) / "trackers" / run
    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    history = client.get_metric_history((folder / "mlflow_run_id.txt").read_text().strip(),
                                        tracker_name(DEFAULT_METRIC))
    by_epoch = {m.step: m.value for m in history}
    assert {1, 3} <= set(by_epoch) <= {1, 2, 3} and by_epoch[3] == pytest.approx(out[DEFAULT_METRIC])


@pytest.mark.soak  # the sweep's storage path is the run's (the test above); this adds its tables, plots, MLflow
def test_the_smoke_sweep_in_the_bucket_its_table_plots_and_mlflow(bucket, ray_local, capsys):
    """The smoke sweep with its storage in the bucket: Tune's state and both trials there, the
    table and plots from a local copy, MLflow's store in the local cache."""
    import mlflow

    from raymcn.config import DEFAULT_OBJECTIVE, Config, default_cache_dir, objective, tracker_name
    from raymcn.results.table import load_experiment
    from raymcn.sweep.trackers import mlflow_uri

    DEFAULT_METRIC = objective(DEFAULT_OBJECTIVE).reported

    sweeps = f"{bucket}/sweeps"
    assert main(["sweep", "--config", "sweeps/smoke.yaml", "--json", "--set", f"run.storage_path={sweeps}",
                 "--set", "schedule.epochs=2", "--set", "run.trackers=mlflow"]) == 0
    out = last_json(capsys.readouterr().out)
    exp = out["experiment_dir"]
    assert exp.startswith(sweeps + "/")
    assert out["best_config"]["schedule.stage_order"] in ("AV_T", "joint") and DEFAULT_METRIC in out["best_metrics"]
    keys = _keys(exp)
    assert "raymcn_sweep.yaml" in keys and sum(k.endswith("/result.json") for k in keys) == 2, keys
    from raymcn.servers import sweeps as marks

    assert marks.state(exp) == "finished" and marks.unfinished_sweeps(sweeps) == []  # a boot leaves it alone

    assert main(["table", exp, "--format", "csv"]) == 0
    csv = capsys.readouterr().out.strip().splitlines()
    header = csv[0].split(",")
    assert len(csv) == 1 + 2, csv  # one row per trial
    for col in ("schedule.stage_order", f"final_{DEFAULT_METRIC}", f"best_{DEFAULT_METRIC}", "total_loss",
                "epochs", "status", "wall_s", "time_forward_s"):
        assert col in header, header
    local = default_cache_dir(Config()) / "experiments" / exp.rsplit("/", 1)[1]
    # the trials' checkpoints stay in the bucket (no table reads them); their metrics.csv, which fill
    # epochs Tune's result files lack, come along
    # (Ray Train's checkpoint_manager_snapshot.json is a file beside them, and comes along)
    assert not [p for p in local.rglob("checkpoint_*") if p.is_dir()] and len(list(local.glob("train/*/metrics.csv"))) == 2
    trials, curves = load_experiment(local)
    assert len(trials) == 2 and set(trials["status"]) == {"done"}
    assert sorted(trials["schedule.stage_order"]) == ["AV_T", "joint"]
    assert (trials["epochs"] == 2).all() and len(curves) == 4
    best = curves.groupby("trial")[DEFAULT_METRIC].max()
    for _, row in trials.iterrows():
        assert row[f"best_{DEFAULT_METRIC}"] == pytest.approx(best[row["trial"]])
    for png in ("learning_curves.png", "best_by_stage_order.png"):  # plots go to the local copy
        assert (local / png).stat().st_size > 5000

    mlflow.set_tracking_uri(mlflow_uri(exp))
    runs = mlflow.search_runs(search_all_experiments=True)
    assert len(runs) == 2 and f"metrics.{tracker_name(DEFAULT_METRIC)}" in runs.columns
