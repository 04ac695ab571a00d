"""An elastic group (``scale.num_workers: [1, 2]``) on Ray's multi-node test cluster: a server lost
mid-epoch, training going on with the one worker left without waiting, growing back to two when a
server returns, and finishing with the uninterrupted run's results.

The cluster stands in for the lab's GPU servers: two "GPU servers" (2 CPUs, one worker each at
``scale.cpus_per_worker=2``) and a 1-CPU node that holds no worker and runs the read tasks. Losing a
server leaves room for exactly one worker, so the group must shrink to go on; Ray Train's elastic
policy restarts it from the last checkpoint on what can be placed and, every
``scale.elastic_resize_interval_s``, grows it when capacity returns (another restart from the last
checkpoint). With ``model.sync_batchnorm`` the step's arithmetic does not depend on the world size
(``tests/test_dist_losses.py``, ``tests/test_syncbn.py``: equal to 1e-5); what a resize may change
is which videos Ray Data's split puts together in a step, so the final metrics are compared within
a stated tolerance (``ELASTIC_TOLERANCE``; docs/faults.md).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from raymcn.cli import preset_path
from raymcn.config import load_config

from conftest import (TINY, event_log_callback, in_background, multinode_cluster, read_events, train_worker_nodes,
                      wait_for)

pytestmark = [pytest.mark.multinode, pytest.mark.timeout(900)]
ray = pytest.importorskip("ray")

SERVER = {"num_cpus": 2}  # room for one worker (scale.cpus_per_worker=2), nothing left
EPOCHS = 6
VIDEOS = 64  # TINY's corpus: every epoch reads each of them once, whatever the world
# The stated tolerance for a resized run against the uninterrupted one. A resize regroups the
# videos of every later step (Ray Data's split for the new world), a larger change than a
# restarted worker's (conftest's restart tolerance). Measured (docs/faults.md, fault table): loss 0.2 % and
# 1.1 %, cluster loss 3.0 % and 1.3 %, R@10 3.1 points (2 of 64 queries) both times, on the
# AVX-512 and the AVX2 kernel path; the uninterrupted runs of the two paths differ by 0.5 % in
# loss themselves. A run that lost its schedule or its state would be off by far more (epoch 1's
# loss is ~58 against ~33 at epoch 6).
ELASTIC_TOLERANCE = {"total_loss": dict(rel=0.03), "cluster_loss": dict(rel=0.10),
                     "text_to_video_R@10": dict(abs=8.0), "text_to_video_MedR": dict(rel=0.25)}


@pytest.fixture(scope="module")
def cluster():
    # One thread per worker: two workers of 2 "CPUs" share this machine's cores (the nodes inherit
    # the environment at their start). Restored for the modules after this one.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        with multinode_cluster(SERVER, SERVER, {"num_cpus": 1}) as c:  # the 1-CPU node: too small for a worker
            yield c


def _cfg(tmp_path: Path, name: str):
    return load_config(preset_path(), [
        *TINY, f"schedule.epochs={EPOCHS}", "scale.num_workers=1-2", "scale.cpus_per_worker=2",
        "scale.elastic_resize_interval_s=2", "model.sync_batchnorm=true",
        f"run.storage_path={tmp_path}", f"run.name={name}"])


def _epochs(log: Path) -> list[dict]:
    return [e for e in read_events(log) if "epoch" in e]


def test_an_elastic_group_shrinks_on_a_lost_server_grows_back_and_keeps_its_results(cluster, tmp_path, monkeypatch):
    from raymcn.train import launch

    steady_log, log = tmp_path / "steady.jsonl", tmp_path / "elastic.jsonl"
    started = time.time()
    steady = launch.fit(_cfg(tmp_path, "steady"), callbacks=[event_log_callback(steady_log)])
    assert {e["workers"] for e in _epochs(steady_log)} == {2}  # both servers up: the whole group

    # The elastic run waits between epochs from epoch 3 on while a hold file exists, so the test,
    # not the machine's speed, decides that it is still running when the server comes back.
    hold = tmp_path / "faults" / "hold"
    hold.parent.mkdir()
    hold.touch()
    monkeypatch.setenv("RAYMCN_FAULT", "hold_after_epoch=3")
    monkeypatch.setenv("RAYMCN_FAULT_DIR", str(hold.parent))
    thread, out = in_background(launch.fit, _cfg(tmp_path, "elastic"), callbacks=[event_log_callback(log)])
    wait_for("the first checkpoint", lambda: _epochs(log))
    busy = set(wait_for("two Train workers", lambda: (n := train_worker_nodes()) and len(n) == 2 and n).values())
    victim = next(n for n in cluster.worker_nodes if n.node_id in busy)
    cluster.remove_node(victim, allow_graceful=False)  # a server gone, in epoch 2
    lost_at = time.time()

    # Nothing comes back yet: the run must go on with the worker it has.
    alone = wait_for("an epoch trained by the one worker left",
                     lambda: [e for e in _epochs(log) if e["time"] > lost_at and e["workers"] == 1])
    cluster.add_node(**SERVER)  # the server is back
    back_at = time.time()
    grown = wait_for("an epoch trained by two workers again",
                     lambda: [e for e in _epochs(log) if e["time"] > back_at and e["workers"] == 2])
    hold.unlink()
    thread.join(timeout=600)
    assert not thread.is_alive(), "the elastic run did not finish"
    if "error" in out:
        raise out["error"]
    print(f"elastic: lost at {lost_at - started:.1f} s, first 1-worker epoch {alone[0]['time'] - lost_at:.1f} s "
          f"later; server back at {back_at - started:.1f} s, first 2-worker epoch {grown[0]['time'] - back_at:.1f} s "
          f"later; events {[(e.get('epoch'), e.get('workers'), e.get('failure')) for e in read_events(log)]}")

    events = _epochs(log)
    assert [e["epoch"] for e in events] == list(range(1, EPOCHS + 1))  # each epoch once: only the partial ones replayed
    assert any("failure" in e for e in read_events(log)), "the lost server was not seen as a failure"
    assert all(e["videos_read"] == VIDEOS for e in events), [(e["epoch"], e["videos_read"]) for e in events]

    a, b = out["value"].metrics, steady.metrics
    print("elastic vs uninterrupted:", {k: (a[k], b[k]) for k in ELASTIC_TOLERANCE})
    assert a["epoch"] == b["epoch"] == EPOCHS and a["global_step"] == b["global_step"]  # the schedule did not move
    for key, tol in ELASTIC_TOLERANCE.items():
        assert a[key] == pytest.approx(b[key], **tol), f"{key}: elastic {a[key]} vs uninterrupted {b[key]}"
