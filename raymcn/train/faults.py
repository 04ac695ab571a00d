"""Fault injection, for tests and the fault-tolerance table: hooks a rank installs into its run at
its start (:func:`install`), only for what its environment asks for.

``RAYMCN_FAULT="kind=value[,kind=value]"``. Kinds: ``raise_after_epoch=N`` (raise once epoch N is
checkpointed), ``kill_at_step=S`` (SIGKILL this worker process at global step S; rank
``RAYMCN_FAULT_RANK``, default 1), ``nan_at_step=S`` (make the loss of step S, and so its
gradients, non-finite),
``hold_after_epoch=N`` (after epoch N and every later one is reported, wait while the file
``RAYMCN_FAULT_DIR/hold`` exists: a test freezes a run between epochs, e.g. until a node it added
has joined), ``hold_at_step=S`` (the same, every rank, before global step S: a test kills the
whole machine at a known step), ``stall_data_at_step=S`` (rank ``RAYMCN_FAULT_RANK``'s batch of
global step S never arrives: a reader that hangs) and ``stall_at_step=S`` (that rank never reaches
step S's collectives, in every attempt: the others wait in them, as with ranks that take different
code paths), ``disk_full_at_epoch=N`` (the copy of epoch N's checkpoint into the run's storage
writes half of its ``state.pt`` and then fails as a full disk does, ``ENOSPC``, where the real copy
writes: ``checkpoints/persist.py``). A fault fires once per run directory (except
``stall_at_step``): a marker file in ``RAYMCN_FAULT_DIR`` stops a restarted or resumed worker from
failing again.

The variables are read once, at the rank's start (``raymcn.environment``); a run started without
them carries none of these hooks, and its step neither reads a variable nor checks for a fault.
(The tests' step trace and the benchmarks' timeline are installed alike: ``probes.py``.)
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raymcn.data.formats.batch import Batch
from raymcn.environment import Environment
from raymcn.train.checkpoints import persist
from raymcn.train.checkpoints.payload import META_FILE, STATE_FILE
from raymcn.train.run import Run

AT_STEP = ("hold_at_step", "kill_at_step", "stall_at_step")
AFTER_EPOCH = ("raise_after_epoch", "hold_after_epoch")


class InjectedFault(RuntimeError):
    """Raised by ``raise_after_epoch``: stands in for a crash of the whole run."""


def install(run: Run, env: Environment) -> None:
    """The faults ``env`` asks for, into ``run`` (nothing when it asks for none), where each
    strikes: before a step, after its backward, after an epoch, in the batches."""
    faults = Faults.of(env)
    if any(kind in faults.kinds for kind in AT_STEP):
        run.hooks.before_step.append(faults.at_step)
    if "nan_at_step" in faults.kinds:
        run.hooks.after_backward.append(faults.poison)
    if any(kind in faults.kinds for kind in AFTER_EPOCH):
        run.hooks.after_epoch.append(faults.after_epoch)
    if "stall_data_at_step" in faults.kinds and run.hooks.batches is not None:
        run.hooks.batches = faults.stalling(run.hooks.batches)
    if "disk_full_at_epoch" in faults.kinds:
        run.hooks.copy_checkpoint = faults.filling(run.hooks.copy_checkpoint or persist.copy_files)


def parse(text: str) -> dict[str, int]:
    """``"kind=value[,kind=value]"`` -> {kind: value}."""
    out = {}
    for part in filter(None, text.split(",")):
        kind, _, value = part.partition("=")
        out[kind.strip()] = int(value)
    return out


@dataclass(frozen=True)
class Faults:
    """The faults of ``RAYMCN_FAULT`` (:func:`parse`), where their markers go and which rank the
    rank-specific ones hit; its methods are the hooks :func:`install` adds."""

    kinds: dict[str, int]
    marker_dir: str = ""  # "" = no markers: a fault fires every time its moment comes
    rank: int = 1

    @classmethod
    def of(cls, env: Environment) -> Faults:
        return cls(parse(env.fault), env.fault_dir, int(env.fault_rank or 1))

    def at_step(self, run: Run) -> None:
        """Before each step: hold every rank, kill or stall the faulty rank."""
        step, rank = run.state.step, run.comm.rank
        if self.kinds.get("hold_at_step") == step:
            self._hold()
        if self.kinds.get("kill_at_step") == step and rank == self.rank and self._first_time("kill_at_step"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kinds.get("stall_at_step") == step and rank == self.rank:
            _forever()

    def poison(self, run: Run, terms: dict) -> None:
        """After a step's backward: step ``nan_at_step``'s loss and gradients non-finite, as a
        non-finite loss's backward leaves them."""
        if run.state.step == self.kinds["nan_at_step"]:
            terms["total_loss"] = terms["total_loss"] * float("nan")
            for p in run.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(float("nan"))

    def after_epoch(self, run: Run, metrics: dict[str, float]) -> None:
        epoch = run.state.epoch
        if self.kinds.get("raise_after_epoch") == epoch and self._first_time("raise_after_epoch"):
            raise InjectedFault(f"injected fault after epoch {epoch} (RAYMCN_FAULT)")
        if "hold_after_epoch" in self.kinds and epoch >= self.kinds["hold_after_epoch"]:
            self._hold()

    def stalling(self, batches: Callable[[Run, int, int], tuple[Iterable[Batch], Any]]):
        """``batches`` (the run's hook), except that the faulty rank's batch of global step
        ``stall_data_at_step`` never arrives (once per run)."""
        def stalled(run: Run, epoch: int, start: int) -> tuple[Iterator, Any]:
            rows, stats = batches(run, epoch, start)
            if run.comm.rank != self.rank:
                return rows, stats
            return self._stall_in(rows, epoch * run.plan.steps_per_epoch + start), stats

        return stalled

    def filling(self, copy: persist.Copy) -> persist.Copy:
        """``copy`` (a checkpoint's copy into the storage), except that epoch ``disk_full_at_epoch``'s
        end checkpoint (its ``loop.json``: that epoch done, no step of the next) gets half of its
        ``state.pt`` written and then ``OSError(ENOSPC)``, once per run."""
        def until_full(source: str, fs, target: str) -> None:
            with open(os.path.join(source, META_FILE)) as f:
                loop = json.load(f)
            if (loop["epoch"] != self.kinds["disk_full_at_epoch"] or loop.get("progress", {}).get("steps")
                    or not self._first_time("disk_full_at_epoch")):
                return copy(source, fs, target)
            fs.create_dir(target)
            with open(os.path.join(source, STATE_FILE), "rb") as f, \
                    fs.open_output_stream(posixpath.join(target, STATE_FILE)) as out:
                out.write(f.read(os.path.getsize(os.path.join(source, STATE_FILE)) // 2))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        return until_full

    def _stall_in(self, batches: Iterable[Batch], first_step: int) -> Iterator[Batch]:
        for step, batch in enumerate(batches, start=first_step):
            if step == self.kinds["stall_data_at_step"] and self._first_time("stall_data_at_step"):
                _forever()
            yield batch

    def _first_time(self, kind: str) -> bool:
        if not self.marker_dir:
            return True
        marker = Path(self.marker_dir) / f"fired-{kind}"
        if marker.exists():
            return False
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        return True

    def _hold(self) -> None:
        hold = Path(self.marker_dir or ".") / "hold"
        while hold.exists():
            time.sleep(0.2)


def _forever() -> None:
    while True:  # until the process is ended (its watchdog, or Ray tearing the group down)
        time.sleep(1.0)
