"""A run never waits in silence: every rank's watchdog names a stall and ends the attempt.

Each rank tells its :class:`Watchdog` where it is (:meth:`Watchdog.at`: a phase and the global
step) from its worker group's start on, at every phase start of the step loop, the evaluation
and the report. A rank that makes no progress for longer than its limit (``run.stall_timeout_s``,
or :data:`STEP_FACTOR` times the longest step it has run in this attempt when that is longer, but
always short of the process group's timeout) prints on the terminal which rank waits where,
records the stall in the run's folder (:data:`STALLS_DIR`) and ends its process: Ray Train
restarts the group from the latest checkpoint (``scale.max_failures``).

The process group's timeout (``TorchConfig.timeout_s`` = ``run.collective_timeout_s``, by default
2 x ``run.stall_timeout_s``; the config refuses less than 1.5 x) is a backstop behind the
watchdogs: their limits stay below it (:meth:`Watchdog.limit`), so they act first and name the
rank that waits for its data rather than the ranks waiting for it in a collective. What happens
after a rank's watchdog ended it depends on the backend:

* gloo (CPU): the other ranks' TCP connections to it close, so their collectives fail at once
  with a connection error (not a stall: nothing more is recorded).
* NCCL (GPU): a peer's exit does not end a collective (NVLink and shared memory carry no
  connection to lose), so the other ranks keep waiting until Ray Train, which saw the worker
  die, tears the group down, or their own watchdogs fire, ``grace_s`` after the named rank's.

Should the process group's timeout fire anyway (a watchdog thread that could not run), gloo
raises in the waiting thread; NCCL's own watchdog would by default
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, which Ray Train sets) take the process down with no Python
error, so nothing would be recorded and the repeated-stall rule could not see it. Workers
therefore run with :data:`NCCL_ERROR_HANDLING` (mode 2, "clean up only": the communicators are
aborted, the process lives), and the rank's next NCCL call raises an error carrying the
timeout's text. Either way :meth:`Watchdog.named` turns the error into a :class:`StallError`
naming the rank, step and phase, recorded the same way (with NCCL the step where the error
reached the host: the loop's one host sync per step keeps that within a step of the collective
that hung).

The same stall twice in one ``raymcn train`` (the same global step and phase, in two attempts)
is permanent: a restart reaches it again (a stall in a group's start is not counted: see
:func:`repeated_stall`). The driver's callback (``launch``) then ends the run with
:func:`repeated_stall`'s message instead of retrying.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass

from raymcn import storage

STALLS_DIR = "raymcn_stalls"  # in a run's folder: one JSON file per stall (a Stall), cleared when a run starts
STEP_FACTOR = 10.0  # the limit grows to this many times the longest step seen (a slow cluster is not a stall)
STALL_EXIT_CODE = 75  # the exit status of a process ended by its watchdog
# PyTorch's NCCL error handling for the workers (module doc): 2 = abort the communicators on an
# error or timeout and raise in the caller, instead of 1 (Ray Train's choice), which ends the process
NCCL_ERROR_HANDLING = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}

# What a rank is doing in each phase (the console's wording).
PHASES = {
    "start": "the worker group's start (its inputs, the model, DDP's first broadcast, the checkpoint)",
    "data": "waiting for its next batch (the data reader)",
    "step": "the step's compute and collectives (forward, loss, backward with DDP's gradient all-reduce, optimizer)",
    "checkpoint": "the checkpoint or progress mark after the step (collectives, a write)",
    "evaluation": "the evaluation (compute, an all-gather)",
    "report": "the epoch's checkpoint and report",
}
_TIMEOUT = re.compile(r"time[d ]?\s*out", re.IGNORECASE)  # gloo: "Timed out waiting ...", NCCL: "Watchdog caught collective operation timeout"


class StallError(RuntimeError):
    """A rank waited longer than ``run.stall_timeout_s`` (in a collective: the process group's timeout)."""


@dataclass(frozen=True)
class Stall:
    """One rank's stall, as recorded in the run's folder."""

    rank: int
    step: int
    phase: str
    idle_s: float
    attempt: str  # the attempt's id (the same on every rank of an attempt)

    def text(self) -> str:
        where = "" if self.phase == "start" else f" at global step {self.step},"  # a start's step is not known yet
        return (f"rank {self.rank} made no progress for {self.idle_s:.0f} s{where} "
                f"in {PHASES.get(self.phase, self.phase)}")


class Watchdog:
    """Watches one rank's progress from a daemon thread (module doc).

    Args:
        timeout_s: ``run.stall_timeout_s``, the limit's floor.
        collective_s: the process group's timeout (``run.collective_timeout``): every limit stays
            short of it, so the watchdog acts before a collective times out; None = no ceiling.
        rank: this process's rank (named in the message).
        run_dir: the run's folder (a path or URI), where stalls are recorded; None records nothing.
        say: shows a line on the terminal (every rank may call it).
        end: ends the attempt (default: ``os._exit``; the stalled thread cannot be interrupted).
        poll_s: how often the thread looks (default: a tenth of the limit, at most 5 s).
        attempt: this attempt's id, the same on every rank (stalls of one attempt are one stall);
            default a new one.
    """

    def __init__(self, timeout_s: float, rank: int, run_dir: str | None, say: Callable[[str], None],
                 end: Callable[[], None] | None = None, poll_s: float | None = None, attempt: str | None = None,
                 collective_s: float | None = None):
        self.timeout_s, self.rank, self.run_dir, self.say = float(timeout_s), rank, run_dir, say
        self.collective_s = collective_s
        self.end = end or (lambda: os._exit(STALL_EXIT_CODE))
        self.poll_s = poll_s if poll_s is not None else min(5.0, self.timeout_s / 10)
        self.grace_s = 2 * self.poll_s + 1.0  # more than one look of the data-waiting rank's watchdog
        self.attempt = attempt or uuid.uuid4().hex[:12]
        self.phase, self.step = "data", 0
        self.since = time.monotonic()
        self.longest = 0.0  # the longest step (phase "step") finished in this attempt
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def at(self, phase: str, step: int) -> None:
        """This rank starts ``phase`` of global step ``step`` (cheap: called several times a step)."""
        now = time.monotonic()
        if self.phase == "step":  # the measured step time (not the data waits: an epoch's first is Ray Data's start)
            self.longest = max(self.longest, now - self.since)
        self.phase, self.step, self.since = phase, step, now

    def limit(self, phase: str | None = None) -> float:
        """Seconds without progress in ``phase`` (default: the current one) that count as a stall.

        A rank waiting for its own data gets the plain limit; in any other phase it may be waiting
        in a collective for that rank, so it waits ``grace_s`` longer: the rank that holds the
        others up is the one named (on gloo its exit then ends their collectives at once; on NCCL
        Ray Train or their own watchdogs end them, see the module doc). The plain limit grows with
        the longest step but stays ``grace_s`` and two looks short of the process group's timeout
        (``collective_s``), never below ``run.stall_timeout_s`` (the config keeps the two apart)."""
        plain = max(self.timeout_s, STEP_FACTOR * self.longest)
        if self.collective_s is not None:
            plain = min(plain, max(self.timeout_s, self.collective_s - self.grace_s - 2 * self.poll_s))
        return plain if (phase or self.phase) == "data" else plain + self.grace_s

    def start(self) -> Watchdog:
        self.since = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="raymcn-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            idle = time.monotonic() - self.since
            if idle > self.limit():
                stall = Stall(self.rank, self.step, self.phase, idle, self.attempt)
                self.record(stall)
                self.say(f"STALL: {stall.text()} (limit {self.limit():.0f} s, run.stall_timeout_s); "
                         "ending this attempt: Ray Train restarts from the latest checkpoint")
                self.end()
                return

    def named(self, error: BaseException) -> BaseException:
        """``error`` unchanged, or for a timeout (a collective another rank never joined) a
        :class:`StallError` naming this rank, step and phase (recorded like a stall)."""
        if not _TIMEOUT.search(str(error)):
            return error
        stall = Stall(self.rank, self.step, self.phase, time.monotonic() - self.since, self.attempt)
        self.record(stall)
        message = f"{stall.text()}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        self.say(f"STALL: {message}")
        return StallError(message)

    def record(self, stall: Stall) -> None:
        if self.run_dir is None:
            return
        try:
            storage.write_text(storage.join(self.run_dir, STALLS_DIR, f"{stall.attempt}-rank{stall.rank}-step{stall.step}-{stall.phase}.json"),
                               json.dumps(asdict(stall)))
        except OSError as e:  # the message still reaches the console; a restart still follows
            self.say(f"could not record the stall in {self.run_dir}: {e}")


def recorded(run_dir: str) -> list[Stall]:
    """The stalls recorded in ``run_dir`` since this ``raymcn train`` started (in no particular order)."""
    folder, out = storage.join(run_dir, STALLS_DIR), []
    for name in storage.files(folder):
        try:
            out.append(Stall(**json.loads(storage.read_text(storage.join(folder, name)))))
        except (OSError, ValueError, TypeError):
            continue  # being written, or damaged: the next failure looks again
    return out


def repeated_stall(run_dir: str) -> str | None:
    """A message when two attempts stalled at the same global step and phase (a restart cannot
    cure that), else None."""
    seen: dict[tuple[int, str], Stall] = {}
    # A group's start is left out: it can stall for reasons outside the run (a process stopped, a
    # node still joining) and a later group may start elsewhere; scale.max_failures bounds it.
    counted = [s for s in recorded(run_dir) if s.phase != "start"]
    for stall in sorted(counted, key=lambda s: (s.step, s.phase, s.rank)):
        first = seen.setdefault((stall.step, stall.phase), stall)
        if first.attempt != stall.attempt:
            return (f"the same stall in two attempts: {first.text()}; then {stall.text()}. A restart reaches it "
                    "again (a collective one rank never joins, e.g. ranks taking different code paths, or input "
                    "that never arrives): not retried")
    return None


def clear(run_dir: str) -> None:
    """Forget the stalls of earlier ``raymcn train`` invocations of ``run_dir``."""
    fs, path = storage.filesystem(storage.join(run_dir, STALLS_DIR))
    try:
        fs.delete_dir(path)
    except (FileNotFoundError, OSError):
        pass
