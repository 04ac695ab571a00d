"""Probes for the tests and the benchmarks, installed into a rank's run at its start
(:func:`install`) only when its environment asks for them, as the faults are (``faults.py``): a run
started without them carries none of these hooks, and its step checks for none. No Ray.

``RAYMCN_TRACE=DIR`` (tests): every rank appends each step's loss terms and what its batch held to
``DIR/rank<r>.jsonl`` (``{"step": s, "total_loss": ..., "keys": [...], "inputs": {...}}``), so a test
compares the per-step data and losses of two runs.

``RAYMCN_TIMELINE=FILE`` (benchmarks): a rank's events on the timeline of a run's fixed costs
(``monitor/timeline.py``): its start (:func:`rank_started`), its run assembled, each epoch's steps
started and done, each epoch's first step, and its last epoch's end.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from raymcn.data.formats.batch import Batch
from raymcn.environment import Environment
from raymcn.train.monitor import timeline
from raymcn.train.run import Run


def install(run: Run, env: Environment) -> None:
    """The probes ``env`` asks for, into ``run`` (nothing when it asks for none): the trace first
    among the run's ``after_step`` hooks, the timeline's marks last among its hooks."""
    if env.trace:
        run.hooks.after_step.insert(0, Trace(Path(env.trace)))
    if env.timeline:
        Timeline(run.comm.rank).install(run)


@dataclass(frozen=True)
class Trace:
    """An ``after_step`` hook: step s's loss terms to ``where/rank<rank>.jsonl``, with the number of
    ranks that ran it (``world``) and what the rank's batch held: its clips' video ids (``keys``)
    and the float64 sum of each input (``inputs``; sums add up over ranks, so a test compares a
    step's data across world sizes)."""

    where: Path

    def __call__(self, run: Run, values: dict[str, float], batch: Batch) -> None:
        row = {"step": run.state.step - 1, "world": run.comm.world, **values, "keys": list(batch["key"]),
               "inputs": {k: float(batch[k].double().sum()) for k in ("video", "audio", "text")}}
        self.where.mkdir(parents=True, exist_ok=True)
        with open(self.where / f"rank{run.comm.rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


@dataclass(frozen=True)
class Timeline:
    """A rank's marks on the timeline, as hooks of its run."""

    rank: int

    def install(self, run: Run) -> None:
        batches = run.hooks.batches

        def marked(run: Run, epoch: int, start: int) -> tuple[Iterable[Batch], Any]:
            timeline.mark("epoch: steps started", rank=self.rank, epoch=epoch)
            return batches(run, epoch, start)

        if batches is not None:
            run.hooks.batches = marked
        run.hooks.after_step.append(self.after_step)
        run.hooks.after_epoch.append(self.after_epoch)
        timeline.mark("worker: assembled", rank=self.rank)

    def after_step(self, run: Run, values: dict[str, float], batch: Batch) -> None:
        state = run.state
        if state.progress.steps == 1:  # an epoch's first step (its first batch's wait included)
            timeline.mark("worker: epoch's first step done", rank=self.rank, epoch=state.epoch,
                 first_batch_s=state.progress.first_batch_s)
        if state.step == (state.epoch + 1) * run.plan.steps_per_epoch:
            timeline.mark("epoch: steps done", rank=self.rank, epoch=state.epoch)

    def after_epoch(self, run: Run, metrics: dict[str, float]) -> None:
        if run.state.epoch == run.plan.epochs:
            timeline.mark("worker: done", rank=self.rank)


def rank_started(env: Environment, rank: int) -> None:
    """A rank's start: its timeline file named, and its entry marked with what it computes with
    (torch threads, ``OMP_NUM_THREADS``, niceness) and when its process started; with the timeline
    off, nothing is read."""
    timeline.start(env.timeline)
    if env.timeline:
        timeline.mark(timeline.WORKER_ENTERED, rank=rank, process_started=timeline.process_started(),
                      threads=torch.get_num_threads(), omp=os.environ.get("OMP_NUM_THREADS"), nice=os.nice(0))
