"""A timeline of a run's fixed costs, for the benchmarks: written only when ``RAYMCN_TIMELINE`` names a file.

Every process of a run or a sweep (the command line, the trial drivers, the Train workers) appends
one JSON line per event: ``{"t": wall time, "pid", "event", ...fields}``. Each process names the
file once at its start (:func:`start`, from its ``raymcn.environment.Environment``);
``bench/trial_cost.py`` sets the variable and reads the file back; Ray Train's workers get it in
their runtime environment (``on_ray/launch.build_trainer``), and a rank's events are hooks of its
run (``train/probes.py``). Unset, as in every normal run, :func:`mark` returns at once.

Stdlib only: the workers import it before anything heavy.
"""

from __future__ import annotations

import json
import os
import time

WORKER_ENTERED = "worker: function entered"


_file = ""  # this process's timeline (start); "" = off


def start(path: str) -> None:
    """This process's timeline file, named at its start ("" = none)."""
    global _file
    _file = path


def process_started(pid: int | str = "self") -> float | None:
    """Wall time process ``pid`` started (Linux ``/proc``; None elsewhere, or when it is gone): a
    trace event's distance from it separates a fresh process's start-up and imports from a reused
    one's, and two readings that differ tell a pid's process from a later one's."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, clock ticks after boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def mark(event: str, **fields) -> None:
    """Append ``event`` with the wall time and this process's id to the trace file, if one is set."""
    if not _file:
        return
    line = json.dumps({"t": time.time(), "pid": os.getpid(), "event": event, **fields}, default=str)
    # One write of one line in append mode: the lines of concurrent processes never interleave.
    with open(_file, "a") as f:
        f.write(line + "\n")
