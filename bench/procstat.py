"""What the benchmarks print beside every figure: the machine's load, and the CPU every process used
(the machine itself: ``harness.machine_line``); and the other readers of ``/proc`` they share.

* :func:`load`: ``os.getloadavg()``; on a shared machine the figures are only as good as this.
* :func:`processes`: every process's parent and command line; :func:`status_bytes`: a memory
  figure of this process (``VmRSS``, ``VmHWM``).
* :class:`ProcessSampler`: a thread that reads ``/proc/<pid>/stat`` and the process titles of every
  process on the machine every ``every_s`` seconds, and the CPU of each thread of the training
  ranks. :meth:`ProcessSampler.cpu` then gives the CPU seconds per kind of process between two
  wall times (ranks, read tasks, Ray Data's coordinator, the Train controller, raylet, GCS,
  dashboard, ...), and splits the ranks' CPU into their busiest thread (the training thread) and
  the rest. Processes that are not descendants of the benchmark (other users' jobs) are counted
  as one line of their own, so the disturbance is visible beside the figures.

Linux only (``/proc``); elsewhere the sampler records nothing and the tables say so.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# (kind, substrings of the command line / process title); the first match wins. A process keeps
# the most specific kind it was ever seen with (a Ray worker shows ray::IDLE between tasks).
KINDS = (
    ("training ranks", ("ray::RayTrainWorker", "--_rank_child", "ray::VanillaRank", "ray::Consumer")),
    ("Ray Data read tasks", ("ray::ReadRaymcnSteps", "ReadRaymcnSteps", "ray::Read")),
    ("Ray Data coordinator + stats", ("ray::SplitCoordinator", "ray::_StatsActor", "ray::DatasetStats",
                                      "ray::AutoscalingCoordinator", "ray::_AutoscalingCoordinatorActor")),
    ("Train controller", ("ray::TrainController",)),
    ("Train's other actors (sync, placement-group cleaner, preemption watcher, dataset manager)",
     ("ray::SynchronizationActor", "ray::PlacementGroupCleaner", "ray::TrainStateActor", "ray::PreemptionWatcher",
      "ray::DatasetManager")),
    ("Tune trial driver", ("ray::ImplicitFunc", "ray::_Inner", "ray::Trainable")),
    ("raylet", ("/raylet/raylet",)),
    ("GCS", ("gcs_server",)),
    ("dashboard (head + agent)", ("dashboard/dashboard.py", "dashboard/agent.py", "ray::DashboardAgent")),
    ("other Ray daemons (log monitor, runtime-env agent, autoscaler monitor)",
     ("log_monitor.py", "runtime_env/agent", "ray::RuntimeEnvAgent", "autoscaler/_private/monitor.py")),
    ("idle Ray workers", ("ray::IDLE", "default_worker.py", "setup_worker.py")),
    ("torchrun agent", ("torch.distributed.run",)),
)
DRIVER = "benchmark driver"
OTHERS = "other processes on the machine (not this benchmark's)"
UNKNOWN = "other processes of this benchmark"
_RANK_OF = {kind: i for i, (kind, _) in enumerate(KINDS)}


def load() -> list[float]:
    """``os.getloadavg()`` rounded: runnable processes averaged over 1, 5 and 15 minutes."""
    return [round(x, 2) for x in os.getloadavg()]


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line, its arguments joined by spaces) of every process."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                out[int(d.name)] = (ppid, (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except (OSError, IndexError, ValueError):  # ended meanwhile
                continue
    return out


def status_bytes(field: str) -> int:
    """A memory figure of this process from ``/proc/self/status`` (``VmRSS``, ``VmHWM``), bytes; 0 if absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def kind_of(cmd: str) -> str | None:
    return next((kind for kind, keys in KINDS if any(k in cmd for k in keys)), None)


@dataclass
class _Proc:
    ppid: int
    cmd: str
    kind: str | None
    nice: int
    cpu: float  # utime + stime, seconds
    threads: dict[int, float] = field(default_factory=dict)  # training ranks only: tid -> cpu seconds


class ProcessSampler:
    """Samples every process's CPU time (and the ranks' threads') from /proc in a background thread."""

    def __init__(self, every_s: float = 0.5, root: int | None = None):
        self.available = os.path.isdir("/proc/self/task")
        self.root = root or os.getpid()
        self._every = every_s
        self._samples: list[tuple[float, dict[int, _Proc]]] = []
        self._kind: dict[int, str] = {}  # the most specific kind each pid was seen with
        self._stop = threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK") if self.available else 100
        self._thread = threading.Thread(target=self._run, name="procstat", daemon=True)
        self.titles: dict[int, list[tuple[float, str]]] = {}  # pid -> (first time seen, title) per change
        self._ours: set[int] = set()  # every pid ever seen below the root (this benchmark's processes)

    def __enter__(self) -> ProcessSampler:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.available:
            self._thread.join()

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self._every):
                self._sample()
                return

    def _sample(self) -> None:
        now, procs = time.time(), {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
                with open(f"/proc/{pid}/cmdline") as f:
                    cmd = f.read().replace("\0", " ").strip()
            except OSError:  # ended meanwhile
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # from field 3 (state) on
            cmd = cmd or stat[stat.index("(") + 1:stat.rindex(")")]
            kind = kind_of(cmd)
            if kind is not None and _RANK_OF[kind] < _RANK_OF.get(self._kind.get(pid, ""), len(KINDS)):
                self._kind[pid] = kind
            title = self.titles.setdefault(pid, [])
            if not title or title[-1][1] != cmd:
                title.append((now, cmd))
            p = _Proc(int(fields[1]), cmd, kind, int(fields[16]), (int(fields[11]) + int(fields[12])) / self._tick)
            if self._kind.get(pid) == "training ranks":
                p.threads = self._threads(pid)
            procs[pid] = p
        self._ours |= self._descendants(procs)
        self._samples.append((now, procs))

    def _threads(self, pid: int) -> dict[int, float]:
        out = {}
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return out
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / self._tick
        return out

    def _descendants(self, procs: dict[int, _Proc]) -> set[int]:
        children: dict[int, list[int]] = {}
        for pid, p in procs.items():
            children.setdefault(p.ppid, []).append(pid)
        out, todo = set(), [self.root]
        while todo:
            pid = todo.pop()
            out.add(pid)
            todo += children.get(pid, [])
        return out

    def cpu(self, t0: float, t1: float) -> dict:
        """CPU seconds per kind of process between the samples around wall times t0 and t1.

        Returns ``{"window_s", "cpu_s": {kind: seconds}, "rank_threads": {"training thread",
        "other threads"}, "ranks": [{pid, nice, cpu_s, training_thread_s}]}``; ``{}`` without samples.
        A process that started inside the window counts from zero; one that ended inside it
        counts up to its last sample.
        """
        deadline = time.time() + 4 * self._every  # called right after t1: wait for the sample that follows it
        while self._thread.is_alive() and not any(s[0] >= t1 for s in self._samples[-3:]) and time.time() < deadline:
            time.sleep(self._every / 4)
        before = max((s for s in self._samples if s[0] <= t0), default=None, key=lambda s: s[0])
        after = min((s for s in self._samples if s[0] >= t1), default=None, key=lambda s: s[0])
        if before is None or after is None:
            return {}
        inside = [s for s in self._samples if before[0] <= s[0] <= after[0]]
        last: dict[int, _Proc] = {}
        for _, procs in inside:  # a process that ended inside the window: its last sample
            last.update(procs)
        ours = set()
        for _, procs in inside:
            ours |= self._descendants(procs)
        cpu: dict[str, float] = {}
        ranks, main_s, other_s = [], 0.0, 0.0
        for pid, p in last.items():
            start = before[1].get(pid)
            spent = p.cpu - (start.cpu if start is not None else 0.0)
            if pid == self.root:
                kind = DRIVER
            elif pid not in ours:
                kind = OTHERS
            else:
                kind = self._kind.get(pid, UNKNOWN)
            cpu[kind] = cpu.get(kind, 0.0) + max(0.0, spent)
            if kind == "training ranks" and pid in ours:
                base = start.threads if start is not None else {}
                per = {tid: c - base.get(tid, 0.0) for tid, c in p.threads.items()}
                busiest = max(per.values(), default=0.0)
                main_s += busiest
                # the process's total less that thread: also counts threads that ended inside the
                # window (a prefetch thread lives for one epoch) and so left no last sample
                other_s += max(0.0, spent - busiest)
                ranks.append({"pid": pid, "nice": p.nice, "cpu_s": round(spent, 3),
                              "training_thread_s": round(busiest, 3)})
        return {"window_s": after[0] - before[0], "cpu_s": cpu,
                "rank_threads": {"training thread": main_s, "other threads": other_s}, "ranks": ranks}

    def first_seen(self, needle: str, after: float = 0.0) -> float | None:
        """The first sample time (>= ``after``) at which one of this benchmark's processes had a title
        containing ``needle`` (other users' Ray processes on the machine carry the same titles)."""
        times = [t for pid, titles in self.titles.items() if pid in self._ours
                 for t, cmd in titles if needle in cmd and t >= after]
        return min(times, default=None)


def kinds_order() -> list[str]:
    return [k for k, _ in KINDS] + [UNKNOWN, DRIVER, OTHERS]
