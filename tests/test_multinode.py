"""Several nodes on one machine (Ray's multi-node test cluster: a head and 1-CPU nodes, each its own
raylet): where the workers and the read tasks run, a node lost in a run's second stage, and a node
drained before a planned reboot.

A lost node is ``cluster.remove_node(node, allow_graceful=False)``: its raylet and every process on
it die at once, as in a power loss. A node is added back a few seconds later (the lab's server
coming back). The default config must survive this: no ``scale.max_failures`` is set here.
"""

from __future__ import annotations

import json
import time

import pytest
from conftest import (
    NODE_STORE,
    TINY,
    event_log_callback,
    in_background,
    last_json,
    multinode_cluster,
    preset,
    read_events,
    read_trace,
    train_worker_nodes,
    wait_for,
)

pytestmark = [pytest.mark.multinode, pytest.mark.slow, pytest.mark.timeout(900)]
ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    # Three 1-CPU nodes: the two Train workers take one each; the third is where a lost one's comes back.
    with multinode_cluster(*[{"num_cpus": 1}] * 3) as c:
        yield c


# Each worker reserves a whole CPU of a 1-CPU node: the two workers land on two nodes; their
# read tasks (no CPU reserved) run beside them.
TWO_NODES = [*TINY, "scale.num_workers=2", "scale.cpus_per_worker=1"]


def lose_a_worker_node(cluster, back_after: float = 5.0) -> str:
    """Kill (not drain) a non-head node that hosts a Train worker; add a fresh node back later."""
    busy = set(wait_for("two Train workers", lambda: (n := train_worker_nodes()) and len(n) == 2 and n).values())
    victim = next(n for n in cluster.worker_nodes if n.node_id in busy)
    cluster.remove_node(victim, allow_graceful=False)
    time.sleep(back_after)
    cluster.add_node(num_cpus=1, object_store_memory=NODE_STORE)
    return victim.node_id


def test_workers_on_two_nodes_read_on_their_own_nodes_and_a_node_lost_in_stage_2_costs_one_partial_epoch(cluster,
                                                                                                       tmp_path):
    """The lab's case: a two-stage run (VT_A, its third modality from epoch 4 of 6) loses a worker's
    node in stage 2 and continues in stage 2 from its checkpoint, every epoch reported once. (No
    mid-epoch checkpoint here: the default run.checkpoint_every is longer than this run. The same
    loss in a sweep's trial, among other faults: tests/test_chaos.py.)"""
    from ray.util.state import list_tasks

    from raymcn.train.checkpoints import payload as checkpoint
    from raymcn.train.on_ray import launch

    epochs = 6
    cfg = preset(*TWO_NODES, f"run.storage_path={tmp_path}", f"schedule.epochs={epochs}", "schedule.stage_order=VT_A",
                 "schedule.stage1_fraction=0.5", "run.name=lost-node")
    assert cfg.stage1_epochs == epochs // 2
    log = tmp_path / "events.jsonl"
    thread, out = in_background(launch.fit, cfg, callbacks=[event_log_callback(log)])

    wait_for("the first checkpoint", lambda: any(e.get("epoch") for e in read_events(log)))
    nodes = set(train_worker_nodes().values())
    assert len(nodes) == 2, f"the two workers share a node: {nodes}"
    reads = [t for t in list_tasks(filters=[("state", "=", "FINISHED")], limit=10_000) if "ReadRaymcnSteps" in t.name]
    assert reads, "no Ray Data read task was recorded"
    # A rank's read tasks run on its own node (they reserve no CPU, so a full node still takes
    # them): a step's rows never cross the network
    assert {t.node_id for t in reads} <= nodes, "read tasks ran away from the Train workers' nodes"

    wait_for("a checkpoint in stage 2", lambda: any(e.get("stage") == 2 for e in read_events(log)))
    lost = lose_a_worker_node(cluster)
    thread.join(timeout=600)
    assert not thread.is_alive(), "the run did not finish after the node came back"
    if "error" in out:
        raise out["error"]
    result = out["value"]
    events = read_events(log)
    failures = [e for e in events if "failure" in e]
    reported = [e["epoch"] for e in events if "epoch" in e]
    assert failures, f"no worker-group failure was seen after node {lost} was removed"
    assert reported == list(range(1, epochs + 1)), reported  # every epoch once: nothing lost but the partial one
    stages = [e["stage"] for e in events if "epoch" in e]
    assert stages == [1] * cfg.stage1_epochs + [2] * (epochs - cfg.stage1_epochs), stages  # continued in stage 2
    assert events.index(failures[0]) > next(i for i, e in enumerate(events) if e.get("stage") == 2)  # lost in stage 2
    assert result.metrics["epoch"] == epochs and result.metrics["text_to_video_R@10"] >= 0
    last = checkpoint.list_checkpoints(result.run_dir)[-1]
    assert json.loads((last / checkpoint.META_FILE).read_text())["epoch"] == epochs
    assert lost not in set(train_worker_nodes().values())


def test_drained_servers_go_once_the_checkpoint_is_registered_and_the_run_goes_on_without_them(cluster, tmp_path,
                                                                                                  monkeypatch):
    """`raymcn drain`'s own `ray drain-node` command (reason preemption, its default 300 s deadline)
    on both nodes of a two-rank run (the lab's trial lives on one 4-GPU server; here its two ranks
    on two 1-CPU nodes), while the ranks wait before global step 5 of 12 (``hold_at_step``): at the
    first question after that step (``run.drain_check_every=1``) every rank checkpoints, waits for
    Ray Train to register it and marks it on its machine. `raymcn drain`'s wait on each node then
    ends on those marks, not at the deadline, and the test reboots both servers: their raylets
    go, fresh nodes stand in, and Ray Train restarts the group at once, counted as a preemption
    (``scale.max_failures=0``). Rank 1's batch after the checkpoint never arrives
    (``stall_data_at_step=6``, once), so nothing is trained past it that the test cannot see.
    Against the uninterrupted run: at most one step replayed, every traced step equal bitwise, the
    same final metrics."""
    import subprocess

    from raymcn.config import drain_marks_dir
    from raymcn.servers.drain import DEFAULT_DEADLINE_S, _ray_executable, drain_command, wait_for_node
    from raymcn.train.on_ray import launch

    base = ["run.checkpoint_every=0", "run.drain_check_every=1", "scale.max_failures=0"]
    monkeypatch.setenv("RAYMCN_TRACE", str(tmp_path / "trace-ref"))
    reference = launch.fit(preset(*TWO_NODES, f"run.storage_path={tmp_path}", *base, "run.name=undrained"))

    markers = tmp_path / "markers"
    markers.mkdir()
    (markers / "hold").touch()
    monkeypatch.setenv("RAYMCN_TRACE", str(tmp_path / "trace"))
    monkeypatch.setenv("RAYMCN_FAULT", "hold_at_step=5,stall_data_at_step=6")
    monkeypatch.setenv("RAYMCN_FAULT_DIR", str(markers))
    monkeypatch.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.5")  # Ray's default 5 s; propagated by Ray Train
    log = tmp_path / "events.jsonl"
    thread, out = in_background(launch.fit, preset(*TWO_NODES, f"run.storage_path={tmp_path}", *base, "run.name=drained"),
                                callbacks=[event_log_callback(log)])

    def traced(step: int) -> bool:
        rows = read_trace(tmp_path / "trace")
        return len(rows) == 2 and all(any(r["step"] == step for r in ranks) for ranks in rows.values())

    wait_for("both ranks past global step 4, holding before step 5", lambda: traced(4))
    busy = set(train_worker_nodes().values())
    victims = [n for n in cluster.worker_nodes if n.node_id in busy]
    assert len(victims) == 2, busy
    since, waits = time.time(), []
    try:
        for victim in victims:
            command = drain_command(_ray_executable(), cluster.address, victim.node_id, DEFAULT_DEADLINE_S, "test")
            drained = subprocess.run(command, capture_output=True, text=True, check=False)
            assert drained.returncode == 0, drained.stderr
        wait_for("the drains in Ray's state", lambda: {v.node_id for v in victims} <= set(
            ray._private.state.state.get_draining_nodes()))
        time.sleep(3.0)  # six of the watcher's polls: it has marked the workers (the test's only wait by the clock)
        (markers / "hold").unlink()
        waits = [wait_for_node(v.node_id, DEFAULT_DEADLINE_S, since, say=lambda _: None) for v in victims]
        go = time.time()
        jit = wait_for("the drain's checkpoint in the run's events",
                       lambda: [e["mid_epoch_step"] for e in read_events(log) if "mid_epoch_step" in e])
        assert jit[0] in (5, 6), jit  # the drain came with 5 steps done: the checkpoint within one step
        for left, marked in waits:  # each node's wait ended on its worker's mark of that checkpoint
            assert len(left) == 1 and list(marked) == left and marked[left[0]]["step"] == jit[0], waits
        assert go - since < DEFAULT_DEADLINE_S / 2
        for victim in victims:  # the reboots: the servers' raylets go, fresh nodes stand in
            cluster.remove_node(victim, allow_graceful=False)
        for _ in victims:
            cluster.add_node(num_cpus=1, object_store_memory=NODE_STORE)
        cluster.wait_for_nodes()
        thread.join(timeout=600)
        assert not thread.is_alive(), "the run did not finish after its servers were rebooted"
        if "error" in out:
            raise out["error"]
        ended = time.time()
        print(f"drained: the nodes' waits ended {go - since:.1f} s after the drains, "
              f"the run {ended - since:.1f} s after")
        assert ended - since < DEFAULT_DEADLINE_S  # restarted when the servers left, not at the drain's deadline
        assert (markers / "fired-stall_data_at_step").exists()  # the first attempt froze: only a restart went on
        assert jit == [jit[0]]  # one, not one per question after it
        ref, got = read_trace(tmp_path / "trace-ref"), read_trace(tmp_path / "trace")
        for rank in (0, 1):
            steps = [r["step"] for r in got[rank]]
            assert steps == [*range(6), *range(jit[0], 12)], (rank, steps)  # at most step 5 again
            assert got[rank] == ref[rank][:6] + ref[rank][jit[0]:], rank  # both attempts, bitwise

        def untimed(metrics):
            return {k: v for k, v in metrics.items() if not k.startswith("time_") and k != "samples_per_s"}

        assert untimed(out["value"].metrics) == untimed(reference.metrics)
    finally:  # the servers back: the module's later tests count three 1-CPU nodes
        for victim in victims:
            if victim in cluster.worker_nodes:
                cluster.remove_node(victim, allow_graceful=False)
        while len(cluster.worker_nodes) < 3:
            cluster.add_node(num_cpus=1, object_store_memory=NODE_STORE)
        cluster.wait_for_nodes()
        for left, _ in waits:
            for pid in left:
                (drain_marks_dir() / str(pid)).unlink(missing_ok=True)


def test_the_doctor_checks_every_node_and_estimates_the_sweep(cluster, tmp_path, capsys):
    """`raymcn doctor` on the cluster (the head and three 1-CPU raylets), for the embedded default,
    then with `--step` for a shard folder given as data.shards (the step is the config's, whichever
    inputs: it runs once): every row that applies is ✔ on every node, each node that can hold a
    worker ran the real step, and the duration is estimated."""
    import shutil

    from raymcn.cli import main
    from raymcn.train.inputs import shard_folder

    base = [*TINY, f"run.storage_path={tmp_path / 'results'}", "scale.cpus_per_worker=1"]
    folder = tmp_path / "shards"
    shutil.copytree(shard_folder(preset(*base)), folder)
    for extra, step in (([], False), ([f"data.shards={folder}"], True)):
        argv = ["doctor", *(["--step"] if step else []), "--json", *sum((["--set", s] for s in [*base, *extra]), [])]
        assert main(argv) == 0, capsys.readouterr().out[-3000:]
        out = capsys.readouterr().out
        report = last_json(out)
        assert len(report["columns"]) == 4 and sum("(head)" in c for c in report["columns"].values()) == 1
        for node, rows in report["rows"].items():
            assert all(r["ok"] in (True, None) for r in rows), (node, [r for r in rows if r["ok"] is False])
            cpu_rows = [r for r in rows if not r["check"].startswith(("GPU", "torch uses"))]
            assert all(r["ok"] for r in cpu_rows if r["check"] != "CPUs for its workers" or "(head)" not in node)
        stepped = [n for n, rows in report["rows"].items() if any(r["check"] == "one training step" for r in rows)]
        assert "every check passed on every node" in out
        if not step:
            assert stepped == [] and report["estimate"] is None
            continue
        assert len(stepped) == 3 and all("(head)" not in n for n in stepped)  # the head holds no worker
        est = report["estimate"]
        assert est["search_trials"] == 8 and est["wall_s"][0] > 0 and est["step_s"] > 0
        assert "estimate: " in out


@pytest.mark.soak  # the BOHB file as test_rehearsals.py runs it, on the multi-node cluster
@pytest.mark.timeout(1200)
def test_the_doctor_rehearses_the_lab_sweep_on_the_cluster(cluster, tmp_path, capsys):
    """`raymcn doctor --rehearse --config sweeps/stage_order_bohb.yaml`, as on the lab's head, on the
    multi-node cluster (trials on several nodes, the storage and the corpus shared): every rehearsal
    row passes, in the head's column (the search, the rungs, BOHB's pause and resume, a trial driver
    killed and resumed, the confirmation, the answer line)."""
    from test_rehearsals import REHEARSAL_ROWS, lab_inputs, rehearsal_rows

    from raymcn.cli import main
    from raymcn.doctor.verdicts import FREE_DISK_CHECKS

    argv = ["doctor", "--rehearse", "--json", "--config", "sweeps/stage_order_bohb.yaml", *lab_inputs(),
            "--set", f"run.storage_path={tmp_path / 'results'}"]
    code = main(argv)
    out = capsys.readouterr().out
    report = last_json(out)
    # the storage's room for the lab file's checkpoints (29.6 GB at the paper's size) is this machine's
    # free disk: only the free-disk rows may fail, and then the command says so in its exit code
    failing = [r for rows in report["rows"].values() for r in rows if r["ok"] is False]
    assert all(r["check"] in FREE_DISK_CHECKS for r in failing), failing
    assert code == (1 if failing else 0), out[-4000:]
    rows = rehearsal_rows(report)
    assert set(rows) >= REHEARSAL_ROWS, sorted(rows)
    assert all(r["ok"] for r in rows.values()), rows
    assert "Answer: " in rows["rehearsal: answer line"]["detail"]

