"""Ray Train overhead: raymcn on Ray Train vs the same training under bare ``torch.distributed``.

    python bench/overhead.py                 # 3 repeats x 4 epochs per path (~5 min quiet, 2 cores)
    python bench/overhead.py --quick         # 1 repeat x 3 epochs (~1.5 min quiet)
    python bench/overhead.py --json          # the table, then one JSON line with every figure

What runs, 2 gloo workers on CPU in both paths, same model, data, seeds and step count:

(a) **raymcn**: ``raymcn.train.launch.fit(cfg)`` on a fresh ``ray.init(address="local", num_cpus=3)``,
    ``cfg`` = the embedded default preset with ``scale.num_workers=2``, ``scale.cpus_per_worker=1``
    (plus ``--set`` overrides). The third logical CPU is for raymcn's Ray Data shard reader
    (``launch.data_cpus``): with only 2 logical CPUs both are reserved by the Train workers and the
    read tasks starve (measured: 110 s before the first batch, then a failed health check).
    Everything raymcn does per epoch runs (Ray Data shard reading, evaluation, checkpoint,
    ``ray.train.report``); only the training steps are timed for throughput (below), and the time
    the loop waits for Ray Data batches *is* inside them (``train_one_epoch``'s "data" phase).
(b) **bare DDP**: this file relaunched as ``python -m torch.distributed.run --standalone
    --nproc_per_node=2 bench/overhead.py --_ddp_child ...``: ``init_process_group("gloo")``, the
    same ``MCN`` (seeded like the worker), ``DistributedDataParallel(find_unused_parameters=False,
    gradient_as_bucket_view=True)``, ``MCNObjective``, optimizer and LR schedule, and
    ``train_one_epoch`` over ``TrainVideos.batches(cfg, epoch, rank, 2, steps)`` for the same epochs.
    The data are the same synthetic corpus (same videos, batch size, clips per video, steps per
    epoch), held in memory by ``raymcn.data.memory.TrainVideos`` instead of read from the shards
    through Ray Data; the clips drawn differ, the shapes and amount of work do not. No evaluation,
    no checkpoints, no reporting.

Measurement: in both paths every rank's ``train_one_epoch`` call is wrapped (in the Ray workers by
patching ``raymcn.train.worker.train_one_epoch`` from a wrapper around ``train_func_per_worker``)
to record the wall-clock start of the epoch and the loop's own ``samples_per_s`` (clips of the
rank / time of its training steps; evaluation and checkpointing are outside it). Job samples/s of
an epoch = the sum over the 2 ranks; **steady** = mean over the epochs after the first (warm-up:
Adam state, first k-means fit, allocator growth), then the median over ``--repeats``.
**startup** = from just before ``ray.init`` (a) / spawning torchrun (b) to the first training
step of the first epoch (rank 0): Ray start, trainer and worker-group setup, Ray Data dataset,
process group, corpus load, model build. The corpus and its shards are generated into the cache
before any timing.

Threads: Ray gives each 1-CPU worker ``OMP_NUM_THREADS=1``; the thread count torch actually uses
in the Ray workers (recorded, printed) is given to the torchrun children (``OMP_NUM_THREADS`` and
``torch.set_num_threads``), so both paths compute with the same threads. The raymcn path runs
first in every repeat; the paths alternate afterwards (ray, bare, ray, bare, ...).

Target (issue): raymcn steady samples/s >= 0.95 x bare DDP. Startup is reported separately.

Load caveat: wall-clock figures on a shared 2-core machine; re-measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout works without installing raymcn

TARGET = 0.95
RECORD_DIR_ENV = "RAYMCN_BENCH_RECORD_DIR"  # RAYMCN_* reaches the Ray workers (launch.build_trainer)
WORKERS = 2
RAY_CPUS = WORKERS + 1  # one logical CPU beyond the Train workers for the Ray Data read tasks


def raymcn_steps(cfg) -> int:
    """Steps per epoch of the raymcn path (its shard manifest), checked against the in-memory corpus."""
    from raymcn.data import reader, shards

    return reader.steps_per_epoch(reader.load_manifest(shards.shards_dir_for(cfg)), cfg)


def make_config(epochs: int, overrides: list[str]):
    from raymcn.cli import preset_path
    from raymcn.config import load_config

    return load_config(preset_path(), [f"scale.num_workers={WORKERS}", "scale.cpus_per_worker=1",
                                       f"schedule.epochs={epochs}", *overrides])


# --- per-epoch recording (both paths) --------------------------------------------------------------
def timed_train_one_epoch(record_dir: str, path: str):
    """``train_one_epoch`` that appends {rank, start, end, samples_per_s, threads} per call."""
    import torch

    from raymcn.losses.gather import world_info
    from raymcn.train.loop import train_one_epoch

    def wrapped(*args, **kwargs):
        rank, _ = world_info()
        start = time.time()
        metrics = train_one_epoch(*args, **kwargs)
        rec = {"rank": rank, "start": start, "end": time.time(), "samples_per_s": metrics["samples_per_s"],
               "steps": metrics["steps"],
               "data_wait_s": metrics.get("time_data_s", 0.0) * metrics["steps"], "threads": torch.get_num_threads(),
               "omp": os.environ.get("OMP_NUM_THREADS")}
        with open(Path(record_dir) / f"{path}_rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        return metrics

    return wrapped


def bench_train_func(loop_config: dict):
    """Ray Train entry point: raymcn's ``train_func_per_worker`` with the epoch timing patched in."""
    import raymcn.train.worker as worker

    worker.train_one_epoch = timed_train_one_epoch(os.environ[RECORD_DIR_ENV], "raymcn")
    return worker.train_func_per_worker(loop_config)


def read_records(record_dir: Path, path: str) -> list[list[dict]]:
    """Per rank, the epoch records in order."""
    out = []
    for rank in range(WORKERS):
        f = record_dir / f"{path}_rank{rank}.jsonl"
        out.append([json.loads(line) for line in f.read_text().splitlines()] if f.exists() else [])
    return out


def summarise(records: list[list[dict]], t0: float, t_end: float, epochs: int) -> dict:
    if any(len(r) != epochs for r in records):
        raise RuntimeError(f"expected {epochs} epoch records per rank, got {[len(r) for r in records]}")
    job = [sum(r[e]["samples_per_s"] for r in records) for e in range(epochs)]
    steady = job[1:] if epochs > 1 else job
    return {"startup_s": records[0][0]["start"] - t0, "wall_s": t_end - t0,
            "steady_samples_per_s": statistics.fmean(steady), "epoch_samples_per_s": job,
            # rank 0's time waiting for the next batch, per epoch (Ray Data in (a), in-memory in (b))
            "epoch_data_wait_s": [rec["data_wait_s"] for rec in records[0]],
            "threads": records[0][0]["threads"], "omp_num_threads": records[0][0]["omp"]}


# --- (a) raymcn on Ray Train -----------------------------------------------------------------------
def run_raymcn(cfg, record_dir: Path, storage: Path, verbose: bool) -> dict:
    import ray

    import raymcn.train.launch as launch

    os.environ[RECORD_DIR_ENV] = str(record_dir)
    launch.train_func_per_worker = bench_train_func  # build_trainer looks the name up at call time
    t0 = time.time()
    ray.init(address="local", num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=verbose)
    try:
        launch.fit(cfg, name=f"overhead-{record_dir.name}", storage_path=storage)
        t_end = time.time()
    finally:
        ray.shutdown()
    return summarise(read_records(record_dir, "raymcn"), t0, t_end, cfg.schedule.epochs)


# --- (b) bare torch.distributed under torchrun -----------------------------------------------------
def run_bare(args, threads: int, record_dir: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop(RECORD_DIR_ENV, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORKERS}",
           str(Path(__file__).resolve()), "--_ddp_child", "--epochs", str(args.epochs),
           "--threads", str(threads), "--record-dir", str(record_dir)]
    for o in args.overrides:
        cmd += ["--set", o]
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=not args.verbose, text=True)
    t_end = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stdout or ''}\n{proc.stderr or ''}")
    return summarise(read_records(record_dir, "bare"), t0, t_end, args.epochs)


def ddp_child(args) -> int:
    """One torchrun rank: raymcn's model, loss, optimizer and loop under plain DDP, no Ray."""
    import torch
    import torch.distributed as dist

    from raymcn.data.memory import TrainVideos
    from raymcn.losses import MCNObjective
    from raymcn.model import MCN
    from raymcn.train.loop import LoopState, build_optimizer, build_scheduler
    from raymcn.train.stages import switch_step

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    try:
        cfg = make_config(args.epochs, args.overrides)
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
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4, help="epochs per run; the first is warm-up (default 4)")
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

    cfg = make_config(args.epochs, args.overrides)
    from raymcn.data.memory import TrainVideos

    from raymcn.data import shards

    videos = TrainVideos.load(cfg)  # generate / read the cached corpus once, before any timing
    shards.shards_dir_for(cfg)  # and raymcn's shards of it
    steps = raymcn_steps(cfg)
    if steps > videos.steps_per_epoch(cfg):
        p.error(f"raymcn runs {steps} steps per epoch; the in-memory corpus fills only {videos.steps_per_epoch(cfg)}")
    print(f"config: default preset, {WORKERS} workers x 1 CPU (Ray: {RAY_CPUS} logical CPUs), {args.epochs} epochs x {steps} steps, "
          f"{cfg.data.batch_size} videos x {cfg.data.clips_per_video} clips per step, "
          f"stage_order={cfg.schedule.stage_order}; {args.repeats} repeat(s)", flush=True)

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
                    r = run_raymcn(cfg, record_dir, Path(tmp) / "results", args.verbose)
                    if threads is None:
                        threads = r["threads"]
                        print(f"Ray workers: torch threads {r['threads']}, OMP_NUM_THREADS="
                              f"{r['omp_num_threads']}; bare DDP ranks get {threads} thread(s)", flush=True)
                else:
                    r = run_bare(args, threads, record_dir)
                runs[path].append(r)
                print(f"repeat {rep + 1} {path:6s}: startup {r['startup_s']:.1f} s, steady "
                      f"{r['steady_samples_per_s']:.1f} samples/s (epochs: "
                      f"{', '.join(f'{x:.0f}' for x in r['epoch_samples_per_s'])}; rank-0 data wait s: "
                      f"{', '.join(f'{x:.2f}' for x in r['epoch_data_wait_s'])}), wall {r['wall_s']:.1f} s",
                      flush=True)
    total = time.time() - t_bench

    med = {path: {k: statistics.median(r[k] for r in rs) for k in ("startup_s", "steady_samples_per_s", "wall_s")}
           for path, rs in runs.items()}
    ratio = med["raymcn"]["steady_samples_per_s"] / med["bare"]["steady_samples_per_s"]
    startup_extra = med["raymcn"]["startup_s"] - med["bare"]["startup_s"]
    print(f"\nmedian of {args.repeats} repeat(s); samples/s per job (both workers), epochs 2..{args.epochs}")
    print(f"{'path':8s} {'startup s':>10s} {'steady samples/s':>17s} {'ratio':>7s}")
    for path in ("bare", "raymcn"):
        m = med[path]
        rr = m["steady_samples_per_s"] / med["bare"]["steady_samples_per_s"]
        print(f"{path:8s} {m['startup_s']:10.1f} {m['steady_samples_per_s']:17.1f} {rr:7.3f}")
    verdict = "meets" if ratio >= TARGET else "misses"
    print(f"raymcn/bare steady ratio {ratio:.3f}: {verdict} the target >= {TARGET}; "
          f"raymcn startup +{startup_extra:.1f} s over torchrun; bench time {total:.0f} s")
    if args.json:
        print(json.dumps({
            "workers": WORKERS, "epochs": args.epochs, "steps_per_epoch": steps, "repeats": args.repeats,
            "threads": threads, "target": TARGET,
            "raymcn_steady_samples_per_s": med["raymcn"]["steady_samples_per_s"],
            "bare_steady_samples_per_s": med["bare"]["steady_samples_per_s"],
            "steady_ratio": ratio, "meets_target": ratio >= TARGET,
            "raymcn_startup_s": med["raymcn"]["startup_s"], "bare_startup_s": med["bare"]["startup_s"],
            "startup_extra_s": startup_extra, "startup_ratio": med["raymcn"]["startup_s"] / med["bare"]["startup_s"],
            "raymcn_wall_s": med["raymcn"]["wall_s"], "bare_wall_s": med["bare"]["wall_s"],
            "runs": runs, "bench_s": total}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
