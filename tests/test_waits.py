"""A worker group Ray cannot place is named on the console: what it asks for, what is free, and
which placement groups hold the rest (``raymcn/train/on_ray/waits.py``)."""

from __future__ import annotations

import re

import pytest
from conftest import TINY, in_background, wait_for

from raymcn.train.on_ray import waits

NOW = 1_000.0


def _pg(pid: str, state: str, bundles: list[dict], age_s: float, name: str = "", job: str = "02000000") -> dict:
    return {"placement_group_id": pid, "name": name, "creator_job_id": job, "state": state,
            "bundles": [{"unit_resources": b} for b in bundles],
            "stats": {"creation_request_received_ns": str(int((NOW - age_s) * 1e9))}}


def test_a_group_waiting_past_the_limit_is_named_with_the_groups_that_hold_resources():
    pgs = [_pg("aaaa1111bbbb2222", "PENDING", [{"CPU": 1.0}, {"CPU": 1.0}], age_s=12),
           _pg("cccc", "CREATED", [{"CPU": 0.5}], age_s=500, name="old-trial", job="01000000"),
           _pg("dddd", "REMOVED", [{"CPU": 2.0}], age_s=900)]
    told: dict[str, float] = {}
    line = waits.waiting_line(pgs, {"CPU": 1.5}, {"CPU": 2.0, "memory": 1e9}, NOW, limit_s=10, told=told)
    assert line.startswith("WAITING for resources: aaaa1111bbbb (job 02000000) asks for {CPU: 1} x 2, waiting 12 s.")
    assert "Free: CPU 1.5 of 2." in line and "memory" not in line
    assert "Held by 1 placement group(s): old-trial (job 01000000) {CPU: 0.5}." in line  # a removed one holds nothing
    # the same request again (Ray Train makes a new group after each start timeout): not repeated at once ...
    pgs[0] = _pg("eeee", "PENDING", [{"CPU": 1.0}, {"CPU": 1.0}], age_s=11)
    assert waits.waiting_line(pgs, {}, {"CPU": 2.0}, NOW, limit_s=10, told=told) is None
    # ... but after repeat_s, and another request at once
    assert waits.waiting_line(pgs, {}, {"CPU": 2.0}, NOW + 400, limit_s=10, told=told, repeat_s=300)
    pgs.append(_pg("ffff", "PENDING", [{"GPU": 1.0, "CPU": 8.0}], age_s=30))
    assert "asks for {CPU: 8, GPU: 1}" in waits.waiting_line(pgs, {}, {"CPU": 2.0}, NOW, limit_s=10, told=told)


def test_a_group_waiting_less_than_the_limit_is_not_named():
    pgs = [_pg("aaaa", "PENDING", [{"CPU": 1.0}], age_s=9.9)]
    assert waits.waiting_line(pgs, {}, {"CPU": 2.0}, NOW, limit_s=10, told={}) is None


def test_only_the_groups_of_ended_jobs_that_still_hold_resources_are_left_behind():
    pgs = [_pg("a", "CREATED", [{"CPU": 1.0}], 60, job="02000000"),  # the killed driver's: left behind
           _pg("b", "CREATED", [{"CPU": 1.0}], 60, job="03000000"),  # a running job's
           _pg("c", "REMOVED", [{"CPU": 1.0}], 60, job="02000000"),  # already freed
           {**_pg("d", "CREATED", [{"CPU": 1.0}], 60, job="02000000"), "is_detached": True}]  # meant to outlive it
    assert [pg["placement_group_id"] for pg in waits.left_behind(pgs, {"01000000", "02000000"})] == ["a"]


def test_the_limit_is_the_stall_limit_but_at_most_half_the_start_timeout():
    assert waits.naming_limit_s(600, 20) == 10 and waits.naming_limit_s(10, 60) == 10


@pytest.mark.ray
@pytest.mark.slow  # Ray Train groups left waiting on purpose: the full tier
@pytest.mark.timeout(300)
def test_a_run_whose_group_cannot_start_names_who_holds_its_cpus_then_trains_when_they_are_freed(ray_local, tmp_path):
    """``raymcn train`` on a Ray where another group holds the CPUs its worker needs (a finished
    trial's group left behind, another user's run): the console names both within the limit, and
    the run starts once they are free."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from raymcn.cli import main

    holder = placement_group([{"CPU": 1.5}], name="another-runs-group")  # of the instance's 2 CPUs
    ray.get(holder.ready())
    args = ["train", "--config", "sweeps/smoke.yaml", "--num-workers", "1", "--set", "scale.cpus_per_worker=1",
            "--set", "scale.worker_start_timeout_s=4", "--set", f"run.storage_path={tmp_path}", "--set", "run.name=w",
            *[a for s in [*TINY, "schedule.epochs=1"] for a in ("--set", s)]]
    try:
        thread, out = in_background(main, args)
        log = tmp_path / "w" / "raymcn_console.log"
        line = wait_for("the console naming the wait", lambda: log.exists() and next(
            (x for x in log.read_text().splitlines() if x.startswith("WAITING for resources")), None), timeout=60)
    finally:
        remove_placement_group(holder)
    thread.join(timeout=240)
    assert not thread.is_alive() and out.get("value") == 0, out
    assert re.search(r"asks for \{CPU: 1\}, waiting \d+ s\. Free: CPU [\d.]+ of 2\.", line), line
    assert "another-runs-group (job " in line and "{CPU: 1.5}" in line, line


HOLDER = """
import ray, sys
ray.init(address=sys.argv[1], namespace="raymcn-waits-test")

@ray.remote(num_cpus=0)
class Holder:
    def hold(self):
        from ray.util.placement_group import placement_group
        self.pg = placement_group([{"CPU": 1.5}], name="left-behind")
        ray.get(self.pg.ready())

h = Holder.options(name="holder", lifetime="detached").remote()
ray.get(h.hold.remote())
"""


@pytest.mark.ray
@pytest.mark.slow  # Ray Train groups left waiting on purpose: the full tier
@pytest.mark.timeout(300)
def test_a_waiting_group_gets_what_an_ended_job_left_held(ray_local, tmp_path):
    """A job that ended while a group of its own still holds CPUs (made here by a detached actor of a
    driver that has exited, as a SIGKILLed sweep's driver left its trial's group on a cluster): once
    another group has waited the limit, the watch frees it, says so, and the waiting group is placed."""
    import subprocess
    import sys

    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    subprocess.run([sys.executable, str(script), ray_local.address_info["address"]], check=True, timeout=120)
    waiting = placement_group([{"CPU": 1.0}])  # of the instance's 2 CPUs, 1.5 held by the ended job
    lines: list[str] = []
    try:
        with waits.watched(1.0, lines.append, every_s=0.3):
            assert waiting.wait(timeout_seconds=60), lines
    finally:
        remove_placement_group(waiting)
        ray.kill(ray.get_actor("holder", namespace="raymcn-waits-test"))
    freed = [x for x in lines if x.startswith("FREED")]
    assert freed and "left-behind (job " in freed[0] and "{CPU: 1.5}" in freed[0], lines
