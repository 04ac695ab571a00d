"""Faults change nothing: a sweep under many injected faults ends with the same table as a quiet one.

A grid sweep (its trials fixed in advance) runs on Ray's multi-node test cluster (a head that takes
no work and 1-CPU raylets standing in for the lab's servers), its driver a separate process
(``raymcn sweep --address``). This process injects faults at random, seeded moments:

* ``kill_worker``: a Ray Train worker SIGKILLed;
* ``lose_node``: a raylet holding a Train worker removed at once (``remove_node(allow_graceful=False)``:
  a power loss), another added back a few seconds later;
* ``drain_node``: a planned reboot: ``raymcn drain``'s own ``ray drain-node`` (reason preemption, a
  deadline of :data:`DRAIN_DEADLINE_S`) on a raylet holding a Train worker, which the run answers
  with a checkpoint at once (``run.drain_check_every=1`` here); as with ``raymcn drain --reboot``,
  the raylet goes once its ranks have marked that checkpoint registered (else at the deadline),
  another comes back a few seconds later;
* ``stall_rank``: a Train worker that has entered its rank's run SIGSTOPped past
  ``run.stall_timeout_s`` (the other rank's watchdog names the stall and ends the attempt), then
  SIGCONTed or SIGKILLed;
* ``storage_readonly``: a running trial's run folder made immutable (``chattr +i``: even root cannot
  write there) for a while, so checkpoints and its progress files fail to write;
* ``kill_driver``: the sweep's driver SIGKILLed and started again with ``--resume latest``;
* ``reboot_head``: the head's unplanned reboot: the driver SIGKILLed and the whole cluster ended (its
  GCS gone, so every raylet with it), then started again (a new head and the same raylets, as the
  boot service brings up the head and the workers rejoin), and the sweep continued as the boot
  service continues it on the head (``raymcn.servers.boot.continue_sweep``: the newest unfinished
  sweep under the storage path, ``raymcn sweep --resume``).

Then every trial's per-epoch metrics (``metrics.csv``, timing columns aside) are compared with the
same sweep run without faults: bitwise, because the data order is a function of (seed, epoch,
step) and a restart resumes from the exact state of a checkpoint, and nothing in a step depends on
the world's history. Also compared: the table's answer, the trials (none lost, none twice). The
steps each fault cost are counted from the step trace (``RAYMCN_TRACE``, rank 0): a restart
shows as a step run again, and :func:`steps_replayed` charges it to the fault that preceded it.
``tests/test_chaos.py`` runs the short soak (``--smoke``: one fault of each kind, ``SMOKE``);
``python -m bench.chaos`` a longer one (``--faults``, default 20) and prints the figures
``docs/faults.md`` quotes.
"""

from __future__ import annotations

import csv
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from bench import harness, procstat
from bench.services import multinode_cluster
from raymcn.config import RUN_CONFIG_FILE, load_config, preset_path
from raymcn.train.monitor.timeline import process_started
from raymcn.train.monitor.watchdog import STALLS_DIR

KINDS = ("kill_worker", "lose_node", "drain_node", "stall_rank", "storage_readonly", "kill_driver", "reboot_head")
PLANNED, UNPLANNED = ("drain_node",), ("lose_node", "reboot_head")  # a server's reboot, with and without a drain
NAMED, UNNAMED = "named by the watchdog", "not named by the watchdog"  # a stopped rank, in its fault's detail
TIMING = ("time_", "samples_per_s", "workers")  # metrics that measure the machine, not the training
# A "server": room for a Train worker (1 CPU) beside the trial's own small actor (Tune reserves
# 0.01 CPU for it), so a restarted group fits on the nodes left after a loss.
NODE = {"num_cpus": 2}
# A Train worker that has entered its rank's run: its line in the sweep's console log, "rank R: T torch thread(s)"
ENTERED = re.compile(r"RayTrainWorker pid=(\d+)[^)]*\)\S*\s+rank \d+: \d+ torch thread")
DRAIN_DEADLINE_S = 15  # three polls of Ray Train's preemption watcher (every 5 s)
# The short soak (tests/test_chaos.py): 4 trials x 3 epochs, one fault of each kind, seeded
SMOKE = {"faults": len(KINDS), "epochs": 3, "orders": ("AV_T", "joint"), "seed": 3, "gap": 4.0}
# What the boot service runs on the head once Ray is up (raymcn/servers/boot.py), as a driver process
BOOT_STEP = ("import sys; from raymcn.servers.boot import continue_sweep; "
             "status = continue_sweep(sys.argv[1]); sys.exit(0 if status is None else status)")


def chaos_settings(tmp: Path, epochs: int = 3, orders: tuple[str, ...] = ("AV_T", "joint"),
                   lrs: tuple[float, ...] = (1e-3, 3e-3), stall_timeout_s: int = 10) -> list[str]:
    """A grid sweep of len(orders) x len(lrs) trials of ``epochs`` epochs, 2 workers of 1 CPU each,
    checkpoints every 2 steps (inside epochs), failure budgets for a soak."""
    return ["data.synthetic_videos=64", "data.synthetic_eval_clips=64", "data.batch_size=16", f"schedule.epochs={epochs}",
            "scale.num_workers=2", "scale.cpus_per_worker=1", "run.checkpoint_every=2", "run.drain_check_every=1",
            f"run.stall_timeout_s={stall_timeout_s}", "scale.max_failures=30", "sweep.max_trial_failures=10",
            "sweep.algorithm=grid", "sweep.num_samples=1", "sweep.repeats=1", "sweep.max_concurrent=1",
            "sweep.confirm={}", f"sweep.space={{schedule.stage_order: {{grid: [{', '.join(orders)}]}}, "
            f"optim.lr: {{grid: [{', '.join(map(str, lrs))}]}}}}", f"run.storage_path={tmp}"]


@dataclass
class Driver:
    """The sweep's driver process (``raymcn sweep``); restarted with ``--resume latest``, or after a
    head's reboot by the boot service's step (:data:`BOOT_STEP`)."""

    address: str
    settings: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    proc: subprocess.Popen | None = None
    starts: int = 0

    def start(self, resume: bool = False) -> None:
        argv = [sys.executable, "-m", "raymcn.cli", "sweep", "--address", self.address,
                *sum((["--set", s] for s in self.settings), [])]
        self._spawn(argv + ["--resume", "latest"] if resume else argv, "(resume)" if resume else "")

    def boot(self, location: Path) -> None:
        """The newest unfinished sweep under ``location`` continued as the head's boot service does."""
        self._spawn([sys.executable, "-c", BOOT_STEP, str(location)], "(boot service)", {"RAY_ADDRESS": self.address})

    def _spawn(self, argv: list[str], label: str, env: dict[str, str] | None = None) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as out:
            out.write(f"\n=== driver start {self.starts} {label} ===\n")
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, **self.env, **(env or {})})
        self.starts += 1

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)  # its session: a boot step's sweep with it
        self.proc.wait()

    def done(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None


def _pids(name: str, cluster=None) -> list[int]:
    """Processes whose command line starts with ``name`` (Ray names its workers' processes
    ``ray::<class>``); with ``cluster``, only those its raylets started (another Ray instance on
    this machine has workers of the same names)."""
    raylets = None
    if cluster is not None:
        raylets = {info.process.pid for node in cluster.list_all_nodes()
                   for info in node.all_processes.get("raylet", [])}
    return sorted(pid for pid, (parent, cmd) in procstat.processes().items()
                  if cmd.startswith(name) and (raylets is None or parent in raylets))


def _age_s(pid: int) -> float:
    """Seconds since the process started (0 when it is gone)."""
    born = process_started(pid)
    return 0.0 if born is None else time.time() - born


@dataclass
class Chaos:
    """Injects faults into a running sweep (module doc) at random moments drawn from ``seed``."""

    cluster: object
    driver: Driver
    experiment: Path
    seed: int
    stall_timeout_s: float
    mean_gap_s: float = 20.0
    trace: Path | None = None  # the sweep's RAYMCN_TRACE folder
    last_step: int = -1  # a trial's last global step (counted from 0)
    injected: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self.lock = threading.Lock()  # held while a fault is injected: the driver may be between a kill and a start
        # Ray adds a node only from the main thread (it installs signal handlers): node changes are
        # handed to run_sweep's loop, which runs them and says when they are done.
        self.requests: queue.Queue = queue.Queue()
        self.error: Exception | None = None

    def serve(self, wait_s: float = 0.2) -> bool:
        """Run a node change the injector asked for (on the main thread); False when none came."""
        try:
            fn, done, errors = self.requests.get(timeout=wait_s)
        except queue.Empty:
            return False
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - handed back to the injector
            errors.append(e)
        done.set()
        return True

    def on_main_thread(self, fn) -> None:
        done, errors = threading.Event(), []
        self.requests.put((fn, done, errors))
        done.wait()
        if errors:
            raise errors[0]

    def run(self, faults: int, stop: threading.Event) -> None:
        """``faults`` faults, every kind as evenly as ``faults`` allows, in a seeded random order
        (on a thread of its own; an error is kept in ``error`` for run_sweep to raise)."""
        try:
            self._inject(faults, stop)
        except Exception as e:  # noqa: BLE001
            self.error = e

    def _inject(self, faults: int, stop: threading.Event) -> None:
        plan = [KINDS[i % len(KINDS)] for i in range(faults)]
        self.rng.shuffle(plan)
        retries = 3  # a rank stopped as its trial ended meets no watchdog (no peer waits): stop another later
        while plan:
            kind = plan.pop(0)
            if stop.wait(self.rng.uniform(0.5, 1.5) * self.mean_gap_s):
                return
            detail = None
            while detail is None and not stop.is_set():
                if kind != "kill_driver" and not _pids("ray::RayTrainWorker", self.cluster):
                    stop.wait(0.5)  # between trials, or a group restarting: wait for a running trial
                    continue
                started = time.time()
                with self.lock:
                    if self.driver.done():
                        return  # the sweep ended
                    detail = getattr(self, kind)()
                if detail is None:
                    stop.wait(0.5)  # no worker this fault can meet yet (one still starting): look again
            if detail:  # "": this kind cannot be injected on this machine
                # the steps rank 0 had traced once the fault had struck (steps_replayed)
                self.injected.append({"kind": kind, "at": started, "detail": detail, "trace_at": self._traced()})
                with open(self.driver.log.parent / "faults.jsonl", "a") as f:
                    f.write(json.dumps(self.injected[-1]) + "\n")
            if kind == "stall_rank" and detail and UNNAMED in detail and retries:
                retries -= 1
                plan.append(kind)

    def _traced_steps(self) -> list[int]:
        """The global steps rank 0 has traced in this sweep so far, in order (none without a trace)."""
        return [] if self.trace is None else trace_steps(self.trace)

    def _traced(self) -> int:
        """Steps rank 0 has traced in this sweep so far."""
        return len(self._traced_steps())

    def _last_step_traced(self) -> bool:
        """Whether rank 0's latest traced step is the last of a trial (``last_step``)."""
        return self._traced_steps()[-1:] == [self.last_step]

    def _worker(self) -> int | None:
        """A Train worker of this cluster, any."""
        pids = _pids("ray::RayTrainWorker", self.cluster)
        return self.rng.choice(pids) if pids else None

    def _training_worker(self) -> int | None:
        """The youngest Train worker that has entered its rank's run (it printed its thread count)
        while its trial still has steps to run: its peers' watchdogs watch it from there on. Not a
        worker Ray Train is still setting up, nor one whose trial has run its last step (it may be
        past its run already): there the controller waits for it (Ray Train's health check), no rank does."""
        if self._last_step_traced():
            return None
        console = self.experiment / "raymcn_console.log"
        entered = set(map(int, ENTERED.findall(console.read_text(errors="replace")))) if console.exists() else set()
        running = [p for p in _pids("ray::RayTrainWorker", self.cluster) if p in entered]
        return min(running, key=_age_s) if running else None

    def kill_worker(self) -> str | None:
        pid = self._worker()
        if pid is None:
            return None
        os.kill(pid, signal.SIGKILL)
        return f"SIGKILL Train worker {pid}"

    def lose_node(self) -> str | None:
        victim = self._busy_node()
        if victim is None:
            return None
        self.on_main_thread(lambda: self.cluster.remove_node(victim, allow_graceful=False))
        time.sleep(3.0)
        self.on_main_thread(lambda: self.cluster.add_node(**NODE))
        return f"node {victim.node_id[:8]} removed, a new one added 3 s later"

    def drain_node(self) -> str | None:
        from raymcn.servers.drain import _ray_executable, drain_command, outcome, wait_for_node

        victim = self._busy_node()
        if victim is None:
            return None
        since = time.time()
        drained = subprocess.run(drain_command(_ray_executable(), self.cluster.address, victim.node_id,
                                               DRAIN_DEADLINE_S, "bench.chaos"), capture_output=True, text=True)
        if drained.returncode:
            raise RuntimeError(f"ray drain-node failed: {drained.stderr[-2000:]}")
        # as with `raymcn drain --reboot`, the server goes once its ranks marked the checkpoint registered
        start = time.monotonic()
        left, marked = wait_for_node(victim.node_id, DRAIN_DEADLINE_S, since, say=lambda _: None)
        waited = outcome(left, marked, time.monotonic() - start)
        self.on_main_thread(lambda: self.cluster.remove_node(victim, allow_graceful=False))
        time.sleep(3.0)
        self.on_main_thread(lambda: self.cluster.add_node(**NODE))
        return (f"node {victim.node_id[:8]} drained with a {DRAIN_DEADLINE_S} s deadline; {waited}; removed then, "
                "a new one added 3 s later")

    def _busy_node(self):
        """A raylet of the cluster holding a running Train worker (None when none does)."""
        from ray.util.state import list_actors

        busy = {a.node_id for a in list_actors(filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])}
        victims = [n for n in self.cluster.worker_nodes if n.node_id in busy]
        return self.rng.choice(victims) if victims else None

    def stall_rank(self) -> str | None:
        pid = self._training_worker()
        if pid is None:
            return None
        born = process_started(pid)
        before = self._stall_records()
        os.kill(pid, signal.SIGSTOP)
        # until the other rank's watchdog names the stall (its limit is run.stall_timeout_s, or ten
        # of the longest steps of the attempt when that is longer, plus a grace), or until Ray ends
        # the stopped process (its trial ended: no rank waits for it), at most 6 limits
        waited = time.time()
        deadline = waited + 6 * max(self.stall_timeout_s, 10.0)
        while time.time() < deadline and self._stall_records() == before and process_started(pid) == born:
            time.sleep(0.5)
        waited = time.time() - waited
        how = self.rng.choice(["SIGCONT", "SIGKILL"])
        if process_started(pid) != born:  # Ray ended it meanwhile (and its pid may be another process's now)
            how = "(already gone)"
        else:
            os.kill(pid, signal.SIGCONT if how == "SIGCONT" else signal.SIGKILL)
        named = NAMED if self._stall_records() != before else UNNAMED
        return f"SIGSTOP Train worker {pid} for {waited:.0f} s ({named}), then {how}"

    def _stall_records(self) -> set[Path]:
        return set(self.experiment.glob(f"train/train-*/{STALLS_DIR}/*.json"))

    def storage_readonly(self, seconds: float = 10.0) -> str | None:
        runs = sorted(self.experiment.glob("train/train-*"), key=lambda p: p.stat().st_mtime)
        if not runs or self._training_worker() is None:
            return None  # no trial training: its checkpoints would not meet the fault
        run = runs[-1]  # the newest: the one running
        if subprocess.run(["chattr", "+i", str(run)], capture_output=True).returncode:
            return ""  # chattr not permitted here: the fault is not injected (and not counted)
        try:
            time.sleep(seconds)
        finally:
            subprocess.run(["chattr", "-i", str(run)], capture_output=True)
        return f"{run.name} immutable for {seconds:g} s"

    def kill_driver(self) -> str | None:
        self.driver.kill()
        time.sleep(1.0)
        self.driver.start(resume=True)
        return "sweep driver SIGKILLed, restarted with --resume latest"

    def reboot_head(self) -> str | None:
        self.driver.kill()
        went = time.time()
        self.on_main_thread(self.cluster.reboot)
        self.driver.address = self.cluster.address
        self.driver.boot(self.experiment.parent)
        return (f"sweep driver SIGKILLed, every Ray process ended, the cluster back in {time.time() - went:.0f} s, "
                "the sweep continued by the boot service's step")


def trace_steps(trace: Path) -> list[int]:
    """Rank 0's traced global steps (``RAYMCN_TRACE``), in the order it ran them."""
    return [row["step"] for row in harness.read_jsonl(trace / "rank0.jsonl")]


def steps_replayed(trace: Path, faults: list[dict]) -> list[int]:
    """Per fault of ``faults`` (in order, each with its ``trace_at``), the steps run again because of it.

    The trials run one at a time, so rank 0's trace (``trace/rank0.jsonl``) is their steps in
    order: each step one more than the last, except where a trial begins (step 0 after the last
    step of a run) and where an attempt restarted from a checkpoint (a step that was run before:
    the steps from there to the last one traced are lost). Each restart is charged to the first
    fault struck when the trace was where the restart begins (``trace_at`` equal to the restart's
    line), else to the last fault before it; a fault charged with none cost no step."""
    steps = trace_steps(trace)
    last = max(steps)
    lost = [0] * len(faults)
    for i in range(1, len(steps)):
        if steps[i] > steps[i - 1] or (steps[i] == 0 and steps[i - 1] == last):
            continue
        at = [k for k, f in enumerate(faults) if f["trace_at"] == i] or \
            [k for k, f in enumerate(faults) if f["trace_at"] < i][-1:]
        if at:
            lost[at[0]] += steps[i - 1] - steps[i] + 1
    return lost


def epoch_metrics(experiment: Path) -> dict[tuple, list[dict]]:
    """(stage order, lr) -> the trial's metrics.csv rows, timing columns left out."""
    out = {}
    for run in experiment.glob("train/train-*"):
        c = yaml.safe_load((run / RUN_CONFIG_FILE).read_text())
        key = (c["schedule"]["stage_order"], float(c["optim"]["lr"]))
        with open(run / "metrics.csv") as f:
            rows = [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in csv.DictReader(f)]
        out[key] = rows
    return out


def answer_line(experiment: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "raymcn.cli", "table", str(experiment)], capture_output=True,
                         text=True).stdout
    return next((ln for ln in out.splitlines() if ln.lower().startswith(("answer", "best"))), out[-400:])


def run_sweep(cluster, tmp: Path, settings: list[str], faults: int = 0, seed: int = 0, mean_gap_s: float = 20.0,
              timeout_s: float = 1800.0) -> dict:
    """One sweep on ``cluster`` with ``faults`` faults injected; returns its experiment folder, the
    faults, the driver's restarts and its wall time."""
    trace = tmp / "trace" if faults else None  # what each fault cost, in steps
    driver = Driver(cluster.address, [*settings, "run.name=chaos"], tmp / "driver.log",
                    env={"RAYMCN_TRACE": str(trace)} if trace else {})
    experiment = tmp / "chaos"
    cfg = load_config(preset_path(), settings)  # the sweep's settings, as its driver reads them
    steps = cfg.steps_per_epoch(cfg.data.synthetic_videos) * cfg.schedule.epochs
    chaos = Chaos(cluster, driver, experiment, seed, stall_timeout_s=cfg.run.stall_timeout_s,
                  mean_gap_s=mean_gap_s, trace=trace, last_step=steps - 1)
    stop = threading.Event()
    injector = threading.Thread(target=chaos.run, args=(faults, stop), daemon=True)
    started = time.time()
    driver.start()
    injector.start()
    logged = -30.0
    try:
        while time.time() - started < timeout_s:
            if chaos.serve():
                continue
            if chaos.lock.acquire(blocking=False):
                finished = driver.done()
                chaos.lock.release()
                if finished:
                    break
            if time.time() - logged >= 30:  # what the cluster had free, for a sweep that waits
                import ray

                logged = time.time()
                with open(tmp / "resources.log", "a") as f:
                    f.write(f"{logged - started:.0f} s: free {ray.available_resources()}\n")
        else:
            raise TimeoutError(f"the sweep did not end within {timeout_s:g} s (log: {driver.log})")
    finally:
        stop.set()
        while injector.is_alive():
            chaos.serve()
    if chaos.error is not None:
        raise RuntimeError("the fault injector failed") from chaos.error
    if driver.proc.returncode != 0:
        raise RuntimeError(f"the sweep failed: {driver.log}\n{driver.log.read_text()[-3000:]}")
    if trace is not None:
        for fault, lost in zip(chaos.injected, steps_replayed(trace, chaos.injected)):
            fault["steps_lost"] = lost
    return {"experiment": experiment, "faults": chaos.injected, "driver_starts": driver.starts,
            "seconds": time.time() - started, "log": driver.log}


def compare(quiet: Path, loud: Path) -> list[str]:
    """The differences between two sweeps' trials (empty: the same table)."""
    a, b = epoch_metrics(quiet), epoch_metrics(loud)
    problems = []
    if sorted(a) != sorted(b):
        problems.append(f"trials differ: {sorted(a)} vs {sorted(b)}")
    for key in sorted(set(a) & set(b)):
        if a[key] != b[key]:
            diff = [(r1.get("epoch"), k, r1[k], r2.get(k)) for r1, r2 in zip(a[key], b[key]) for k in r1
                    if r1[k] != r2.get(k)]
            problems.append(f"trial {key}: {len(a[key])} vs {len(b[key])} epochs; first differences {diff[:3]}")
    return problems


def build_parser():
    ap = harness.parser(__doc__, smoke=f"the short soak of tests/test_chaos.py: {SMOKE}")
    ap.add_argument("--faults", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--gap", type=float, default=15.0, help="mean seconds between faults")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    orders = ("AV_T", "VT_A", "joint")
    if args.smoke:
        args.faults, args.epochs, orders, args.seed, args.gap = (SMOKE[k] for k in ("faults", "epochs", "orders",
                                                                                     "seed", "gap"))
    import tempfile

    with tempfile.TemporaryDirectory(prefix="raymcn-chaos-") as tmp, \
            multinode_cluster(*[NODE] * 3) as cluster, harness.Results("chaos", args) as results:
        settings = chaos_settings(Path(tmp), epochs=args.epochs, orders=orders)
        quiet = run_sweep(cluster, Path(tmp) / "quiet", [*settings[:-1], f"run.storage_path={tmp}/quiet"])
        results.save(quiet_s=quiet["seconds"])
        loud = run_sweep(cluster, Path(tmp) / "loud", [*settings[:-1], f"run.storage_path={tmp}/loud"],
                         faults=args.faults, seed=args.seed, mean_gap_s=args.gap, timeout_s=7200)
        problems = compare(quiet["experiment"], loud["experiment"])
        same_answer = answer_line(quiet["experiment"]) == answer_line(loud["experiment"])
        per_kind = {k: sum(f["kind"] == k for f in loud["faults"]) for k in KINDS}
        lost = (loud["seconds"] - quiet["seconds"]) / max(1, len(loud["faults"]))
        # every restart of a trial's worker group, as Ray Train's failure policy logs it
        console = (loud["experiment"] / "raymcn_console.log").read_text()
        restarts = console.count("[FailurePolicy] RETRY")
        # rank 0's line when it learns of a drain (ray's log relay may repeat a line: counted once)
        answered = len({line for line in console.splitlines() if "is being drained" in line})
        # ... and when Ray Train has registered its checkpoint, so the server may go before the deadline
        registered = len({line for line in console.splitlines() if "the drain's checkpoint (global step" in line})
        print(f"bench.chaos on {results.machine}: {len(epoch_metrics(quiet['experiment']))} trials x {args.epochs} "
              f"epochs, run.checkpoint_every=2 steps")
        print(f"faults injected: {len(loud['faults'])} ({', '.join(f'{k} {n}' for k, n in per_kind.items())}); "
              f"worker-group restarts {restarts}; driver starts {loud['driver_starts']}")
        stops = [f["detail"] for f in loud["faults"] if f["kind"] == "stall_rank"]
        print(f"SIGSTOPped ranks named by a stall record: {sum(f'({NAMED})' in d for d in stops)} of {len(stops)}; "
              f"drains answered by a checkpoint at once: {answered} of {per_kind['drain_node']} (none when the "
              f"drained trial was still starting), {registered} of them registered before the deadline")
        cost = {k: [f["steps_lost"] for f in loud["faults"] if f["kind"] == k] for k in KINDS}
        print("steps lost (run again after a restart), per fault: " + "; ".join(
            f"{k} {', '.join(map(str, v)) or '-'}" for k, v in cost.items()))
        planned, unplanned = ([n for k in kinds for n in cost[k]] for kinds in (PLANNED, UNPLANNED))
        print(f"a server's reboot: planned (drained first) at most {max(planned, default=0)} step(s) lost in "
              f"{len(planned)}; unplanned (node lost, head rebooted) at most {max(unplanned, default=0)} in "
              f"{len(unplanned)} (run.checkpoint_every=2 steps)")
        print(f"wall time: quiet {quiet['seconds']:.0f} s, under faults {loud['seconds']:.0f} s: "
              f"{lost:.1f} s lost per fault")
        print(f"per-epoch metrics of every trial equal bitwise: {not problems}; same answer line: {same_answer}")
        for p in problems:
            print("  " + p)
        results.finish({"machine": results.machine, "faults": loud["faults"], "per_kind": per_kind,
                        "restarts": restarts, "drains_answered": answered, "drains_registered": registered,
                        "steps_lost": cost, "quiet_s": quiet["seconds"], "loud_s": loud["seconds"],
                        "lost_per_fault_s": lost, "differences": problems, "same_answer": same_answer})
    return 0 if not problems and same_answer else 1


if __name__ == "__main__":
    sys.exit(main())
