"""When a run checkpoints inside an epoch: every ``run.checkpoint_every`` (a step count or a
duration), and at once after a node of the run is drained before a planned reboot. No Ray: the
loop asks :meth:`CheckpointPolicy.due` after every step; the Ray worker hands in the drain question
and saves the checkpoint (``on_ray/worker.py``). Epoch ends always checkpoint (``loop.run_epochs``).

``raymcn drain`` (``ray drain-node``, reason preemption, a deadline) marks a server's node as going
away. Ray Train tells the run; the ranks learn it only by asking (``ray.train.get_preemption_info``,
a barrier over the ranks, so every rank gets rank 0's answer and they decide alike). The policy
decides when to ask, and turns the first yes into one checkpoint after the step in progress. Once
Ray Train has registered that checkpoint, every rank marks it in its machine's temp folder
(:func:`mark_registered`), and ``raymcn drain`` reboots the server as soon as every worker there
has, not at the drain's deadline: the steps trained after the checkpoint, run again after the
restart, are a few seconds' worth instead of the deadline's. Ray Train restarts the group from that
checkpoint (``train/on_ray/preemption.py`` passes the question in and sets Ray's failure policy).
What asking costs, and hence the default of ``run.drain_check_every``: docs/faults.md.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raymcn.config import drain_marks_dir, parse_interval
from raymcn.data.formats.files import write_text_atomic


class CheckpointPolicy:
    """Whether to checkpoint after a step, asked by every rank after every step.

    A step count checkpoints after every global step that is a multiple of it. A duration
    checkpoints once that long has passed since the last checkpoint (or the start): every rank must
    take the same decision (``ray.train.report`` is a barrier), so rank 0's clock decides and is
    broadcast, at most every ``check_every`` steps (the checkpoint lands at most that many steps
    late). A drain: the policy asks ``ask`` on the steps that are multiples of ``drain_every`` (the
    same steps on every rank: the question is a barrier) until the first answer that is not None,
    then not again in this attempt (a restarted group makes a new policy); that answer makes this
    step's checkpoint due. Never at an epoch's last step: the epoch-end checkpoint follows it.

    Args:
        every: ``run.checkpoint_every``'s text; steps_per_epoch: the plan's.
        check_every: steps between a duration's checks (``run.log_every``).
        broadcast: rank 0's value to every rank (``Collectives.broadcast_from_rank0`` of a float);
            None in one process.
        drain_every: steps between drain questions (``run.drain_check_every``); 0 = never ask.
        ask: () -> the drain's details or None (``ray.train.get_preemption_info``); None = never
            ask (no Ray Train, or Ray's preemption watcher is off).
        say: told once, when the drain is learnt.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, every: str, steps_per_epoch: int, *, check_every: int = 10,
                 broadcast: Callable[[float], float] | None = None, drain_every: int = 0,
                 ask: Callable[[], Any] | None = None, say: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.kind, self.amount = parse_interval(every) or ("never", 0.0)
        self.steps_per_epoch, self.check_every = steps_per_epoch, max(1, check_every)
        self._broadcast, self._clock = broadcast, clock
        self.last = clock()
        self.drain_every, self.ask, self.say = drain_every, (ask if drain_every > 0 else None), say
        self.drain: Any = None  # the first answer that was not None
        self.asked = 0  # questions asked in this attempt
        self.registered = False  # the checkpoint after the drain was registered (or given up on)

    def due(self, step: int) -> bool:
        """Whether to checkpoint now, ``step`` global steps having been completed."""
        drained = self.drained(step)  # first: every rank asks on the same steps, whatever the schedule says
        return self.scheduled(step) or (drained and step % self.steps_per_epoch != 0)

    def scheduled(self, step: int) -> bool:
        """Whether ``run.checkpoint_every`` makes a checkpoint due now (a duration's check is a
        collective on the steps it checks)."""
        if self.kind == "never" or step % self.steps_per_epoch == 0:
            return False
        if self.kind == "steps":
            return step % int(self.amount) == 0
        if step % self.check_every:
            return False
        late = float(self._clock() - self.last >= self.amount)
        return bool(self._broadcast(late) if self._broadcast is not None else late)

    def drained(self, step: int) -> bool:
        """True at the step whose question first got a drain back; False before and after it."""
        if self.ask is None or self.drain is not None or step % self.drain_every:
            return False
        self.asked += 1
        answer = self.ask()
        if answer is None:
            return False
        self.drain = answer
        if self.say is not None:
            self.say(f"a node of this run is being drained ({describe(answer)}): checkpoint after global step {step}, "
                     "then training goes on until the node leaves (`raymcn drain` lets it go once the checkpoint "
                     "is registered) and Ray Train restarts the group from it")
        return True

    @property
    def pending(self) -> bool:
        """A drain was learnt and its checkpoint not yet registered: the next checkpoint is the
        drain's (the same on every rank, as the answer is)."""
        return self.drain is not None and not self.registered

    def done(self) -> None:
        """A checkpoint was just taken (mid-epoch or at an epoch end): the duration restarts."""
        self.last = self._clock()


def mark_registered(step: int, rank: int, folder: Path | None = None, pid: int | None = None) -> Path:
    """Mark, for ``raymcn drain`` on this machine, that this worker process's drain checkpoint (after
    global step ``step``) is registered: ``<folder>/<pid>``, JSON ``{"step", "rank", "time"}``, written
    whole (a reader never sees half a file)."""
    folder = drain_marks_dir() if folder is None else folder
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / str(os.getpid() if pid is None else pid)
    write_text_atomic(path, json.dumps({"step": step, "rank": rank, "time": time.time()}))
    return path


def describe(info: Any) -> str:
    """``ranks [1], deadline in 58 s`` from Ray's ``PreemptionInfo`` (any object
    with ``preempted_ranks`` and ``deadline_ms``; what it lacks is left out)."""
    parts = []
    ranks = getattr(info, "preempted_ranks", None)
    if ranks is not None:
        parts.append(f"ranks {list(ranks)}")
    deadline_ms = getattr(info, "deadline_ms", None)
    if deadline_ms:
        parts.append(f"deadline in {max(0.0, deadline_ms / 1000 - time.time()):.0f} s")
    return ", ".join(parts) or "no details"
