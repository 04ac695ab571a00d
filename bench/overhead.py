"""Ray Train overhead: raymcn on Ray Train vs the same training under bare ``torch.distributed``.

    python bench/overhead.py                     # 3 repeats x 4 epochs per path, 2 workers (~5 min, 2 cores)
    python bench/overhead.py --quick             # 1 repeat x 3 epochs (~1.5 min)
    python bench/overhead.py --workers 1 --pin   # 1 rank pinned to core 0, everything else on the other cores
    python bench/overhead.py --json              # the tables, then one JSON line with every figure

What runs, N gloo workers on CPU in both paths (``--workers``, default 2), same model, data, seeds
and step count:

(a) **raymcn**: ``raymcn.train.launch.fit(cfg)`` on a fresh ``ray.init(address="local", num_cpus=N+1)``,
    ``cfg`` = the embedded default preset with ``scale.num_workers=N``, ``scale.cpus_per_worker=1``
    (plus ``--set`` overrides). The extra logical CPU is for raymcn's Ray Data shard reader
    (``launch.data_cpus``): with only 2 logical CPUs both are reserved by the Train workers and the
    read tasks starve (measured: 110 s before the first batch, then a failed health check).
    Everything raymcn does per epoch runs (Ray Data shard reading, evaluation, checkpoint,
    ``ray.train.report``); only the training steps are timed for throughput (below), and the time
    the loop waits for Ray Data batches *is* inside them (``train_one_epoch``'s "data" phase).
(b) **bare DDP**: this file relaunched as ``python -m torch.distributed.run --standalone
    --nproc_per_node=N bench/overhead.py --_ddp_child ...``: ``init_process_group("gloo")``, the
    same ``MCN`` (seeded like the worker), ``DistributedDataParallel(find_unused_parameters=False,
    gradient_as_bucket_view=True)``, ``MCNObjective``, optimizer and LR schedule, and
    ``train_one_epoch`` over ``TrainVideos.batches(cfg, epoch, rank, N, steps)`` for the same epochs.
    The data are the same synthetic corpus (same videos, batch size, clips per video, steps per
    epoch), held in memory by ``raymcn.data.memory.TrainVideos`` instead of read from the shards
    through Ray Data; the clips drawn differ, the shapes and amount of work do not. No evaluation,
    no checkpoints, no reporting.

Measurement: in both paths every rank's ``train_one_epoch`` call is wrapped (in the Ray workers by
patching ``raymcn.train.worker.train_one_epoch`` from a wrapper around ``train_func_per_worker``)
to record the wall-clock start and end of the epoch, the loop's own ``samples_per_s`` (clips of the
rank / time of its training steps; evaluation and checkpointing are outside it), its per-phase
times and the wait for every batch. Job samples/s of an epoch = the sum over the ranks; **steady**
= mean over the epochs after the first (warm-up: Adam state, first k-means fit, allocator growth),
then the median over ``--repeats``. **startup** = from just before ``ray.init`` (a) / spawning
torchrun (b) to the first training step of the first epoch (rank 0): Ray start, trainer and
worker-group setup, Ray Data dataset, process group, corpus load, model build. The corpus and its
shards are generated into the cache before any timing.

Where the time goes (second and third table): rank 0's milliseconds per step in the steady epochs
(the wait for the epoch's first batch, the wait for each later batch, forward, loss, backward with
DDP's all-reduce, optimizer), and the CPU every process used during the steady epochs, read from
``/proc`` twice a second (Linux) and grouped: the training ranks, Ray Data's read tasks, its split
coordinator and stats actor, Ray Train's control actors, Ray's daemons (raylet, GCS, dashboard,
agents), everything else. On a machine with as many cores as ranks, every CPU-second of the
others is taken from the ranks. ``--pin`` separates the two: rank r runs on core r only (all its
threads), everything else on the cores above N (needs more cores than ranks).

Threads: Ray gives each 1-CPU worker ``OMP_NUM_THREADS=1``; the thread count torch actually uses
in the Ray workers (recorded, printed) is given to the torchrun children (``OMP_NUM_THREADS`` and
``torch.set_num_threads``), so both paths compute with the same threads. The raymcn path runs
first in every repeat; the paths alternate afterwards (ray, bare, ray, bare, ...).

Target (issue): raymcn steady samples/s >= 0.95 x bare DDP. Startup is reported separately.

Load caveat: wall-clock figures on a shared machine; re-measure on a quiet one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout works without installing raymcn

TARGET = 0.95
RECORD_DIR_ENV = "RAYMCN_BENCH_RECORD_DIR"  # RAYMCN_* reaches the Ray workers (launch.build_trainer)
PIN_ENV = "RAYMCN_BENCH_PIN"  # "1": each rank pins itself to core <rank>


def raymcn_steps(cfg) -> int:
    """Steps per epoch of the raymcn path (its shard manifest), checked against the in-memory corpus."""
    from raymcn.data import reader, shards

    return reader.steps_per_epoch(reader.load_manifest(shards.shards_dir_for(cfg)), cfg)


def make_config(workers: int, epochs: int, overrides: list[str]):
    from raymcn.cli import preset_path
    from raymcn.config import load_config

    return load_config(preset_path(), [f"scale.num_workers={workers}", "scale.cpus_per_worker=1",
                                       f"schedule.epochs={epochs}", *overrides])


def pin_process(cpus: set[int]) -> None:
    """Pin every thread of this process to ``cpus``: ``sched_setaffinity(0)`` moves only the calling
    thread, and gloo's and Ray's threads already exist when a rank's code starts."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread may end meanwhile
            os.sched_setaffinity(int(tid), cpus)


# --- CPU of every process (Linux /proc) --------------------------------------------------------------
CPU_GROUPS = (  # (group, substrings of the process's command line); first match wins
    ("training ranks", ("ray::RayTrainWorker", "--_ddp_child")),
    ("Ray Data read tasks", ("ray::Read", "ray::IDLE")),
    ("Ray Data split coordinator + stats", ("ray::SplitCoordinator", "ray::_StatsActor", "ray::DatasetManager")),
    ("Ray Train control actors", ("ray::TrainController", "ray::SynchronizationActor", "ray::PlacementGroupCleaner",
                                  "ray::PreemptionWatcher", "ray::_AutoscalingCoordinatorActor")),
    ("Ray daemons (raylet, GCS, dashboard, agents)", ("/ray/core/src/", "ray/dashboard/", "ray/_private/",
                                                       "ray::DashboardAgent", "ray::IDLE_SpillWorker")),
)
OTHER_GROUP = "everything else (bench driver, torchrun agent, system)"


class CpuMeter:
    """Samples the CPU time of every process from /proc in a background thread (Linux only)."""

    def __init__(self, every_s: float = 0.5):
        self.available = os.path.isdir("/proc/self/task")
        self._every, self._samples, self._stop = every_s, [], threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK") if self.available else 100
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuMeter:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.available:
            self._thread.join()

    def _run(self) -> None:
        while True:
            self._samples.append((time.time(), self._snapshot()))
            if self._stop.wait(self._every):
                self._samples.append((time.time(), self._snapshot()))
                return

    def _snapshot(self) -> dict[int, tuple[str, float]]:
        out = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
                with open(f"/proc/{pid}/cmdline") as f:
                    cmd = f.read().replace("\0", " ")
            except OSError:  # the process ended meanwhile
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # utime, stime are fields 14, 15 of stat
            out[int(pid)] = (cmd or stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / self._tick)
        return out

    def usage(self, t0: float, t1: float) -> dict:
        """CPU-seconds per group between the samples around wall times t0 and t1, and the window."""
        before = max((s for s in self._samples if s[0] <= t0), default=None, key=lambda s: s[0])
        after = min((s for s in self._samples if s[0] >= t1), default=None, key=lambda s: s[0])
        if before is None or after is None:
            return {}
        groups = dict.fromkeys([g for g, _ in CPU_GROUPS] + [OTHER_GROUP], 0.0)
        for pid, (cmd, cpu) in after[1].items():
            spent = cpu - before[1].get(pid, (cmd, 0.0))[1]
            group = next((g for g, keys in CPU_GROUPS if any(k in cmd for k in keys)), OTHER_GROUP)
            groups[group] += max(0.0, spent)
        return {"window_s": after[0] - before[0], "cpu_s": groups}


# --- per-epoch recording (both paths) --------------------------------------------------------------
PHASES = ("forward", "loss", "backward", "optimizer")  # the loop's timed phases after the data wait


def timed_train_one_epoch(record_dir: str, path: str):
    """``train_one_epoch`` that appends, per call, the epoch's wall-clock start and end, its
    samples/s, the loop's per-phase means and the wait for each batch."""
    import torch

    from raymcn.losses.gather import world_info
    from raymcn.train.loop import train_one_epoch

    def timed(batches, waits: list[float]):
        it = iter(batches)
        while True:
            t = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            waits.append(time.perf_counter() - t)
            yield batch

    def wrapped(model, objective, optimizer, scheduler, batches, **kwargs):
        rank, _ = world_info()
        waits: list[float] = []
        start = time.time()
        metrics = train_one_epoch(model, objective, optimizer, scheduler, timed(batches, waits), **kwargs)
        rec = {"rank": rank, "start": start, "end": time.time(), "samples_per_s": metrics["samples_per_s"],
               "steps": metrics["steps"], "batch_waits_s": waits,
               "phases_s": {p: metrics[f"time_{p}_s"] for p in PHASES},
               "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}
        with open(Path(record_dir) / f"{path}_rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        return metrics

    return wrapped


def bench_train_func(loop_config: dict):
    """Ray Train entry point: raymcn's ``train_func_per_worker`` with the epoch timing patched in."""
    import ray.train

    import raymcn.train.worker as worker

    if os.environ.get(PIN_ENV) == "1":
        pin_process({ray.train.get_context().get_world_rank()})
    worker.train_one_epoch = timed_train_one_epoch(os.environ[RECORD_DIR_ENV], "raymcn")
    return worker.train_func_per_worker(loop_config)


def read_records(record_dir: Path, path: str, workers: int) -> list[list[dict]]:
    """Per rank, the epoch records in order."""
    out = []
    for rank in range(workers):
        f = record_dir / f"{path}_rank{rank}.jsonl"
        out.append([json.loads(line) for line in f.read_text().splitlines()] if f.exists() else [])
    return out


def summarise(records: list[list[dict]], t0: float, t_end: float, epochs: int, meter: CpuMeter) -> dict:
    """Throughput, startup, rank 0's per-step breakdown and every process's CPU over the steady epochs."""
    if any(len(r) != epochs for r in records):
        raise RuntimeError(f"expected {epochs} epoch records per rank, got {[len(r) for r in records]}")
    job = [sum(r[e]["samples_per_s"] for r in records) for e in range(epochs)]
    steady = slice(1, None) if epochs > 1 else slice(None)
    rank0 = records[0][steady]
    ms = {"first batch wait (per epoch)": statistics.fmean(r["batch_waits_s"][0] for r in rank0) * 1e3,
          "later batch wait": statistics.fmean(w for r in rank0 for w in r["batch_waits_s"][1:]) * 1e3}
    for p in PHASES:
        ms[p] = statistics.fmean(r["phases_s"][p] for r in rank0) * 1e3
    usage = meter.usage(rank0[0]["start"], rank0[-1]["end"])
    cpu = {g: 100 * v / usage["window_s"] for g, v in usage["cpu_s"].items()} if usage else {}
    return {"startup_s": records[0][0]["start"] - t0, "wall_s": t_end - t0,
            "steady_samples_per_s": statistics.fmean(job[steady]), "epoch_samples_per_s": job,
            "step_ms": ms, "cpu_percent_of_one_core": cpu,
            "threads": records[0][0]["threads"], "omp_num_threads": records[0][0]["omp"]}


# --- (a) raymcn on Ray Train -----------------------------------------------------------------------
def run_raymcn(cfg, record_dir: Path, storage: Path, args) -> dict:
    import ray

    import raymcn.train.launch as launch

    os.environ[RECORD_DIR_ENV] = str(record_dir)
    launch.train_func_per_worker = bench_train_func  # build_trainer looks the name up at call time
    with CpuMeter() as meter:
        t0 = time.time()
        # Ray's processes inherit the driver's affinity (--pin: the cores above the ranks'); each
        # Train worker then moves itself to its rank's core.
        ray.init(address="local", num_cpus=args.workers + 1, include_dashboard=False, log_to_driver=args.verbose)
        try:
            launch.fit(cfg, name=f"overhead-{record_dir.name}", storage_path=storage)
            t_end = time.time()
        finally:
            ray.shutdown()
    return summarise(read_records(record_dir, "raymcn", args.workers), t0, t_end, cfg.schedule.epochs, meter)


# --- (b) bare torch.distributed under torchrun -----------------------------------------------------
def run_bare(args, threads: int, record_dir: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop(RECORD_DIR_ENV, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.workers}",
           str(Path(__file__).resolve()), "--_ddp_child", "--workers", str(args.workers), "--epochs", str(args.epochs),
           "--threads", str(threads), "--record-dir", str(record_dir)]
    for o in args.overrides:
        cmd += ["--set", o]
    with CpuMeter() as meter:
        t0 = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=not args.verbose, text=True)
        t_end = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stdout or ''}\n{proc.stderr or ''}")
    return summarise(read_records(record_dir, "bare", args.workers), t0, t_end, args.epochs, meter)


def ddp_child(args) -> int:
    """One torchrun rank: raymcn's model, loss, optimizer and loop under plain DDP, no Ray."""
    import torch
    import torch.distributed as dist

    from raymcn.data.memory import TrainVideos
    from raymcn.losses import MCNObjective
    from raymcn.model import MCN
    from raymcn.train.loop import LoopState, build_optimizer, build_scheduler
    from raymcn.train.stages import switch_step

    if os.environ.get(PIN_ENV) == "1":
        pin_process({int(os.environ["RANK"])})
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    try:
        cfg = make_config(args.workers, args.epochs, args.overrides)
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device("cpu")
        videos = TrainVideos.load(cfg)
        steps = raymcn_steps(cfg)
        if steps > videos.steps_per_epoch(cfg):
            raise RuntimeError(f"raymcn runs {steps} steps per epoch; the in-memory corpus fills only "
                               f"{videos.steps_per_epoch(cfg)}")
        total_steps = steps * cfg.schedule.epochs
        switch = switch_step(cfg.schedule.stage_order, cfg.schedule.stage1_fraction, total_steps)
        torch.manual_seed(cfg.run.seed)
        model = torch.nn.parallel.DistributedDataParallel(
            MCN(cfg.model), find_unused_parameters=False, gradient_as_bucket_view=True)
        optimizer = build_optimizer(model, cfg)
        scheduler = build_scheduler(optimizer, cfg, total_steps)
        objective = MCNObjective(cfg, cfg.model.embed_dim, device)
        state = LoopState()
        epoch_fn = timed_train_one_epoch(args.record_dir, "bare")
        for epoch in range(cfg.schedule.epochs):
            state.epoch = epoch
            batches = videos.batches(cfg, epoch=epoch, rank=rank, world_size=world, steps=steps)
            epoch_fn(model, objective, optimizer, scheduler, batches, cfg=cfg, state=state, device=device,
                     switch=switch, log=None, total_steps=total_steps)
            state.epoch = epoch + 1
    finally:
        dist.destroy_process_group()
    return 0


# --- driver ----------------------------------------------------------------------------------------
def _table(head: tuple[str, ...], rows: list[tuple]) -> str:
    lines = [" | ".join(head), " | ".join("-" * len(h) for h in head)]
    lines += [" | ".join(str(c) for c in row) for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4, help="epochs per run; the first is warm-up (default 4)")
    p.add_argument("--workers", type=int, default=2, help="training ranks in both paths (default 2)")
    p.add_argument("--pin", action="store_true",
                   help="rank r on core r only, everything else on the cores above the ranks' (Linux)")
    p.add_argument("--quick", action="store_true", help="1 repeat, 3 epochs")
    p.add_argument("--json", action="store_true", help="print one JSON line with every figure last")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for both paths (repeatable)")
    p.add_argument("--threads", type=int, help="torch threads of the bare-DDP ranks (default: the Ray workers')")
    p.add_argument("--verbose", action="store_true", help="show Ray worker logs and torchrun output")
    p.add_argument("--_ddp_child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--record-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._ddp_child:
        return ddp_child(args)
    if args.quick:
        args.repeats, args.epochs = 1, 3
    if args.epochs < 2:
        p.error("--epochs must be >= 2 (the first epoch is warm-up)")
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if args.pin and len(cores) <= args.workers:
        p.error(f"--pin needs more cores than ranks: {len(cores)} core(s) for {args.workers} rank(s) "
                f"(try --workers {max(1, len(cores) - 1)})")
    if args.pin:  # this driver, torchrun's agent and every Ray process on the cores the ranks leave
        os.environ[PIN_ENV] = "1"
        os.sched_setaffinity(0, set(cores[args.workers:]))

    cfg = make_config(args.workers, args.epochs, args.overrides)
    from raymcn.data import shards
    from raymcn.data.memory import TrainVideos

    videos = TrainVideos.load(cfg)  # generate / read the cached corpus once, before any timing
    shards.shards_dir_for(cfg)  # and raymcn's shards of it
    steps = raymcn_steps(cfg)
    if steps > videos.steps_per_epoch(cfg):
        p.error(f"raymcn runs {steps} steps per epoch; the in-memory corpus fills only {videos.steps_per_epoch(cfg)}")
    placement = (f"rank r pinned to core r, everything else on cores {cores[args.workers:]}" if args.pin
                 else f"ranks and everything else sharing {len(cores) or os.cpu_count()} core(s)")
    print(f"config: default preset, {args.workers} workers x 1 CPU (Ray: {args.workers + 1} logical CPUs), "
          f"{placement}; {args.epochs} epochs x {steps} steps, {cfg.data.batch_size} videos x "
          f"{cfg.data.clips_per_video} clips per step, stage_order={cfg.schedule.stage_order}; "
          f"{args.repeats} repeat(s)", flush=True)

    runs: dict[str, list[dict]] = {"raymcn": [], "bare": []}
    threads = args.threads
    t_bench = time.time()
    with tempfile.TemporaryDirectory(prefix="raymcn-overhead-") as tmp:
        for rep in range(args.repeats):
            order = ("raymcn", "bare") if rep % 2 == 0 else ("bare", "raymcn")
            for path in order:
                record_dir = Path(tmp) / f"{path}{rep}"
                record_dir.mkdir()
                if path == "raymcn":
                    r = run_raymcn(cfg, record_dir, Path(tmp) / "results", args)
                    if threads is None:
                        threads = r["threads"]
                        print(f"Ray workers: torch threads {r['threads']}, OMP_NUM_THREADS="
                              f"{r['omp_num_threads']}; bare DDP ranks get {threads} thread(s)", flush=True)
                else:
                    r = run_bare(args, threads, record_dir)
                runs[path].append(r)
                print(f"repeat {rep + 1} {path:6s}: startup {r['startup_s']:.1f} s, steady "
                      f"{r['steady_samples_per_s']:.1f} samples/s (epochs: "
                      f"{', '.join(f'{x:.0f}' for x in r['epoch_samples_per_s'])}), wall {r['wall_s']:.1f} s",
                      flush=True)
    total = time.time() - t_bench

    def median(path: str, get) -> float:
        return statistics.median(get(r) for r in runs[path])

    med = {path: {k: median(path, lambda r, k=k: r[k]) for k in ("startup_s", "steady_samples_per_s", "wall_s")}
           for path in runs}
    ratio = med["raymcn"]["steady_samples_per_s"] / med["bare"]["steady_samples_per_s"]
    startup_extra = med["raymcn"]["startup_s"] - med["bare"]["startup_s"]
    print(f"\nmedian of {args.repeats} repeat(s); samples/s per job (all ranks), epochs 2..{args.epochs}")
    print(_table(("path", "startup s", "steady samples/s", "ratio"),
                 [(path, f"{med[path]['startup_s']:.1f}", f"{med[path]['steady_samples_per_s']:.1f}",
                   f"{med[path]['steady_samples_per_s'] / med['bare']['steady_samples_per_s']:.3f}")
                  for path in ("bare", "raymcn")]))
    verdict = "meets" if ratio >= TARGET else "misses"
    print(f"raymcn/bare steady ratio {ratio:.3f}: {verdict} the target >= {TARGET}; "
          f"raymcn startup +{startup_extra:.1f} s over torchrun; bench time {total:.0f} s")

    step_ms = {path: {k: median(path, lambda r, k=k: r["step_ms"][k]) for k in runs[path][0]["step_ms"]}
               for path in runs}
    print("\nwhere the time goes: rank 0, ms per step, steady epochs (median over repeats)")
    print(_table(("phase", "bare", "raymcn", "raymcn - bare"),
                 [(k, f"{step_ms['bare'][k]:.1f}", f"{step_ms['raymcn'][k]:.1f}",
                   f"{step_ms['raymcn'][k] - step_ms['bare'][k]:+.1f}") for k in step_ms["bare"]]))
    cpu = {}
    if all(r["cpu_percent_of_one_core"] for rs in runs.values() for r in rs):
        cpu = {path: {g: median(path, lambda r, g=g: r["cpu_percent_of_one_core"][g])
                      for g in runs[path][0]["cpu_percent_of_one_core"]} for path in runs}
        print("\nCPU used during the steady epochs, % of one core (median over repeats)")
        print(_table(("processes", "bare", "raymcn"),
                     [(g, f"{cpu['bare'][g]:.1f}", f"{cpu['raymcn'][g]:.1f}") for g in cpu["bare"]]
                     + [("all", f"{sum(cpu['bare'].values()):.1f}", f"{sum(cpu['raymcn'].values()):.1f}")]))
    if args.json:
        print(json.dumps({
            "workers": args.workers, "pinned": args.pin, "epochs": args.epochs, "steps_per_epoch": steps,
            "repeats": args.repeats, "threads": threads, "target": TARGET,
            "raymcn_steady_samples_per_s": med["raymcn"]["steady_samples_per_s"],
            "bare_steady_samples_per_s": med["bare"]["steady_samples_per_s"],
            "steady_ratio": ratio, "meets_target": ratio >= TARGET,
            "raymcn_startup_s": med["raymcn"]["startup_s"], "bare_startup_s": med["bare"]["startup_s"],
            "startup_extra_s": startup_extra, "startup_ratio": med["raymcn"]["startup_s"] / med["bare"]["startup_s"],
            "raymcn_wall_s": med["raymcn"]["wall_s"], "bare_wall_s": med["bare"]["wall_s"],
            "step_ms": step_ms, "cpu_percent_of_one_core": cpu, "runs": runs, "bench_s": total}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
