"""A checkpoint at once when a node of the run is drained before a planned reboot. No Ray.

``raymcn drain`` (``ray drain-node``, reason preemption, a deadline) marks a server's node as going
away. Ray Train tells the run; the ranks learn it only by asking (``ray.train.get_preemption_info``,
a barrier over the ranks, so every rank gets rank 0's answer and they decide alike). This module
decides when to ask, and turns the first yes into one checkpoint after the step in progress:
:class:`DrainAware` wraps the run's :class:`~raymcn.train.checkpoints.payload.CheckpointSchedule`,
so the mid-epoch checkpoint path writes it. Once Ray Train has registered that checkpoint, every
rank marks it in its machine's temp folder (:func:`mark_registered`), and ``raymcn drain`` reboots
the server as soon as every worker there has, not at the drain's deadline: the steps trained after
the checkpoint, run again after the restart, are a few seconds' worth instead of the deadline's.
Ray Train restarts the group from that checkpoint (``train/on_ray/preemption.py`` passes the
question in and sets Ray's failure policy). What asking costs, and hence the default of
``run.drain_check_every``: docs/faults.md.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from raymcn.config import drain_marks_dir
from raymcn.data.formats.files import write_text_atomic


class Schedule(Protocol):
    """What :class:`DrainAware` wraps (``payload.CheckpointSchedule``)."""

    def due(self, step: int) -> bool: ...

    def done(self) -> None: ...


class DrainAware:
    """A checkpoint schedule that is also due right after Ray reports a drain of one of the run's nodes.

    Every rank calls :meth:`due` after every step with the global steps completed; it asks
    ``ask`` on the steps that are multiples of ``every`` (the same steps on every rank: the
    question is a barrier) until the first answer that is not None, then not again in this attempt
    (a restarted group makes a new one). That answer makes this step's checkpoint due, unless the
    step ends an epoch (its epoch-end checkpoint follows anyway).

    Args:
        schedule: the run's own checkpoint schedule (``run.checkpoint_every``); a drain learnt at a
            step it checkpoints anyway adds no second checkpoint.
        every: steps between questions (``run.drain_check_every``); 0 = never ask.
        steps_per_epoch: the plan's.
        ask: () -> the drain's details or None (``ray.train.get_preemption_info``); None = never ask
            (no Ray Train, or Ray's preemption watcher is off).
        say: told once, when the drain is learnt.
    """

    def __init__(self, schedule: Schedule, every: int, steps_per_epoch: int,
                 ask: Callable[[], Any] | None, say: Callable[[str], None] | None = None):
        self.schedule, self.every, self.steps_per_epoch = schedule, every, steps_per_epoch
        self.ask, self.say = (ask if every > 0 else None), say
        self.drain: Any = None  # the first answer that was not None
        self.asked = 0  # questions asked in this attempt
        self.registered = False  # the checkpoint after the drain was registered (or given up on)

    def due(self, step: int) -> bool:
        """Whether to checkpoint now, ``step`` global steps having been completed."""
        drained = self.drained(step)  # first: every rank asks on the same steps, whatever the schedule says
        return self.schedule.due(step) or (drained and step % self.steps_per_epoch != 0)

    def drained(self, step: int) -> bool:
        """True at the step whose question first got a drain back; False before and after it."""
        if self.ask is None or self.drain is not None or step % self.every:
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
        self.schedule.done()


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
