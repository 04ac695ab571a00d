"""Faults change nothing: the chaos soak of bench.chaos at its smoke size, in the multinode tier
(the suite's smoke run of bench.chaos)."""

from __future__ import annotations

import json

import pytest
from conftest import multinode_cluster

from bench.chaos import KINDS, NAMED, NODE, SMOKE, chaos_settings, compare, epoch_metrics, run_sweep

pytestmark = [pytest.mark.multinode, pytest.mark.slow, pytest.mark.soak, pytest.mark.timeout(1200)]
ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    with multinode_cluster(*[NODE] * 3) as c:
        yield c


def test_a_sweep_under_one_fault_of_each_kind_ends_with_the_quiet_sweeps_results(cluster, tmp_path):
    """The chaos soak (bench.chaos), short: a grid sweep of 4 trials x 3 epochs, checkpoints
    every 2 steps, run without faults and then under one fault of each kind injected at seeded
    random moments (a Train worker SIGKILLed, a node lost and another added, a node drained
    before a planned reboot and removed once its ranks marked their checkpoint registered, a rank
    stopped past the stall timeout, a trial's run folder immutable for a while, the driver killed
    and resumed, the head rebooted: the whole cluster ended and started again, the sweep continued
    by the boot service's step).
    Every trial's per-epoch metrics (timing aside) equal the quiet sweep's bitwise: on CPU a
    restart resumes from the exact state of a checkpoint, and the data order is a function of
    (seed, epoch, step) alone. No trial is lost or counted twice, and the logs name every fault."""
    settings = chaos_settings(tmp_path, epochs=SMOKE["epochs"], orders=SMOKE["orders"])
    quiet = run_sweep(cluster, tmp_path / "quiet", [*settings[:-1], f"run.storage_path={tmp_path / 'quiet'}"])
    loud = run_sweep(cluster, tmp_path / "loud", [*settings[:-1], f"run.storage_path={tmp_path / 'loud'}"],
                     faults=SMOKE["faults"], seed=SMOKE["seed"], mean_gap_s=SMOKE["gap"])
    kinds = sorted({f["kind"] for f in loud["faults"]})
    assert compare(quiet["experiment"], loud["experiment"]) == []
    trials = epoch_metrics(loud["experiment"])
    assert len(trials) == 4 and all([r["epoch"] for r in rows] == ["1.0", "2.0", "3.0"] for rows in trials.values())
    print("faults:", json.dumps(loud["faults"], indent=1), f"\nquiet {quiet['seconds']:.0f} s, loud {loud['seconds']:.0f} s")
    assert kinds == sorted(KINDS), f"not every kind was injected before the sweep ended: {kinds}"
    # the logs name every fault: the driver's restart, the watchdog's alert for the stopped rank
    # (on the terminal), and a restart of the worker group for every rank or node lost
    log, console = loud["log"].read_text(), (loud["experiment"] / "raymcn_console.log").read_text()
    assert loud["driver_starts"] == 3 and "(resume) ===" in log and "(boot service) ===" in log
    assert "raymcn boot: continuing the sweep" in log  # the boot service's step found the unfinished sweep
    assert all(f["steps_lost"] >= 0 for f in loud["faults"])
    # (a rank stopped as its trial ended meets no watchdog; the soak then stops another one)
    assert "STALL: rank" in log and any(f"({NAMED})" in f["detail"] for f in loud["faults"]), loud["faults"]
    lost = sum(f["kind"] in ("kill_worker", "lose_node") or f"({NAMED})" in f["detail"] for f in loud["faults"])
    assert console.count("[FailurePolicy] RETRY") >= lost
