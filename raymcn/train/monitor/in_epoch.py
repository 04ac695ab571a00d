"""Progress inside a long epoch: a line for the person watching, and a marker file beside the run.

A HowTo100M epoch lasts hours, so one line per epoch is not enough to tell a slow run from a stuck
one. Rank 0 prints a line every ``run.progress_every`` seconds (step / steps, samples/s, the ETA
of the epoch and of the run), and writes the same figures to ``PROGRESS_FILE`` in the run folder
(throttled, in a background thread: never on the step's path), which ``raymcn watch`` shows and a
restarted run reads to say how many steps it replays (the interrupted attempt's last mark minus
the checkpoint's step). No Ray, no torch.

The rate, and the ETAs from it, mean something only once steps like the rest have been timed: the
first step after a start or an evaluation carries the start-up (the reader's first shards, the
first batch's allocations, a compile), and a one-minute run's first line said "run ETA 19m" from it.
So the rate is measured from the end of that step, over the last minutes, and shown once
:data:`ETA_MIN_STEPS` steps are timed; until then the line says from which step it will be.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from raymcn import storage
from raymcn.config import PROGRESS_FILE
from raymcn.train.run_plan import RunPlan

ETA_MIN_STEPS = 5  # steps timed (after the first of an attempt or an epoch) before a rate and ETA are shown


def duration(seconds: float) -> str:
    """``42s``, ``17m``, ``3h05m``, ``2d04h``: short, and exact enough for an ETA."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def progress_line(mark: dict[str, Any], label: str = "") -> str:
    """``[label ]epoch 2/30  step 4520/9100  1850 samples/s  epoch ETA 41m  run ETA 2d04h``; before
    the rate is measured (module doc) ``... step 1/16  rate and ETA from step 6``."""
    head = (f"{label} " if label else "") + (f"epoch {mark['epoch'] + 1}/{mark['epochs']}  "
                                             f"step {mark['in_epoch']}/{mark['steps_per_epoch']}")
    if mark.get("samples_per_s") is None:
        return f"{head}  rate and ETA from step {mark['rate_from_step']}"
    return (f"{head}  {mark['samples_per_s']:.0f} samples/s  epoch ETA {duration(mark['eta_epoch_s'])}"
            f"  run ETA {duration(mark['eta_run_s'])}")


def read_mark(run_dir: str) -> dict[str, Any] | None:
    """The run's last progress mark, or None (none written yet, or unreadable mid-write)."""
    try:
        return json.loads(storage.read_text(storage.join(run_dir, PROGRESS_FILE)))
    except (OSError, ValueError):
        return None


class Progress:
    """Rank 0's progress accounting (module doc). Call :meth:`step` after every step.

    Args:
        run_dir: the run's folder (a path or URI); None writes no marker.
        plan: the run's plan (``steps_per_epoch``, ``epochs`` and ``clips_per_step``, the global
            clips per step, are read from it).
        every_s: seconds between terminal lines (0: none); say: prints a line for the terminal.
        write_every_s: least seconds between marker writes.
        clock: monotonic seconds (injectable).
    """

    def __init__(self, run_dir: str | None, plan: RunPlan, *, every_s: float, say: Callable[[str], None] | None,
                 label: str = "", write_every_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.run_dir, self.label = run_dir, label
        self.plan = plan
        self.every_s, self.say, self.write_every_s, self.clock = every_s, say, write_every_s, clock
        now = clock()
        self._line_at = self._mark_at = now
        # (time, global step) samples for the rate; empty until the first step after a (re)start ends
        self._window: deque[tuple[float, int]] = deque()
        self._writer: threading.Thread | None = None
        self._pending: str | None = None
        self._lock = threading.Lock()

    def restart_clock(self, step: int) -> None:
        """The rate is measured anew from the end of the next step (after a resume, or after an
        evaluation between epochs): that step carries the start-up (module doc)."""
        self._window = deque()

    def mark(self, step: int) -> dict[str, Any]:
        """The figures at global ``step`` (steps completed); the rate and ETAs None until
        :data:`ETA_MIN_STEPS` steps are timed (``rate_from_step``: the step they come with)."""
        now = self.clock()
        t0, s0 = self._window[0] if self._window else (now, step + 1)
        measured = step - s0 >= ETA_MIN_STEPS and now > t0
        rate = (step - s0) / (now - t0) if measured else None  # steps per second
        plan = self.plan
        epoch, in_epoch = divmod(step, plan.steps_per_epoch)
        if in_epoch == 0 and step > 0:  # the last step of an epoch
            epoch, in_epoch = epoch - 1, plan.steps_per_epoch
        total = plan.steps_per_epoch * plan.epochs
        return {"epoch": epoch, "epochs": plan.epochs, "in_epoch": in_epoch, "steps_per_epoch": plan.steps_per_epoch,
                "global_step": step, "total_steps": total, "rate_from_step": s0 + ETA_MIN_STEPS,
                "samples_per_s": rate * plan.clips_per_step if measured else None,
                "eta_epoch_s": (plan.steps_per_epoch - in_epoch) / rate if measured else None,
                "eta_run_s": (total - step) / rate if measured else None, "time": time.time()}

    def step(self, step: int) -> None:
        """After a step (``step`` completed): a terminal line when due, a marker write when due."""
        now = self.clock()
        self._window.append((now, step))  # the first sample after a (re)start: the rate's start, not timed
        horizon = max(60.0, self.every_s)  # the rate of the last minutes, not of the whole run
        while len(self._window) > 2 and now - self._window[1][0] >= horizon:
            self._window.popleft()
        if self.say is not None and self.every_s > 0 and now - self._line_at >= self.every_s:
            self._line_at = now
            self.say(progress_line(self.mark(step), self.label))
        if now - self._mark_at >= self.write_every_s:
            self.write(step)

    def write(self, step: int) -> None:
        """Write the marker now (in the background; the newest mark wins when writes queue up)."""
        self._mark_at = self.clock()
        if self.run_dir is None:
            return
        with self._lock:
            mark = self.mark(step)
            self._pending = json.dumps({**mark, "line": progress_line(mark)})  # `raymcn watch` shows the line
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(target=self._drain, name="raymcn-progress", daemon=True)
                self._writer.start()

    def _drain(self) -> None:
        while True:
            with self._lock:
                text, self._pending = self._pending, None
            if text is None:
                return
            try:
                storage.write_text(storage.join(self.run_dir, PROGRESS_FILE), text)
            except OSError:  # a full disk or a lost bucket must not stop training; the next mark retries
                pass

    def flush(self, timeout: float = 10.0) -> None:
        """Wait for the last marker write (end of the run)."""
        writer = self._writer
        if writer is not None:
            writer.join(timeout)
