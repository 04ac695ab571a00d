"""An elastic group (``scale.num_workers: [1, 2]``) on Ray's multi-node test cluster: a server lost
mid-epoch, training going on with the one worker left without waiting, growing back to two when a
server returns, and finishing with the uninterrupted run's results.

The cluster stands in for the lab's GPU servers: two "GPU servers" (2 CPUs, one worker each at
``scale.cpus_per_worker=2``) and a 1-CPU node that holds no worker and runs the read tasks. Losing a
server leaves room for exactly one worker, so the group must shrink to go on; Ray Train's elastic
policy restarts it from the last checkpoint on what can be placed and, every
``scale.elastic_resize_interval_s``, grows it when capacity returns (another restart from the last
checkpoint). Every step reads the same videos at any world size (the data order is a function of
seed, epoch and step), and with ``model.sync_batchnorm`` a step's arithmetic does not depend on the
world size, so the first step after the shrink, which starts from the uninterrupted run's own
checkpoint, has its loss terms to 1e-5. Later steps are not compared with a tolerance: one rank
sums the gradients in another order than an all-reduce of two, and Adam and the k-means refits
amplify that last-bit difference by an amount that depends on the CPU's kernels (test_resume.py
says more).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from conftest import (
    LOSS_TERMS,
    TINY,
    event_log_callback,
    in_background,
    multinode_cluster,
    preset,
    read_events,
    steps_as_run,
    train_worker_nodes,
    wait_for,
)

pytestmark = [pytest.mark.multinode, pytest.mark.slow, pytest.mark.soak, pytest.mark.timeout(900)]
ray = pytest.importorskip("ray")

SERVER = {"num_cpus": 2}  # room for one worker (scale.cpus_per_worker=2), nothing left
EPOCHS = 6
VIDEOS = 64  # TINY's corpus: every epoch reads each of them once, whatever the world


@pytest.fixture(scope="module")
def cluster():
    # One thread per worker: two workers of 2 "CPUs" share this machine's cores (the nodes inherit
    # the environment at their start). Restored for the modules after this one.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        with multinode_cluster(SERVER, SERVER, {"num_cpus": 1}) as c:  # the 1-CPU node: too small for a worker
            yield c


ELASTIC = [*TINY, f"schedule.epochs={EPOCHS}", "scale.num_workers=1-2", "scale.cpus_per_worker=2",
           "scale.elastic_resize_interval_s=2", "model.sync_batchnorm=true"]


def _epochs(log: Path) -> list[dict]:
    return [e for e in read_events(log) if "epoch" in e]


def test_an_elastic_group_shrinks_on_a_lost_server_grows_back_and_keeps_its_results(cluster, tmp_path, monkeypatch):
    from raymcn.train.on_ray import launch

    steady_log, log = tmp_path / "steady.jsonl", tmp_path / "elastic.jsonl"
    started = time.time()
    monkeypatch.setenv("RAYMCN_TRACE", str(tmp_path / "trace-steady"))
    steady = launch.fit(preset(*ELASTIC, f"run.storage_path={tmp_path}", "run.name=steady"),
                        callbacks=[event_log_callback(steady_log)])
    monkeypatch.setenv("RAYMCN_TRACE", str(tmp_path / "trace-elastic"))
    assert {e["workers"] for e in _epochs(steady_log)} == {2}  # both servers up: the whole group

    # The elastic run waits between epochs from epoch 3 on while a hold file exists, so the test,
    # not the machine's speed, decides that it is still running when the server comes back.
    hold = tmp_path / "faults" / "hold"
    hold.parent.mkdir()
    hold.touch()
    monkeypatch.setenv("RAYMCN_FAULT", "hold_after_epoch=3")
    monkeypatch.setenv("RAYMCN_FAULT_DIR", str(hold.parent))
    thread, out = in_background(launch.fit, preset(*ELASTIC, f"run.storage_path={tmp_path}", "run.name=elastic"),
                                callbacks=[event_log_callback(log)])
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
    assert a["epoch"] == b["epoch"] == EPOCHS and a["global_step"] == b["global_step"]  # the schedule did not move
    assert a["lr"] == pytest.approx(b["lr"], rel=1e-9)
    ran, uninterrupted = steps_as_run(tmp_path / "trace-elastic"), steps_as_run(tmp_path / "trace-steady")
    assert sorted(ran) == sorted(uninterrupted) == list(range(int(b["global_step"])))
    for step, mine in ran.items():  # the same clips at every step, whatever the world
        assert mine["keys"] == uninterrupted[step]["keys"], step
        for k, v in mine["inputs"].items():
            assert v == pytest.approx(uninterrupted[step]["inputs"][k], rel=1e-9), (step, k)
    first_alone = min(step for step, row in ran.items() if row["world"] == 1)
    assert all(ran[step]["world"] == 2 for step in range(first_alone))
    for term in LOSS_TERMS:  # resumed on one worker from the checkpoint both runs share
        assert ran[first_alone][term] == pytest.approx(uninterrupted[first_alone][term], rel=1e-5, abs=1e-6), term
    assert all(math.isfinite(a[k]) for k in LOSS_TERMS)
