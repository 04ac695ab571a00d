"""What an epoch accumulates, step by step, and the epoch's metrics folded from it over the ranks;
the step's phase timer. No Ray.

Every step adds its loss terms, clips, phase times and data counters to the run's
:class:`EpochProgress` (checkpointed with the loop state, so an epoch resumed in its middle reports
what the uninterrupted one reports); :func:`epoch_metrics` folds it over the ranks at the epoch's
end (a collective), :func:`fold_progress` before a mid-epoch checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from raymcn.collectives import Collectives

# "reforward": gradient caching's second forward of each chunk (scale.grad_cache_clips; 0 s when off);
# "checkpoint": the step loop's stall for mid-epoch checkpoints and progress marks (after_step)
TIMING_PHASES = ("data", "forward", "loss", "backward", "reforward", "optimizer", "checkpoint")


@dataclass
class EpochProgress:
    """What the epoch in progress has accumulated. Checkpointed with the loop state, so an epoch
    resumed in its middle (on as many ranks or on others) reports the per-epoch means of the
    uninterrupted one.

    Values are keyed ``sum:<term>`` (the loss term summed over finite steps), ``time:<phase>``
    (seconds), ``clips`` and ``count:<counter>`` (``bad_samples``, ``videos_read``). ``live`` is
    this rank's since the last fold; ``folded`` is combined over the ranks (identical on every rank,
    so rank 0's checkpoint holds it for all): the ranks' mean for sums, times and clips (a loss term
    is each rank's share, its mean over ranks the full batch's value), their total for counts.
    :func:`fold_progress` moves ``live`` into ``folded`` before a mid-epoch checkpoint, in every run
    alike, so a resumed run does the same arithmetic as one that was never stopped.

    Attributes:
        steps, skipped: steps run in the epoch and non-finite steps skipped (equal on every rank).
        first_batch_s: this rank's wait for the epoch's first batch.
    """

    steps: int = 0
    skipped: int = 0
    first_batch_s: float | None = None
    folded: dict[str, float] = field(default_factory=dict)
    live: dict[str, float] = field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        self.live[key] = self.live.get(key, 0.0) + value


def _combined(progress: EpochProgress, comm: Collectives, device: torch.device) -> dict[str, float]:
    """``folded`` + the ranks' ``live`` combined (a collective: every rank calls it with the same keys)."""
    keys = sorted(set(progress.live) | set(progress.folded))
    live = torch.tensor([progress.live.get(k, 0.0) for k in keys], dtype=torch.float64, device=device)
    mean = comm.all_reduce_mean(live).tolist() if keys else []
    return {k: progress.folded.get(k, 0.0) + (m * comm.world if k.startswith("count:") else m)
            for k, m in zip(keys, mean)}


def fold_progress(progress: EpochProgress, comm: Collectives, device: torch.device) -> None:
    """Combine every rank's ``live`` values into ``folded`` (collective; before a mid-epoch checkpoint)."""
    progress.folded = _combined(progress, comm, device)
    progress.live = {}


def epoch_metrics(progress: EpochProgress, comm: Collectives, device: torch.device) -> dict[str, float]:
    """The epoch's metrics over all its steps and ranks (collective): per-step means of each loss
    term and phase time, ``samples_per_s`` (per worker), ``time_first_batch_s`` (ranks' mean),
    ``time_epoch_s`` and the data counters summed over ranks."""
    progress.add("wait:first_batch", progress.first_batch_s or 0.0)
    total = _combined(progress, comm, device)
    steps = max(1, progress.steps)
    out = {k[4:]: v / max(1, progress.steps - progress.skipped) for k, v in total.items() if k.startswith("sum:")}
    out.update({f"time_{k[5:]}_s": v / steps for k, v in total.items() if k.startswith("time:")})
    elapsed = max(sum(v for k, v in total.items() if k.startswith("time:")), 1e-9)
    out.update({k[6:]: float(round(v)) for k, v in total.items() if k.startswith("count:")})
    out.update(time_first_batch_s=total.get("wait:first_batch", 0.0), time_epoch_s=elapsed,
               samples_per_s=total.get("clips", 0.0) / elapsed, steps=float(progress.steps),
               skipped_steps=float(progress.skipped))
    return out


class PhaseTimer:
    """Seconds of each phase of the step, added to ``progress`` as ``time:<phase>``, without
    synchronising the device.

    On CPU a lap is a ``perf_counter`` reading. On CUDA it is an event recorded on the compute
    stream (kernels are queued ahead of their execution, so the host's clock would bill them to the
    wrong phase, and a ``cuda.synchronize`` per phase would stop the host from queueing the next
    phase's kernels): a phase's time is the GPU-side time between its two events. Events are read
    by :meth:`settle` once they have completed (``query``, which never waits; the loop calls it
    after every step, and the events still running then are read at a later step). The ``data``
    phase is then the time the device waited for the next batch.
    """

    def __init__(self, progress: EpochProgress, device: torch.device):
        self.progress, self.device = progress, device
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[str, Any, Any]] = []  # (phase, start event, end event), CUDA only
        self.last = self._mark()

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def lap(self, phase: str) -> None:
        """The phase that started at the last lap ends now."""
        now = self._mark()
        if self.cuda:
            self.pending.append((phase, self.last, now))
        else:
            self.progress.add(f"time:{phase}", now - self.last)
        self.last = now

    def settle(self, wait: bool = False) -> None:
        """Add the times of the phases whose events have completed (``wait``: all, synchronising on the last)."""
        if wait and self.pending:
            self.pending[-1][2].synchronize()
        open_ = []
        for phase, start, end in self.pending:
            if wait or end.query():
                self.progress.add(f"time:{phase}", start.elapsed_time(end) / 1000.0)
            else:
                open_.append((phase, start, end))
        self.pending = open_
