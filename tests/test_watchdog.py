"""The stall watchdog without Ray: when it fires, what it says and records, when a stall is permanent,
how the loop reports its phases, and what the quiet console shows of Ray's warnings and the alerts.

(On Ray Train workers, an injected data stall and a collective one rank never joins: tests/test_stall.py.)
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from raymcn.train.monitor import watchdog
from raymcn.train.monitor.console import ALERT_TAG, PROGRESS_TAG, TAG, _for_terminal
from raymcn.train.monitor.watchdog import StallError, Watchdog


def fired_dog(tmp_path, timeout_s=0.3, **kw):
    lines, ended = [], threading.Event()
    dog = Watchdog(timeout_s, rank=1, run_dir=str(tmp_path), say=lines.append, end=ended.set, poll_s=0.02, **kw)
    return dog, lines, ended


def test_a_rank_without_progress_is_named_recorded_and_its_attempt_ended(tmp_path):
    dog, lines, ended = fired_dog(tmp_path)
    dog.start()
    dog.at("data", 7)
    assert ended.wait(5), "the watchdog never fired"
    dog.stop()
    assert len(lines) == 1
    assert "rank 1 made no progress for" in lines[0] and "at global step 7" in lines[0]
    assert watchdog.PHASES["data"] in lines[0] and "restarts from the latest checkpoint" in lines[0]
    (stall,) = watchdog.recorded(str(tmp_path))
    assert (stall.rank, stall.step, stall.phase) == (1, 7, "data") and stall.idle_s >= 0.3


def test_progress_keeps_it_quiet_and_the_limit_follows_the_longest_phase(tmp_path):
    dog, lines, ended = fired_dog(tmp_path, timeout_s=1.0)
    dog.start()
    for step in range(20):  # phases of ~0.01 s: far from 1 s without a phase change
        dog.at("data", step)
        time.sleep(0.01)
        dog.at("step", step)
        time.sleep(0.01)
    dog.stop()
    assert not ended.is_set() and not lines
    assert dog.limit("data") == max(1.0, watchdog.STEP_FACTOR * dog.longest)
    assert 0 < dog.longest < 1.0  # the steps' time, not the data waits'
    dog.at("data", 20)
    time.sleep(0.05)
    before = dog.longest
    dog.at("step", 20)  # a data wait ends: the measured step time is unchanged
    assert dog.longest == before
    dog.longest = 2.0
    assert dog.limit("data") == watchdog.STEP_FACTOR * 2.0  # a slow phase raises the limit above the floor
    dog.longest = 0.01
    assert dog.limit("data") == 1.0  # never below the floor
    # a rank in any other phase may be waiting in a collective for the rank that waits for its data:
    # it waits longer than that rank's watchdog takes to look, so the data-waiting rank is named
    for phase in ("step", "checkpoint", "evaluation", "report"):
        assert dog.limit(phase) == 1.0 + dog.grace_s and dog.grace_s > dog.poll_s


def test_a_collective_timeout_becomes_an_error_naming_the_step(tmp_path):
    dog, lines, _ = fired_dog(tmp_path, timeout_s=60)
    dog.at("step", 12)
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                        "60000ms for recv operation to complete")
    named = dog.named(gloo)
    assert isinstance(named, StallError)
    assert "rank 1" in str(named) and "global step 12" in str(named) and "Timed out waiting" in str(named)
    assert watchdog.PHASES["step"] in str(named) and lines == [f"STALL: {named}"]
    assert [s.step for s in watchdog.recorded(str(tmp_path))] == [12]
    other = ValueError("bad shape")
    assert dog.named(other) is other  # any other error passes unchanged, unrecorded
    assert len(watchdog.recorded(str(tmp_path))) == 1


def test_the_same_stall_in_two_attempts_is_permanent_and_a_new_run_forgets(tmp_path):
    run = str(tmp_path)
    first = Watchdog(60, 0, run, say=lambda _: None)
    first.record(watchdog.Stall(0, 9, "step", 61.0, first.attempt))
    first.record(watchdog.Stall(1, 9, "data", 61.0, first.attempt))  # the other rank of the same attempt
    first.record(watchdog.Stall(1, 9, "step", 62.0, first.attempt))  # both ranks in the step: one stall
    assert watchdog.repeated_stall(run) is None
    other_step = Watchdog(60, 0, run, say=lambda _: None)
    other_step.record(watchdog.Stall(0, 10, "step", 61.0, other_step.attempt))
    assert watchdog.repeated_stall(run) is None  # progress between the stalls: a restart helped
    again = Watchdog(60, 1, run, say=lambda _: None)
    again.record(watchdog.Stall(1, 9, "step", 60.5, again.attempt))
    message = watchdog.repeated_stall(run)
    assert message and "global step 9" in message and "not retried" in message
    watchdog.clear(run)
    assert watchdog.recorded(run) == [] and watchdog.repeated_stall(run) is None
    watchdog.clear(run)  # nothing to clear: no error


def test_a_stall_in_a_groups_start_is_named_but_never_permanent(tmp_path):
    """A rank stopped while its group starts (its peers wait in DDP's first broadcast) is named like
    any stall; two such starts do not end the run: a later group may start elsewhere."""
    run = str(tmp_path)
    for attempt in ("10.0.0.1:29500", "10.0.0.1:29501"):
        dog = Watchdog(10, 0, run, say=lambda _: None, attempt=attempt)
        dog.record(watchdog.Stall(0, 0, "start", 13.0, dog.attempt))
    assert len(watchdog.recorded(run)) == 2 and watchdog.repeated_stall(run) is None
    assert watchdog.recorded(run)[0].text() == ("rank 0 made no progress for 13 s in the worker group's start "
                                                "(its inputs, the model, DDP's first broadcast, the checkpoint)")


def test_every_rank_of_a_group_knows_its_attempt_before_any_collective(monkeypatch):
    """The attempt's id is the group's rendezvous address (set on every worker by Ray Train):
    equal on every rank, so their records of one stall are one stall."""
    from raymcn.train.on_ray.worker import group_attempt

    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    first = group_attempt()
    assert group_attempt() == first and re.fullmatch(r"[0-9a-f]{12}", first)  # a file name's characters
    monkeypatch.setenv("MASTER_PORT", "29501")  # the next group Ray Train starts
    assert group_attempt() != first
    monkeypatch.delenv("MASTER_PORT")
    assert group_attempt() != group_attempt()  # one process, no rendezvous: a fresh id each time


def test_the_loop_reports_each_phase_with_its_step():
    from conftest import config, linear_mcn, objective_for, run_of
    from test_gradcache import BASE, _linear_batch

    from raymcn.cli import preset_path
    from raymcn.config import load_config
    from raymcn.train.loop import train_one_epoch
    from raymcn.train.run import Hooks, LoopState

    cfg = config(BASE, **{"optim.warmup_steps": 0})
    seen: list[tuple[str, int]] = []
    hooks = Hooks(after_step=[lambda run, values, batch: None], watch=lambda phase, step: seen.append((phase, step)))
    run = run_of(cfg, linear_mcn(12, 32), objective=objective_for(cfg), state=LoopState(step=5), hooks=hooks)
    train_one_epoch(run, [_linear_batch(cfg, s) for s in range(2)])
    assert seen == [("data", 5), ("step", 5), ("checkpoint", 6), ("data", 6), ("step", 6), ("checkpoint", 7),
                    ("data", 7)]
    assert load_config(preset_path()).run.stall_timeout_s >= 60  # the default is never a hair trigger


@pytest.mark.parametrize("line, shown", [
    ("\x1b[36m(SplitCoordinator pid=4242)\x1b[0m 2026-11-25 01:51:48,354\tWARNING resource_manager.py:819 -- "
     "Cluster resources are not enough to run any task. The job may hang forever unless the cluster scales up.\n",
     "Ray WARNING: Cluster resources are not enough to run any task. The job may hang forever unless the cluster "
     "scales up."),
    ("2026-11-25 01:51:48,354\tERROR worker.py:12 -- a worker died\n", "Ray ERROR: a worker died"),
    ("2026-11-25 01:51:48,354\tINFO worker.py:1841 -- Connecting to existing Ray cluster\n", None),
    (f"(RayTrainWorker pid=1) {ALERT_TAG}STALL: rank 1 made no progress\n", "STALL: rank 1 made no progress"),
    (f"(RayTrainWorker pid=1) {PROGRESS_TAG}epoch 1 step 3/4\n", "epoch 1 step 3/4"),
    (f"(RayTrainWorker pid=1) {TAG}an epoch line\n", None),  # tagged lines: only where shown (raymcn train)
    ("[rank0]:[W1125 reducer.cpp:1529] Warning: find_unused_parameters=True was specified\n", None),  # torch's
])
def test_the_quiet_console_shows_alerts_and_rays_warnings(line, shown):
    assert _for_terminal(line, show_tagged=False) == shown


def test_tagged_lines_show_in_train_runs():
    assert _for_terminal(f"(RayTrainWorker pid=1) {TAG}an epoch line\n", show_tagged=True) == "an epoch line"


@pytest.mark.parametrize("longest", [0.0, 0.05, 0.2, 1.0, 100.0])
def test_every_limit_stays_short_of_the_process_groups_timeout(longest):
    """The watchdogs act before a collective times out (on NCCL a timeout would otherwise be the
    communicators' abort, naming the ranks that wait instead of the one that holds them up), and
    the rank waiting for its data is still named first."""
    dog = Watchdog(1.0, rank=0, run_dir=None, say=lambda _: None, poll_s=0.02, collective_s=2.5)
    dog.longest = longest
    for phase in watchdog.PHASES:
        assert 1.0 <= dog.limit(phase) and dog.limit(phase) + dog.poll_s < 2.5, (phase, dog.limit(phase))
        if phase != "data":
            assert dog.limit(phase) == dog.limit("data") + dog.grace_s
    uncapped = Watchdog(1.0, rank=0, run_dir=None, say=lambda _: None, poll_s=0.02)
    uncapped.longest = longest
    assert dog.limit("data") == min(uncapped.limit("data"), 2.5 - dog.grace_s - 2 * dog.poll_s)


@pytest.mark.parametrize("stall_s", [10, 11, 25, 49, 50, 60, 600, 3600])
def test_the_configs_least_collective_timeout_leaves_the_watchdog_time_to_act(stall_s):
    """At the least process group timeout the config allows (1.5 x run.stall_timeout_s, which is
    at least 10 s), a watchdog with its own look interval still fires (its limit, plus one look)
    before the collective times out, and never below run.stall_timeout_s."""
    from raymcn.config import COLLECTIVE_TIMEOUT_MIN_FACTOR

    collective = COLLECTIVE_TIMEOUT_MIN_FACTOR * stall_s
    dog = Watchdog(stall_s, rank=0, run_dir=None, say=lambda _: None, collective_s=collective)
    dog.longest = 10.0 * stall_s  # a step far slower than the floor: the cap decides
    assert dog.limit("data") >= stall_s
    assert max(dog.limit(p) for p in watchdog.PHASES) + dog.poll_s <= collective


NCCL_TIMEOUT = ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=412, OpType=ALLREDUCE, "
                "NumelIn=1, NumelOut=1, Timeout(ms)=1200000) ran for 1200010 milliseconds before timing out.")


@pytest.mark.parametrize("message", [
    NCCL_TIMEOUT,  # what NCCL's watchdog sets on the timed-out work
    # the rank's next NCCL call once the communicators were aborted (error handling 2): the failure reason
    f"NCCL error in: ProcessGroupNCCL.cpp:3356, invalid usage, NCCL version 2.27.3\n{NCCL_TIMEOUT}",
])
def test_an_nccl_timeout_reaching_python_is_named_as_a_stall(tmp_path, message):
    dog, _, _ = fired_dog(tmp_path, timeout_s=60)
    dog.at("step", 31)
    named = dog.named(RuntimeError(message))
    assert isinstance(named, StallError) and "rank 1" in str(named) and "global step 31" in str(named)
    assert [(s.step, s.phase) for s in watchdog.recorded(str(tmp_path))] == [(31, "step")]


def test_workers_abort_nccl_on_a_timeout_instead_of_ending_unnamed(monkeypatch, tmp_path):
    """The workers' environment sets PyTorch's NCCL error handling to 2 (Ray Train would set 1:
    the process ends with no Python error to name), unless the driver's environment chose one; the
    process group's timeout is ``run.collective_timeout_s``."""
    from raymcn.cli import preset_path
    from raymcn.config import load_config
    from raymcn.train.on_ray.launch import build_trainer
    from raymcn.train.run_plan import make_plan

    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    cfg = load_config(preset_path(), ["run.stall_timeout_s=100"])
    trainer = build_trainer(cfg, make_plan(cfg, 256), str(tmp_path / "run"))
    assert trainer.run_config.worker_runtime_env["env_vars"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert trainer.backend_config.timeout_s == 200  # the default: 2 x run.stall_timeout_s
    cfg = load_config(preset_path(), ["run.stall_timeout_s=100", "run.collective_timeout_s=150"])
    assert build_trainer(cfg, make_plan(cfg, 256), str(tmp_path / "run")).backend_config.timeout_s == 150
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    trainer = build_trainer(cfg, make_plan(cfg, 256), str(tmp_path / "run"))
    assert trainer.run_config.worker_runtime_env["env_vars"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_the_workers_get_the_settings_they_are_handed_not_the_drivers_variables(tmp_path, monkeypatch):
    """The RAYMCN_* settings reach the workers as the driver's entry read and passed them
    (``Environment``), through the runtime environment; building the trainer reads none itself."""
    from raymcn.cli import preset_path
    from raymcn.config import load_config
    from raymcn.environment import Environment
    from raymcn.train.on_ray.launch import build_trainer
    from raymcn.train.run_plan import make_plan

    monkeypatch.setenv("RAYMCN_FAULT", "kill_at_step=3")  # set after the entry read: not handed on
    cfg = load_config(preset_path(), [])
    env = Environment(fault="nan_at_step=1", trace=str(tmp_path / "trace"))
    handed = build_trainer(cfg, make_plan(cfg, 256), str(tmp_path / "run"), env=env).run_config.worker_runtime_env
    assert {k: v for k, v in handed["env_vars"].items() if k.startswith("RAYMCN_")} == {
        "RAYMCN_FAULT": "nan_at_step=1", "RAYMCN_TRACE": str(tmp_path / "trace")}
    assert Environment.read(handed["env_vars"]) == env  # what a worker reads at its start


def test_the_config_keeps_the_collective_timeout_behind_the_watchdogs():
    from raymcn.cli import preset_path
    from raymcn.config import ConfigError, load_config

    assert load_config(preset_path(), ["run.stall_timeout_s=100"]).run.collective_timeout == 200
    assert load_config(preset_path(), ["run.stall_timeout_s=100", "run.collective_timeout_s=150"]).run.collective_timeout == 150
    with pytest.raises(ConfigError, match=r"run.collective_timeout_s=149 is shorter than 1.5 x run.stall_timeout_s=100"):
        load_config(preset_path(), ["run.stall_timeout_s=100", "run.collective_timeout_s=149"])
