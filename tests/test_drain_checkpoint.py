"""When the ranks ask whether a node of the run is drained, and what the first yes does
(``raymcn/train/checkpoints/policy.py``), without Ray: the question is a stand-in that counts its calls.
The drain on a real multi-node cluster: tests/test_multinode.py."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from raymcn.cli import preset_path
from raymcn.config import ConfigError, load_config
from raymcn.train.checkpoints.policy import CheckpointPolicy, describe

DRAIN = SimpleNamespace(preempted_ranks=[1], deadline_ms=None)


class Ask:
    """A stand-in for ``ray.train.get_preemption_info``: None until ``yes_from`` questions were asked."""

    def __init__(self, yes_from: int | None = None):
        self.calls, self.yes_from = 0, yes_from

    def __call__(self):
        self.calls += 1
        return DRAIN if self.yes_from is not None and self.calls >= self.yes_from else None


def run(watch: CheckpointPolicy, steps: int) -> list[int]:
    """The global steps after which ``watch`` made a checkpoint due (steps 1..steps, as the loop calls it)."""
    return [s for s in range(1, steps + 1) if watch.due(s)]


def test_it_asks_on_every_nth_step_only_and_a_no_checkpoints_nothing():
    ask = Ask()
    watch = CheckpointPolicy("0", 100, drain_every=10, ask=ask)
    assert run(watch, 95) == []
    assert ask.calls == watch.asked == 9  # steps 10, 20, ..., 90: the same steps on every rank (a barrier)


def test_the_first_yes_checkpoints_after_that_step_and_then_it_stops_asking():
    said = []
    ask = Ask(yes_from=3)  # the drain is seen at the third question: after step 6
    watch = CheckpointPolicy("0", 100, drain_every=2, ask=ask, say=said.append)
    assert run(watch, 40) == [6]
    assert ask.calls == 3 and watch.drain is DRAIN  # no barrier after the answer, for the rest of the attempt
    assert len(said) == 1 and "after global step 6" in said[0] and "ranks [1]" in said[0]


def test_the_run_s_own_checkpoints_go_on_beside_it():
    ask = Ask(yes_from=2)
    watch = CheckpointPolicy("3", 4, drain_every=1, ask=ask)
    # every 3rd step (not at the epoch ends 4, 8, 12: those checkpoint anyway), plus step 2 (the drain)
    assert run(watch, 12) == [2, 3, 6, 9]


def test_a_drain_learnt_when_a_checkpoint_is_due_anyway_adds_none():
    ask = Ask(yes_from=3)
    watch = CheckpointPolicy("3", 100, drain_every=1, ask=ask)
    assert run(watch, 7) == [3, 6]  # the yes at step 3 is that step's checkpoint; none at 4
    assert ask.calls == 3


def test_a_drain_learnt_at_an_epoch_end_leaves_it_to_the_epoch_end_checkpoint():
    ask = Ask(yes_from=2)
    watch = CheckpointPolicy("0", 4, drain_every=4, ask=ask)
    assert run(watch, 12) == [] and ask.calls == 2 and watch.drain is DRAIN
    assert watch.pending  # the epoch-end checkpoint that follows is the drain's


def test_the_checkpoint_after_a_drain_is_pending_until_registered():
    """``pending``: the next checkpoint is the drain's (the worker then waits for Ray Train to
    register it and marks it for ``raymcn drain``); once registered, never again in this attempt."""
    watch = CheckpointPolicy("0", 100, drain_every=2, ask=Ask(yes_from=2))
    assert not watch.due(2) and not watch.pending
    assert watch.due(4) and watch.pending
    watch.registered = True
    assert not watch.pending and not any(watch.due(s) for s in range(5, 40))


def test_a_mark_names_the_step_and_rank_and_is_written_whole(tmp_path):
    from raymcn.config import DRAIN_MARKS_DIR, drain_marks_dir
    from raymcn.train.checkpoints.policy import mark_registered

    before = time.time()
    path = mark_registered(8, 1, tmp_path / "marks", pid=4242)
    mark = json.loads(path.read_text())
    assert path == tmp_path / "marks" / "4242" and mark["step"] == 8 and mark["rank"] == 1 and mark["time"] >= before
    assert [p.name for p in (tmp_path / "marks").iterdir()] == ["4242"]  # no part file left
    assert drain_marks_dir().name == DRAIN_MARKS_DIR and drain_marks_dir().parent.is_dir()


@pytest.mark.parametrize("every, ask", [(0, Ask(yes_from=1)), (5, None)])
def test_never_asked_when_off_or_when_there_is_no_one_to_ask(every, ask):
    watch = CheckpointPolicy("0", 10, drain_every=every, ask=ask)
    assert run(watch, 30) == [] and watch.asked == 0
    assert ask is None or ask.calls == 0


def test_done_restarts_the_wrapped_schedule_s_clock():
    clock = iter([0.0, 50.0]).__next__
    inner = CheckpointPolicy("60s", 100, drain_every=1, ask=None, clock=clock)
    inner.done()
    assert inner.last == 50.0


def test_the_drain_is_described_by_its_ranks_and_deadline():
    soon = SimpleNamespace(preempted_ranks=[2, 3], deadline_ms=(time.time() + 60) * 1000)
    assert describe(soon).startswith("ranks [2, 3], deadline in ") and describe(soon).endswith(" s")
    assert describe(object()) == "no details"


def test_the_settings_and_their_bounds():
    cfg = load_config(preset_path())
    assert cfg.run.drain_check_every >= 1 and cfg.scale.max_preemption_failures == -1
    with pytest.raises(ConfigError, match="drain_check_every"):
        load_config(preset_path(), ["run.drain_check_every=-1"])
    with pytest.raises(ConfigError, match="max_preemption_failures"):
        load_config(preset_path(), ["scale.max_preemption_failures=-2"])


def test_ray_s_failure_policy_counts_a_drain_apart(monkeypatch):
    """The FailureConfig the trainer is built with, and the watcher switch the ranks read as the
    controller does (no Ray instance is started)."""
    from raymcn.train.on_ray import preemption

    cfg = load_config(preset_path(), ["scale.max_failures=0", "scale.max_preemption_failures=4"])
    fc = preemption.failure_config(cfg)
    assert (fc.max_failures, fc.max_preemption_failures) == (0, 4)
    monkeypatch.delenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", raising=False)
    assert preemption.watcher_on()  # Ray's default: a cluster's runs ask
    monkeypatch.setenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")  # raymcn's local instances
    assert not preemption.watcher_on()
    # the switch read as Ray Train's controller reads it (its name and default live in a private module)
    from ray._common.utils import env_bool
    from ray.train.v2._internal.constants import DEFAULT_ENABLE_PREEMPTION_WATCHER, ENABLE_PREEMPTION_WATCHER_ENV_VAR

    assert ENABLE_PREEMPTION_WATCHER_ENV_VAR == preemption.WATCHER_VARIABLE
    for value in ("0", "1", "true", "True", "false", "yes", ""):
        monkeypatch.setenv(preemption.WATCHER_VARIABLE, value)
        assert preemption.watcher_on() == env_bool(preemption.WATCHER_VARIABLE, DEFAULT_ENABLE_PREEMPTION_WATCHER), value
    assert CheckpointPolicy("0", 4, drain_every=cfg.run.drain_check_every, ask=preemption.drain_question()).ask is None
