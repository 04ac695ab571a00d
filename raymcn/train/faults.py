"""Fault injection for tests and the fault-tolerance table: ``RAYMCN_FAULT="kind=value[,kind=value]"``.

Kinds: ``raise_after_epoch=N`` (raise once epoch N is checkpointed), ``kill_at_step=S`` (SIGKILL
this worker process at global step S; rank ``RAYMCN_FAULT_RANK``, default 1), ``nan_at_step=S``
(make the loss of step S non-finite), ``hold_after_epoch=N`` (after epoch N and every later one is
reported, wait while the file ``RAYMCN_FAULT_DIR/hold`` exists: a test freezes a run between
epochs, e.g. until a node it added has joined), ``hold_at_step=S`` (the same, every rank, before
global step S: a test kills the whole machine at a known step), ``stall_data_at_step=S`` (rank
``RAYMCN_FAULT_RANK``'s batch of global step S never arrives: a reader that hangs) and
``stall_at_step=S`` (that rank never reaches step S's collectives, in every attempt: the others
wait in them, as with ranks that take different code paths). A fault fires once per run directory
(except ``stall_at_step``): a marker file in ``RAYMCN_FAULT_DIR`` stops a restarted worker from
failing again. Inert when the variable is unset.

``RAYMCN_TRACE=DIR`` (tests): every rank appends each step's loss terms and what its batch held to
``DIR/rank<r>.jsonl`` (``{"step": s, "total_loss": ..., "keys": [...], "inputs": {...}}``), so a test
compares the per-step data and losses of two runs.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path


class InjectedFault(RuntimeError):
    """Raised by ``raise_after_epoch``: stands in for a crash of the whole run."""


def _spec() -> dict[str, int]:
    text = os.environ.get("RAYMCN_FAULT", "")
    out = {}
    for part in filter(None, text.split(",")):
        kind, _, value = part.partition("=")
        out[kind.strip()] = int(value)
    return out


def _first_time(kind: str) -> bool:
    marker_dir = os.environ.get("RAYMCN_FAULT_DIR")
    if not marker_dir:
        return True
    marker = Path(marker_dir) / f"fired-{kind}"
    if marker.exists():
        return False
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    return True


def after_epoch(epoch: int) -> None:
    spec = _spec()
    if spec.get("raise_after_epoch") == epoch and _first_time("raise_after_epoch"):
        raise InjectedFault(f"injected fault after epoch {epoch} (RAYMCN_FAULT)")
    if "hold_after_epoch" in spec and epoch >= spec["hold_after_epoch"]:
        _hold()


def _hold() -> None:
    hold = Path(os.environ.get("RAYMCN_FAULT_DIR", ".")) / "hold"
    while hold.exists():
        time.sleep(0.2)


def _faulty_rank(rank: int) -> bool:
    return rank == int(os.environ.get("RAYMCN_FAULT_RANK", "1"))


def _forever() -> None:
    while True:  # until the process is ended (its watchdog, or Ray tearing the group down)
        time.sleep(1.0)


def at_step(step: int, rank: int) -> bool:
    """Called before each step; kills this process, stalls it, or returns True when the loss must be made NaN."""
    spec = _spec()
    if spec.get("hold_at_step") == step:
        _hold()
    if spec.get("kill_at_step") == step and _faulty_rank(rank) and _first_time("kill_at_step"):
        os.kill(os.getpid(), signal.SIGKILL)
    if spec.get("stall_at_step") == step and _faulty_rank(rank):
        _forever()
    return spec.get("nan_at_step") == step


def stalling(batches: Iterable, first_step: int, rank: int) -> Iterator:
    """``batches`` (global steps ``first_step``, ``first_step + 1``, ...), except that with
    ``stall_data_at_step=S`` the batch of step S never arrives on the faulty rank (once per run)."""
    stall = _spec().get("stall_data_at_step")
    if stall is None:
        return iter(batches)
    return _stalling(batches, first_step, rank, stall)


def _stalling(batches: Iterable, first_step: int, rank: int, stall: int) -> Iterator:
    for step, batch in enumerate(batches, start=first_step):
        if step == stall and _faulty_rank(rank) and _first_time("stall_data_at_step"):
            _forever()
        yield batch


def trace(step: int, rank: int, values: dict[str, float], batch: dict | None = None, world: int = 1) -> None:
    """Append step ``step``'s loss terms to ``$RAYMCN_TRACE/rank<rank>.jsonl`` (when set), with
    the number of ranks that ran it (``world``) and what the rank's batch held: its clips' video
    ids (``keys``) and the float64 sum of each input (``inputs``; sums add up over ranks, so a test
    compares a step's data across world sizes)."""
    where = os.environ.get("RAYMCN_TRACE")
    if where:
        row = {"step": step, "world": world, **values}
        if batch is not None:
            row["keys"] = list(batch["key"])
            row["inputs"] = {k: float(batch[k].double().sum()) for k in ("video", "audio", "text")}
        Path(where).mkdir(parents=True, exist_ok=True)
        with open(Path(where) / f"rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
