"""Ray Train overhead: raymcn on Ray Train vs the same training under bare ``torch.distributed``.

    python bench/overhead.py                     # 3 repeats x 4 epochs per path, 2 workers (~5 min, 2 cores)
    python bench/overhead.py --quick             # 1 repeat x 3 epochs (~1.5 min)
    python bench/overhead.py --workers 1 --pin   # 1 rank pinned to core 0, everything else on the other cores
    python bench/overhead.py --json              # the tables, then one JSON line with every figure

What runs, N gloo workers on CPU in both paths (``--workers``, default 2), same model, data, seeds
and step count:

(a) **raymcn**: ``raymcn.train.on_ray.launch.fit(cfg)`` on a fresh ``ray.init(address="local", num_cpus=N+1)``,
    ``cfg`` = the embedded default preset with ``scale.num_workers=N``, ``scale.cpus_per_worker=1``
    (plus ``--set`` overrides). The extra logical CPU keeps the comparison with the earlier
    figures (measured when the read tasks reserved a CPU; they now reserve none).
    Everything raymcn does per epoch runs (Ray Data shard reading, evaluation, checkpoint,
    ``ray.train.report``); only the training steps are timed for throughput (below), and the time
    the loop waits for Ray Data batches *is* inside them (``train_one_epoch``'s "data" phase).
(b) **bare DDP**: this file relaunched as ``python -m torch.distributed.run --standalone
    --nproc_per_node=N bench/overhead.py --_ddp_child ...``: ``init_process_group("gloo")``, then
    the run as the Ray worker assembles it (``raymcn.train.build.assemble``, seeded the same) with
    ``DistributedDataParallel(find_unused_parameters=False, gradient_as_bucket_view=True)`` as the
    wrap, and ``run_epochs`` over ``TrainVideos.batches(...)`` for the same epochs. The data are the
    same synthetic corpus (same videos, batch size, clips per video, steps per epoch), held in
    memory by ``raymcn.data.read.stream.TrainVideos`` instead of read from the shards through Ray Data;
    the clips drawn differ, the shapes and amount of work do not. No evaluation, no checkpoints,
    no reporting.

Measurement, with nothing patched: both paths report every epoch's metrics of the loop itself,
averaged over the ranks: ``samples_per_s`` (clips of a rank / the time of its training steps;
evaluation and checkpointing are outside it), the per-phase times per step, ``time_first_batch_s``
(the wait for the epoch's first batch), ``time_epoch_s`` and, in the Ray path, ``time_eval_s``.
The Ray path's records come from a Ray Train callback (``after_report``, in the controller on
this machine), the bare path's from the run assembly's ``after_epoch`` hook. Job samples/s of an
epoch = the rank mean × N; **steady** = mean over the epochs after the first (warm-up: Adam state,
first k-means fit, allocator growth), then the median over ``--repeats``. **startup** = from just
before ``ray.init`` (a) / spawning torchrun (b) to the start of the first epoch's steps (its
report time less its steps, its evaluation and, in (a), the checkpoint write, which is not
subtracted: a slight over-estimate): Ray start, trainer and worker-group setup, Ray Data dataset,
process group, corpus load, model build. The corpus and its shards are generated into the cache
before any timing.

Where the time goes (second and third table): the ranks' mean milliseconds per step in the steady
epochs (the wait for the epoch's first batch, the wait for each later batch, forward, loss,
backward with DDP's all-reduce, optimizer), and the CPU every process used during the steady
epochs (their evaluation, checkpoint and report included), read from ``/proc`` twice a second
(Linux) and grouped: the training ranks, Ray
Data's read tasks, its split coordinator and stats actor, Ray Train's control actors, Ray's
daemons (raylet, GCS, dashboard, agents), everything else. On a machine with as many cores as
ranks, every CPU-second of the others is taken from the ranks. ``--pin`` separates the two: each
rank runs on a core of its own (the Ray workers are pinned from outside, by this driver, as soon
as they exist), everything else on the cores above N (needs more cores than ranks).

(c) **raymcn-noprefetch**: (a) with ``data.prefetch_batches=0``, the loop before the batch pipeline:
    each batch is fetched from Ray Data in the training thread, between two steps, instead of by
    ``train/feed.py``'s thread while the step runs. The "wait for each later batch" row of (a) and
    (c) is the data time on the step's critical path with and without the pipeline.

Threads: Ray gives each 1-CPU worker ``OMP_NUM_THREADS=1``; the thread count torch uses in a Ray
task with the workers' resources (printed) is given to the torchrun children
(``OMP_NUM_THREADS`` and ``torch.set_num_threads``), so both paths compute with the same threads. The paths
run in the order raymcn, raymcn-noprefetch, bare in the first repeat, reversed in the second, and so on.

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
INLINE = "raymcn-noprefetch"  # data.prefetch_batches=0: each batch fetched in the step (the loop before prefetching)
PATHS = ("bare", "raymcn", INLINE)


def plan_of(cfg, videos: int):
    """The run plan of both paths over the corpus (the shards' manifest counts the same videos)."""
    from raymcn.train.plan import make_plan

    return make_plan(cfg, videos)


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


# --- per-epoch records (both paths) ---------------------------------------------------------------
PHASES = ("forward", "loss", "backward", "optimizer")  # the loop's timed phases after the data wait


def epoch_record(metrics: dict, t: float) -> dict:
    """What the summary needs of one epoch's reported metrics (rank means), reported at wall time t."""
    return {"reported": t, "samples_per_s": metrics["samples_per_s"], "steps": metrics["steps"],
            "time_epoch_s": metrics["time_epoch_s"], "time_eval_s": metrics.get("time_eval_s", 0.0),
            "time_first_batch_s": metrics["time_first_batch_s"], "time_data_s": metrics["time_data_s"],
            "phases_s": {p: metrics[f"time_{p}_s"] for p in PHASES}}


def recorder(path: Path):
    """A Ray Train callback appending each epoch's record to ``path`` (it runs in the controller)."""
    from ray.train.v2.api.callback import UserCallback

    class Record(UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            with open(path, "a") as f:
                f.write(json.dumps(epoch_record(metrics[0], time.time())) + "\n")

    return Record()


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def summarise(records: list[dict], workers: int, t0: float, t_end: float, epochs: int, meter: CpuMeter) -> dict:
    """Throughput, startup, the per-step breakdown and every process's CPU over the steady epochs' steps."""
    if len(records) != epochs:
        raise RuntimeError(f"expected {epochs} epoch records, got {len(records)}")
    job = [r["samples_per_s"] * workers for r in records]
    steady = slice(1, None) if epochs > 1 else slice(None)
    rows = records[steady]
    later = [(r["time_data_s"] * r["steps"] - r["time_first_batch_s"]) / max(1.0, r["steps"] - 1) for r in rows]
    ms = {"first batch wait (per epoch)": statistics.fmean(r["time_first_batch_s"] for r in rows) * 1e3,
          "later batch wait": statistics.fmean(later) * 1e3}
    for p in PHASES:
        ms[p] = statistics.fmean(r["phases_s"][p] for r in rows) * 1e3

    def started(r: dict) -> float:  # the epoch's first step, from its report
        return r["reported"] - r["time_eval_s"] - r["time_epoch_s"]

    # From the first steady epoch's first step to the last one's end (the evaluation, checkpoint
    # and report between them included, as the loop's own epochs run them)
    usage = meter.usage(started(rows[0]), started(rows[-1]) + rows[-1]["time_epoch_s"])
    cpu = {g: 100 * v / usage["window_s"] for g, v in usage["cpu_s"].items()} if usage else {}
    return {"startup_s": started(records[0]) - t0, "wall_s": t_end - t0,
            "steady_samples_per_s": statistics.fmean(job[steady]), "epoch_samples_per_s": job,
            "step_ms": ms, "cpu_percent_of_one_core": cpu}


def worker_threads(cfg) -> int:
    """torch's thread count in a Ray task with the resources of one Train worker."""
    import ray

    @ray.remote(num_cpus=cfg.scale.cpus_per_worker)
    def threads() -> int:
        import torch

        return torch.get_num_threads()

    return ray.get(threads.remote())


def pin_train_workers(cores: list[int], stop: threading.Event) -> None:
    """Pin each Ray Train worker process (all its threads) to a core of its own, from outside, as
    soon as it appears: a worker's rank does not matter for where it runs."""
    pinned: set[int] = set()
    while not stop.wait(0.2):
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) in pinned or len(pinned) >= len(cores):
                continue
            try:
                with open(f"/proc/{pid}/cmdline") as f:
                    if "ray::RayTrainWorker" not in f.read():
                        continue
                core = cores[len(pinned)]
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(int(tid), {core})
                pinned.add(int(pid))
            except OSError:  # gone meanwhile
                continue


# --- (a) raymcn on Ray Train -----------------------------------------------------------------------
def run_raymcn(cfg, record_dir: Path, storage: Path, args, cores: list[int]) -> dict:
    import ray

    import raymcn.train.on_ray.launch as launch

    stop = threading.Event()
    pinner = threading.Thread(target=pin_train_workers, args=(cores[:args.workers], stop), daemon=True)
    with CpuMeter() as meter:
        t0 = time.time()
        # Ray's processes inherit the driver's affinity (--pin: the cores above the ranks');
        # the Train workers are then moved to the ranks' cores.
        ray.init(address="local", num_cpus=args.workers + 1, include_dashboard=False, log_to_driver=args.verbose)
        if args.pin:
            pinner.start()
        try:
            threads = worker_threads(cfg)
            launch.fit(cfg, Path(storage) / f"overhead-{record_dir.name}",
                       callbacks=[recorder(record_dir / "raymcn.jsonl")])
            t_end = time.time()
        finally:
            stop.set()
            ray.shutdown()
    out = summarise(read_records(record_dir / "raymcn.jsonl"), args.workers, t0, t_end, cfg.schedule.epochs, meter)
    return {**out, "threads": threads}


# --- (b) bare torch.distributed under torchrun -----------------------------------------------------
def run_bare(args, threads: int, record_dir: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.workers}",
           str(Path(__file__).resolve()), "--_ddp_child", "--workers", str(args.workers), "--epochs", str(args.epochs),
           "--threads", str(threads), "--record-dir", str(record_dir)] + (["--pin"] if args.pin else [])
    for o in args.overrides:
        cmd += ["--set", o]
    with CpuMeter() as meter:
        t0 = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=not args.verbose, text=True)
        t_end = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stdout or ''}\n{proc.stderr or ''}")
    return summarise(read_records(record_dir / "bare.jsonl"), args.workers, t0, t_end, args.epochs, meter)


def ddp_child(args) -> int:
    """One torchrun rank: the run as the Ray worker assembles it, under plain DDP, no Ray."""
    import torch
    import torch.distributed as dist

    from raymcn.data import synthetic
    from raymcn.losses import Collectives
    from raymcn.train.build import EpochHooks, assemble, run_epochs

    if args.pin:
        pin_process({int(os.environ["RANK"])})
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    try:
        cfg = make_config(args.workers, args.epochs, args.overrides)
        comm = Collectives.from_process_group()
        videos = synthetic.train_videos(cfg)
        plan = plan_of(cfg, len(videos.records))
        run = assemble(cfg, plan, comm=comm, wrap=lambda net: torch.nn.parallel.DistributedDataParallel(
            net, find_unused_parameters=False, gradient_as_bucket_view=True))

        def record(run, metrics: dict) -> None:
            if comm.rank == 0:
                with open(Path(args.record_dir) / "bare.jsonl", "a") as f:
                    f.write(json.dumps(epoch_record(metrics, time.time())) + "\n")

        run_epochs(run, EpochHooks(batches=lambda epoch, start: (videos.batches(
            cfg, epoch, comm.rank, comm.world, plan.steps_per_epoch, start), None),
            after_epoch=record))
    finally:
        dist.destroy_process_group()
    return 0


# --- driver ----------------------------------------------------------------------------------------
def _table(head: tuple[str, ...], rows: list[tuple]) -> str:
    from raymcn.results.render import render_table

    return render_table([dict(zip(head, map(str, row))) for row in rows], right=head[1:])


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
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS,
                   help="what to run (default all): bare DDP, raymcn, and raymcn with data.prefetch_batches=0")
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
        os.sched_setaffinity(0, set(cores[args.workers:]))

    cfg = make_config(args.workers, args.epochs, args.overrides)
    configs = {"raymcn": cfg,
               INLINE: make_config(args.workers, args.epochs, [*args.overrides, "data.prefetch_batches=0"])}
    if "bare" not in args.paths or "raymcn" not in args.paths:
        p.error("--paths needs bare and raymcn (the ratio compares them)")
    from raymcn.data import synthetic
    from raymcn.train.inputs import resolve_inputs

    videos = synthetic.train_videos(cfg)  # generate / read the cached corpus once, before any timing
    steps = plan_of(cfg, resolve_inputs(cfg).videos).steps_per_epoch  # and raymcn's shards of it
    if steps != plan_of(cfg, len(videos.records)).steps_per_epoch:
        p.error(f"raymcn runs {steps} steps per epoch over its shards; the in-memory corpus gives "
                f"{plan_of(cfg, len(videos.records)).steps_per_epoch}")
    placement = (f"rank r pinned to core r, everything else on cores {cores[args.workers:]}" if args.pin
                 else f"ranks and everything else sharing {len(cores) or os.cpu_count()} core(s)")
    print(f"config: default preset, {args.workers} workers x 1 CPU (Ray: {args.workers + 1} logical CPUs), "
          f"{placement}; {args.epochs} epochs x {steps} steps, {cfg.data.batch_size} videos x "
          f"{cfg.data.clips_per_video} clips per step, stage_order={cfg.schedule.stage_order}; "
          f"{args.repeats} repeat(s)", flush=True)

    paths = [path for path in PATHS if path in args.paths]
    runs: dict[str, list[dict]] = {path: [] for path in paths}
    threads = args.threads
    t_bench = time.time()
    with tempfile.TemporaryDirectory(prefix="raymcn-overhead-") as tmp:
        for rep in range(args.repeats):
            order = [x for x in ("raymcn", INLINE, "bare") if x in paths]
            if rep % 2:
                order.reverse()
            for path in order:
                record_dir = Path(tmp) / f"{path}{rep}"
                record_dir.mkdir()
                if path != "bare":
                    r = run_raymcn(configs[path], record_dir, Path(tmp) / "results", args, cores)
                    if threads is None:
                        threads = r["threads"]
                        print(f"Ray workers: torch threads {r['threads']}; bare DDP ranks get {threads} thread(s)",
                              flush=True)
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
                  for path in paths]))
    verdict = "meets" if ratio >= TARGET else "misses"
    print(f"raymcn/bare steady ratio {ratio:.3f}: {verdict} the target >= {TARGET}; "
          f"raymcn startup +{startup_extra:.1f} s over torchrun; bench time {total:.0f} s")

    step_ms = {path: {k: median(path, lambda r, k=k: r["step_ms"][k]) for k in runs[path][0]["step_ms"]}
               for path in runs}
    print("\nwhere the time goes: the ranks' mean ms per step, steady epochs (median over repeats)")
    print(_table(("phase", *paths, "raymcn - bare"),
                 [(k, *(f"{step_ms[path][k]:.1f}" for path in paths),
                   f"{step_ms['raymcn'][k] - step_ms['bare'][k]:+.1f}") for k in step_ms["bare"]]))
    cpu = {}
    if all(r["cpu_percent_of_one_core"] for rs in runs.values() for r in rs):
        cpu = {path: {g: median(path, lambda r, g=g: r["cpu_percent_of_one_core"][g])
                      for g in runs[path][0]["cpu_percent_of_one_core"]} for path in runs}
        print("\nCPU used during the steady epochs, % of one core (median over repeats)")
        print(_table(("processes", *paths),
                     [(g, *(f"{cpu[path][g]:.1f}" for path in paths)) for g in cpu["bare"]]
                     + [("all", *(f"{sum(cpu[path].values()):.1f}" for path in paths))]))
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
