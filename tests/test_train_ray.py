"""Training on a real local Ray instance with gloo workers: CLI smoke runs, a group that takes every CPU.

(Crashes and resumes: tests/test_resume.py.)"""

import json
import re
import shlex
from pathlib import Path

import pytest
import torch

from raymcn.cli import main
from raymcn.config import load_config, metric_names

pytestmark = pytest.mark.ray


def test_cli_smoke_run_learns(ray_local, capsys, tmp_path, monkeypatch, checkout):
    # Every rank records what it computes with (train/probes.py; the workers get RAYMCN_* variables)
    monkeypatch.setenv("RAYMCN_TIMELINE", str(tmp_path / "timeline.jsonl"))
    # The driver runs from a git checkout with an uncommitted change (its package's sources are the
    # ranks', tests/git_checkout.py): its record must say so
    from raymcn.provenance import collect

    monkeypatch.setattr(collect, "PACKAGE_DIR", checkout.package)
    code = main(["train", "--config", "sweeps/smoke.yaml", "--num-workers", "2", "--json",
                 "--set", f"run.storage_path={tmp_path}", "--set", "run.trackers=mlflow,tensorboard"])
    assert code == 0
    # the thread setting reaches every rank: torch's count and OMP_NUM_THREADS, as the config says
    threads = load_config("sweeps/smoke.yaml", []).scale.torch_threads
    events = [json.loads(line) for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    ranks = {e["rank"]: e for e in events if e["event"] == "worker: function entered"}
    assert sorted(ranks) == [0, 1]
    assert all(e["threads"] == threads and e["omp"] == str(threads) for e in ranks.values()), ranks
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    chance = 100 * 10 / summary["eval_size"]
    assert summary["eval_size"] == 256 and summary["epochs"] == 4
    # Well above chance, not a figure measured on one machine: R@10 moves with the kernels and the
    # scheduling, and 3x chance leaves room for both.
    assert summary["text_to_video_R@10"] > 3 * chance
    for key in ("text_to_video_R@1", "text_to_video_R@5", "text_to_video_MedR", "total_loss", "cluster_loss",
                "recon_loss", "contrastive_loss", "run_dir"):
        assert key in summary
    # metrics.csv beside the checkpoints: one row per epoch, the last one the run's final metrics
    import pandas as pd

    table = pd.read_csv(Path(summary["run_dir"]) / "metrics.csv")
    assert list(table["epoch"]) == [1.0, 2.0, 3.0, 4.0]
    assert table["text_to_video_R@10"].iloc[-1] == pytest.approx(summary["text_to_video_R@10"])
    assert {"total_loss", "time_forward_s", "samples_per_s", "bad_samples"} <= set(table.columns)
    # run.trackers: every metric of the table and its best so far, each epoch, in MLflow and
    # TensorBoard by the table's names, as config.tracker_name spells them (tests/test_trackers.py)
    from test_trackers import mlflow_history, table_names, tensorboard_history

    from raymcn.config import tracker_name

    run_dir = Path(summary["run_dir"])
    for name in table_names():
        for history in (mlflow_history(run_dir, tracker_name(name)),
                        tensorboard_history(run_dir / "tensorboard", tracker_name(name))):
            assert history == pytest.approx(list(table[name])), name
    best = table["text_to_video_R@10"].cummax()  # the best so far, epoch by epoch
    assert list(table["best_text_to_video_R@10"]) == list(best) and list(table["best_text_to_video_MedR"]) == list(
        table["text_to_video_MedR"].cummin())
    # The 2 ranks' evaluation scored one model, the one the last checkpoint holds: `raymcn eval` of
    # it in one process (with the ranks' thread count) gives the run's own last metrics.
    from raymcn.train.checkpoints import payload as checkpoint

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert main(["eval", "--checkpoint", str(checkpoint.list_checkpoints(run_dir)[-1]), "--device", "cpu",
                     "--json"]) == 0
    finally:
        torch.set_num_threads(previous)
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {k: evaluated[k] for k in metric_names()} == {k: summary[k] for k in metric_names()}
    recorded_as_set_up(run_dir, checkout, out)
    # its MLflow run carries the commit under MLflow's own tag; `raymcn reproduce` recreates its settings
    from mlflow.tracking import MlflowClient

    run_id = (run_dir / "mlflow_run_id.txt").read_text()
    tags = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}").get_run(run_id).data.tags
    assert tags["mlflow.source.git.commit"] == checkout.commit
    assert main(["reproduce", str(run_dir)]) == 0
    (command,) = [shlex.split(line) for line in capsys.readouterr().out.splitlines()
                  if line.startswith(".venv/bin/raymcn train")]
    assert load_config(command[command.index("--config") + 1], []) == load_config(run_dir / "raymcn_config.yaml", [])


def recorded_as_set_up(run_dir: Path, checkout, out: str, trial: str | None = None) -> None:
    """The run's record (raymcn_provenance.jsonl) holds what made it: the checkout's commit, its dirty
    flag and the patch of its uncommitted change; the driver's Python, torch, its CUDA build, Ray
    and numpy; every rank on this host, with the driver's sources; the data by its manifest's digest
    and shard count. The nodes agreed, so the run named none as differing."""
    import hashlib
    import platform
    import socket

    import ray
    from git_checkout import CHANGE, CHANGED

    from raymcn.provenance import record

    entries = record.read(str(run_dir))
    starts = record.drivers(entries)  # its start, and a resume of a sweep's trial killed with the driver
    assert starts and [e["entry"] for e in starts] == ["start"] + ["resume"] * (len(starts) - 1)
    for start in starts:
        code, env, data = start["code"], start["environment"], start["data"]
        assert (code["commit"], code["dirty"], code["patch_files"]) == (checkout.commit, True, [CHANGED])
        assert CHANGE in code["patch"] and start.get("trial") == trial
        assert (env["python"], env["torch"], env["cuda"], env["ray"]) == (
            platform.python_version(), torch.__version__, torch.version.cuda, ray.__version__)
        assert env["packages"]["numpy"] == env["numpy"] == __import__("numpy").__version__
        assert start["host"]["name"] == socket.gethostname()
        manifest = Path(data["shards"]["dir"]) / "manifest.json"
        assert data["shards"]["manifest"]["sha256"] == hashlib.sha256(manifest.read_bytes()).hexdigest()
        assert data["shards"]["shards"] == len(json.loads(manifest.read_text())["shards"])
    nodes = record.nodes_since_driver(entries)
    assert [n["host"] for n in nodes] == [socket.gethostname()] and nodes[0]["source_digest"] == code["source_digest"]
    assert nodes[0]["ranks"] == list(range(len(nodes[0]["ranks"]))) and nodes[0]["devices"][0] == "cpu"
    assert "nodes of this run differ" not in out


@pytest.mark.slow  # a second Ray Train run (the one-minute run is the fast tier's): the full tier
def test_ring_contrastive_trains_on_ray_train_workers(ray_local, capsys, tmp_path):
    """The ring passes rows point to point inside the process group Ray Train sets up: the user's
    command with the ring on trains 2 workers to the end and learns (its equality with one process
    is tests/test_dist_losses.py's)."""
    code = main(["train", "--config", "sweeps/smoke.yaml", "--num-workers", "2", "--json",
                 "--set", "scale.ring_contrastive=true", "--set", f"run.storage_path={tmp_path}"])
    assert code == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["epochs"] == 4
    assert summary["text_to_video_R@10"] > 3 * 100 * 10 / summary["eval_size"]
    assert "ring_contrastive: true" in (Path(summary["run_dir"]) / "raymcn_config.yaml").read_text()


@pytest.mark.slow  # a third Ray Train run: the full tier
def test_a_group_reserving_every_cpu_still_reads(ray_local, capsys, tmp_path):
    """An elastic group grown to the whole machine (4 x 0.5 CPU on the 2-CPU instance) leaves no CPU
    free; the read tasks reserve none, so every rank's reader still runs and the epoch ends
    (with a CPU request per read task some rank's reader waited forever)."""
    code = main(["train", "--config", "sweeps/smoke.yaml", "--set", "scale.num_workers=1-4", "--set",
                 "schedule.epochs=1", "--json", "--set", f"run.storage_path={tmp_path}"])
    assert code == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["epochs"] == 1 and summary["global_step"] == 16


def test_a_full_storage_ends_the_run_at_once_and_a_resume_finishes_it(ray_local, capsys, tmp_path, monkeypatch):
    """The smoke run's copy of epoch 2's checkpoint into its storage fails as a full disk does, where
    the copy writes (half of ``state.pt``, then ENOSPC: ``RAYMCN_FAULT=disk_full_at_epoch``). The
    command ends at that first error: no upload retried (a retry would have written the checkpoint:
    the fault fires once), no worker group restarted (each rank entered once). Its message names the
    storage's path and filesystem, its free bytes and what the checkpoints need; no folder under a
    checkpoint's name holds part of one, and Ray Train's bookkeeping points at epoch 1's. Once there
    is room, ``--resume`` finishes with one metrics row per epoch."""
    from raymcn import storage
    from raymcn.config import load_config
    from raymcn.train.checkpoints import payload, space

    monkeypatch.setenv("RAYMCN_FAULT", "disk_full_at_epoch=2")
    monkeypatch.setenv("RAYMCN_FAULT_DIR", str(tmp_path / "faults"))
    monkeypatch.setenv("RAYMCN_TIMELINE", str(tmp_path / "timeline.jsonl"))
    results = tmp_path / "results"
    assert main(["train", "--config", "sweeps/smoke.yaml", "--set", f"run.storage_path={results}"]) == 1
    err = capsys.readouterr().err
    (run_dir,) = results.glob("mcn-*")
    cfg = load_config("sweeps/smoke.yaml")
    assert "stopped at once, not retried (its storage cannot take what it writes): copying checkpoint" in err, err
    assert f"No space left on device, at {storage.space_at(run_dir).named()}: " in err
    assert re.search(r": [\d.]+ [kMGT]?B free of [\d.]+ [kMGT]?B\. One checkpoint is 14\.\d MB; ", err), err
    assert f"{space.held_at_once(cfg)} x" not in err and "at most" in err  # (the figure, not the formula)
    assert f"resume with: raymcn train --resume {run_dir}" in err
    entered = [json.loads(line) for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    assert sorted(e["rank"] for e in entered if e["event"] == "worker: function entered") == [0, 1]
    # nothing partial under a checkpoint's name; Ray Train registered epoch 1's, and only it
    names = sorted(p.name for p in run_dir.iterdir() if p.is_dir() and p.name != "tensorboard")
    assert len(names) == 1 and names[0].startswith("checkpoint_"), names
    assert payload.load(run_dir / names[0])["loop"]["epoch"] == 1
    snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    assert snapshot["latest_checkpoint_result"]["checkpoint_dir_name"] == names[0]

    import pandas as pd

    before = pd.read_csv(run_dir / "metrics.csv")
    assert main(["train", "--resume", str(run_dir)]) == 0
    assert re.search(r"\n  epochs +4\n", capsys.readouterr().out)
    after = pd.read_csv(run_dir / "metrics.csv")
    assert list(after["epoch"]) == [1.0, 2.0, 3.0, 4.0]
    # resumed from epoch 1's checkpoint: its row (its timings too) is the first run's, not trained again
    assert after.iloc[0].to_dict() == before.iloc[0].to_dict()
    for folder in payload.list_checkpoints(run_dir):  # every checkpoint whole
        payload.load(folder)
