"""What a checkpoint costs a run at paper dims, and what a resume inside an epoch costs.

    python -m bench.checkpoint            # paper dims (~20 min on 2 cores, ~15 GB of disk writes)
    python -m bench.checkpoint --quick    # the embedded default's tiny model (~2 min)
    python -m bench.checkpoint --json     # the tables, then one JSON line with every figure

1. **Size**: the checkpoint of a paper-dims run (``ModelConfig()``: 223.8 M parameters; Adam's two
   moments; the queue, 40 960 × 6144 fp32; the centroids; RNG, LR schedule, loop counters) as
   ``checkpoint.save`` writes it (``torch.save`` + fsync, so a reboot cannot lose it).
2. **Stall per checkpoint**, through Ray Train exactly as ``worker.py`` checkpoints: rank 0
   serialises into a temporary folder, then ``ray.train.report(checkpoint=...,
   checkpoint_upload_mode=...)`` copies it into the run's storage. ``sync``: the step loop waits for
   the copy; ``async`` (raymcn's): the copy runs in Ray's upload thread and the loop goes on at once.
   Both on a local-disk storage path and on an S3 server (moto's server mode on 127.0.0.1, as the
   S3 tests use). The stall is what the step loop waits; ``upload`` is how long the copy took; in
   async mode a stand-in for training (fixed torch matmul work) runs during the upload, and its
   slowdown against the same work run alone is the remaining, indirect cost (copying takes CPU
   and memory bandwidth too).
3. **Resume**: loading the checkpoint (cold page cache) and restoring it into a fresh run, and the
   time from asking the reader for a step to its batch, when resuming at 0 % and at 90 % of an
   epoch: (a) planning a resume at the lab's scale (1.17 M videos, 128 videos per step, 4 ranks:
   ~9.1 k steps an epoch) from a synthetic index, nothing read; (b) the first batch on Ray of
   HowTo100M-sized videos (~10 MB each, the loader benchmark's corpus), cold page cache.

Every figure is wall-clock on this machine, whatever else it runs: re-measure on a quiet one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from bench import harness, loader, services

GB = 1e9
LAB = {"videos": 1_170_000, "batch": 128, "world": 4}  # HowTo100M: ~9.1 k steps of 128 videos


# --- the run whose checkpoint is measured ------------------------------------------------------------
def full_run(cfg):
    """A run at ``cfg``'s dims with every part of its state present: Adam's moments (one step on
    zero gradients), a full queue and centroids."""
    from raymcn.train.build import assemble
    from raymcn.train.run_plan import make_plan

    run = assemble(cfg, make_plan(cfg, videos=cfg.data.batch_size), device=torch.device("cpu"))
    for p in run.model.parameters():
        p.grad = torch.zeros_like(p)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    queue = run.objective.cluster.queue
    queue.push(torch.randn(queue.capacity, queue.dim))
    run.objective.cluster.centroids = torch.randn(cfg.loss.num_clusters, cfg.model.embed_dim)
    return run


def stand_in_work(units: int) -> float:
    """Seconds for ``units`` fixed 1024² fp32 matmuls (a stand-in for training compute)."""
    a = torch.randn(1024, 1024)
    t0 = time.perf_counter()
    for _ in range(units):
        a = torch.tanh(a @ a * 1e-3)
    return time.perf_counter() - t0


def bench_worker(conf: dict) -> None:
    """Ray Train worker: checkpoint ``repeats`` times per mode and write the figures to ``conf['out']``."""
    import ray.train

    from raymcn.config import Config
    from raymcn.train.checkpoints import payload as checkpoint

    cfg = Config.from_dict(conf["config"])
    run = full_run(cfg)
    alone = min(stand_in_work(conf["work"]) for _ in range(2))
    rows = []
    for mode in conf["modes"]:
        upload_mode = ray.train.CheckpointUploadMode[mode.upper()]
        for _ in range(conf["repeats"]):
            directory = tempfile.mkdtemp(prefix="raymcn-bench-checkpoint-", dir=conf["tmp"])
            t0 = time.perf_counter()
            checkpoint.save(directory, **run.parts(), config=cfg.to_dict(), metrics={})
            t1 = time.perf_counter()
            ray.train.report({"mode": mode}, checkpoint=ray.train.Checkpoint.from_directory(directory),
                             checkpoint_upload_mode=upload_mode)
            t2 = time.perf_counter()
            row = {"mode": mode, "serialise_s": t1 - t0, "report_s": t2 - t1, "stall_s": t2 - t0}
            if mode == "async":  # the upload thread deletes the folder once it is in the storage
                done = threading.Event()

                def watch(start=t1) -> None:
                    while os.path.exists(directory):
                        time.sleep(0.02)
                    row["upload_s"] = time.perf_counter() - start
                    done.set()

                threading.Thread(target=watch, daemon=True).start()
                row["work_during_upload_s"] = stand_in_work(conf["work"])
                row["work_alone_s"] = alone
                done.wait()
            else:
                row["upload_s"] = t2 - t1
                shutil.rmtree(directory, ignore_errors=True)
            rows.append(row)
    Path(conf["out"]).write_text(json.dumps(rows))


def measure_stalls(cfg, storage_path: str, modes: list[str], repeats: int, work: int, tmp: Path) -> list[dict]:
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = tmp / f"stalls-{time.time_ns()}.json"
    trainer = TorchTrainer(bench_worker, train_loop_config={"config": cfg.to_dict(), "modes": modes,
                                                            "repeats": repeats, "work": work, "tmp": str(tmp),
                                                            "out": str(out)},
                           scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
                           run_config=RunConfig(name=f"bench-{time.time_ns()}", storage_path=storage_path,
                                                checkpoint_config=CheckpointConfig(num_to_keep=1)))
    trainer.fit()
    return json.loads(out.read_text())


# --- resume ------------------------------------------------------------------------------------------
def measure_load(cfg, directory: Path, cache) -> dict:
    """Cold-cache ``checkpoint.load`` of ``directory`` and ``restore`` into a fresh run."""
    from raymcn.train.build import assemble
    from raymcn.train.checkpoints import payload as checkpoint
    from raymcn.train.run_plan import make_plan

    run = assemble(cfg, make_plan(cfg, videos=cfg.data.batch_size), device=torch.device("cpu"))
    cache.drop()
    t0 = time.perf_counter()
    payload = checkpoint.load(directory)
    t1 = time.perf_counter()
    checkpoint.restore(payload, **run.parts())
    return {"load_s": t1 - t0, "restore_s": time.perf_counter() - t1}


def lab_index(videos: int, per_shard: int = 25):
    """A synthetic index of ``videos`` 10 MB videos, ``per_shard`` to a 256 MB shard (nothing on disk)."""
    from raymcn.data.read.order import VideoIndex

    i = np.arange(videos)
    size = 10 << 20
    return VideoIndex(ids=np.array([f"v{k:010d}" for k in i]), shard=(i // per_shard).astype(np.int32),
                      start=(i % per_shard).astype(np.int64) * size, end=(i % per_shard + 1).astype(np.int64) * size,
                      shard_names=tuple(f"shard-{k:06d}.tar" for k in range(-(-videos // per_shard))))


def measure_planning(cfg, repeats: int) -> dict:
    """Time to plan rank 0's remaining steps of an epoch (order, slices, byte ranges, read tasks)
    at the lab's scale, resuming at 0 % and at 90 %; nothing is read."""
    from raymcn.data.read.datasource import RankStepsDatasource, RankStream

    cfg = cfg.replace({"data.batch_size": LAB["batch"]})
    index = lab_index(LAB["videos"])
    steps = LAB["videos"] // LAB["batch"]
    stream = RankStream("/nonexistent", index, cfg, 0, LAB["world"], steps_per_epoch=steps, epochs=2)
    out = {"steps_per_epoch": steps}
    for name, start in (("at_0", 0), ("at_90", int(0.9 * steps))):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jobs = stream.jobs(1, start)
            tasks = RankStepsDatasource("/nonexistent", jobs, cfg, 1).task_groups()
            times.append(time.perf_counter() - t0)
        out[name] = {"start_step": start, "steps_planned": len(jobs), "read_tasks": len(tasks),
                     "seconds": statistics.median(times)}
    return out


def measure_first_batch(cfg, shard_dir: Path, manifest: dict, batch: int, repeats: int, cache) -> dict:
    """Seconds from ``RankStream.epoch(1, start)`` to its first batch (rank 0 of 2, in this process),
    resuming at 0 % and at 90 % of the epoch, cold page cache each time."""
    import ray

    from raymcn.data.read.datasource import RankStream
    from raymcn.data.read.order import build_index

    cfg = cfg.replace({"data.batch_size": batch})
    index = build_index(shard_dir, manifest)
    steps = len(index) // batch
    out = {"steps_per_epoch": steps, "videos": len(index), "batch": batch}
    node = ray.get_runtime_context().get_node_id()
    warm = RankStream(shard_dir, index, cfg, 0, 2, steps_per_epoch=steps, epochs=1, node_id=node, log=None)
    batches, _ = warm.epoch(0)  # starts the read-task workers and imports the read path (once per run)
    next(batches)
    batches.close()
    for name, start in (("at_0", 0), ("at_90", int(0.9 * steps))):
        times = []
        for _ in range(repeats):
            stream = RankStream(shard_dir, index, cfg, 0, 2, steps_per_epoch=steps, epochs=2, node_id=node,
                                log=None)
            cache.drop()
            t0 = time.perf_counter()
            batches, _ = stream.epoch(1, start)
            next(batches)
            times.append(time.perf_counter() - t0)
            batches.close()
        out[name] = {"start_step": start, "seconds": statistics.median(times), "all": times}
    return out


# --- driver ------------------------------------------------------------------------------------------
# The smoke size: the tiny model, async checkpoints to local storage, 16 short videos for the first
# batch, warm page cache
SMOKE = {"quick": True, "storages": "local", "modes": "async", "work": 4, "videos": 16, "size": "short",
         "warm": True}


def build_parser() -> argparse.ArgumentParser:
    p = harness.parser(__doc__, smoke="the tiny model, async checkpoints to local storage, a 4-matmul stand-in, "
                                      "16 short videos, warm page cache")
    p.add_argument("--quick", action="store_true", help="the embedded default's tiny model, fewer repeats")
    p.add_argument("--repeats", type=int, default=2,
                   help="checkpoints per mode on local disk (default 2; on the S3 server 1: it holds them in memory)")
    p.add_argument("--work", type=int, default=400, help="matmuls of the training stand-in (default 400)")
    p.add_argument("--storages", default="local,s3", help="comma list of: local, s3")
    p.add_argument("--modes", default="sync,async", help="comma list of: sync, async (one Train run each)")
    p.add_argument("--workdir", default=str(harness.bench_dir()),
                   help="the loader benchmark's corpora (reused) and this benchmark's storage")
    p.add_argument("--long-videos", dest="videos", type=int, default=200,
                   help="HowTo100M-sized videos for the first batch")
    p.add_argument("--warm", action="store_true", help="do not drop the page cache")
    p.set_defaults(size="long")  # the loader benchmark's corpus the videos come from (its SIZES)
    return p


def main(argv=None) -> int:
    args = harness.parse_args(build_parser(), argv, SMOKE)
    from raymcn.config import Config, load_config, preset_path

    cfg = load_config(preset_path()) if args.quick else Config()
    work = Path(args.workdir)
    tmp = work / "checkpoint"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cache = loader.Cache(not args.warm)
    with harness.Results("checkpoint", args) as results:
        figures: dict = {"machine": results.machine, "dims": "embedded default (tiny)" if args.quick else "paper"}
        try:
            measure_all(cfg, args, tmp, cache, figures, results)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        figures["cold_cache"] = bool(cache.cold)
        report(figures)
        results.finish(figures)
    return 0


def measure_all(cfg, args, tmp: Path, cache, figures: dict, results: harness.Results) -> None:
    """Every measurement of the module doc, in ``figures`` (saved as each one ends)."""
    import ray

    from raymcn.train.checkpoints import payload as checkpoint

    repeats = 1 if args.quick else args.repeats
    # 1. size, and serialising alone
    t0 = time.perf_counter()
    run = full_run(cfg)
    print(f"run at {figures['dims']} dims built ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    one = tmp / "one"
    t0 = time.perf_counter()
    checkpoint.save(one, **run.parts(), config=cfg.to_dict(), metrics={})
    figures["save_s"] = time.perf_counter() - t0
    figures["size_bytes"] = (one / checkpoint.STATE_FILE).stat().st_size
    payload = checkpoint.load(one)
    figures["parts_bytes"] = {k: tensor_bytes(v) for k, v in payload.items()}
    del payload, run
    results.save(**figures)

    # 3a/3b before the Ray Train runs (which hold GBs of memory while they run)
    figures["load"] = measure_load(cfg, one, cache)
    figures["planning"] = measure_planning(cfg, 1 if args.smoke else 3)
    results.save(**figures)
    storages = args.storages.split(",")
    with contextlib.ExitStack() as stack:
        # The S3 server first: Ray's processes take the AWS variables it sets when Ray starts.
        bucket = stack.enter_context(services.s3_server("raymcn-bench")) if "s3" in storages else None
        if not ray.is_initialized():  # else this process's instance (the smoke run's)
            ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False)
            stack.callback(ray.shutdown)
        work = Path(args.workdir) / f"{args.size}-{args.videos}"
        layout = loader.make_layout(work / "layout", args.videos, loader.SIZES[args.size]["seconds"])
        manifest = loader.make_shards(layout, work / "shards-256mb", 256.0, workers=min(2, os.cpu_count() or 1))
        figures["first_batch"] = measure_first_batch(cfg, work / "shards-256mb", manifest, 8, 1 if args.quick else 3,
                                                     cache)
        results.save(**figures)
        # 2. stalls through Ray Train
        figures["stalls"] = {}
        for storage in storages:
            where = f"{bucket}/runs" if storage == "s3" else str(tmp / "storage")
            print(f"checkpointing through Ray Train into {storage} storage ...", file=sys.stderr)
            rows = figures["stalls"][storage] = []
            n = repeats if storage == "local" else 1  # the S3 server holds one paper checkpoint in memory
            for mode in args.modes.split(","):  # one Train run each, the storage emptied between them
                try:
                    rows += measure_stalls(cfg, where, [mode], n, args.work, tmp)
                except Exception as e:  # e.g. Ray's OOM killer: the S3 server keeps objects in memory
                    figures.setdefault("not_measured", {})[f"{storage} {mode}"] = f"{type(e).__name__}: {e}"[:300]
                    continue
                print(f"  {storage} {mode}: {json.dumps(rows[-n:])}", file=sys.stderr)
                results.save(**figures)
                shutil.rmtree(tmp / "storage", ignore_errors=True)
                if storage == "s3":
                    services.empty_bucket(bucket)


def tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def report(f: dict) -> None:
    print(f"\nbench.checkpoint, {f['dims']} dims: {f['machine']}; "
          f"{'cold' if f['cold_cache'] else 'WARM (could not drop)'} page cache for the reads")
    print(f"\ncheckpoint size {f['size_bytes'] / GB:.2f} GB; by part: " +
          ", ".join(f"{k} {v / GB:.2f} GB" for k, v in f["parts_bytes"].items() if v >= 1e6))
    print(f"checkpoint.save (torch.save + fsync) alone: {f['save_s']:.1f} s")
    print("\nstall per checkpoint through ray.train.report (median of the repeats):")
    print(f"  {'storage':8s} {'mode':6s} {'serialise s':>12s} {'report s':>9s} {'stall s':>8s} {'upload s':>9s}"
          f" {'work slowdown':>14s}")
    for key, why in f.get("not_measured", {}).items():
        print(f"  {key}: not measured ({why})")
    for storage, rows in f["stalls"].items():
        for mode in ("sync", "async"):
            mine = [r for r in rows if r["mode"] == mode]
            if not mine:
                continue
            med = {k: statistics.median(r[k] for r in mine) for k in ("serialise_s", "report_s", "stall_s", "upload_s")}
            slow = (f"{statistics.median(r['work_during_upload_s'] / r['work_alone_s'] for r in mine):.2f}x"
                    if mode == "async" else "-")
            print(f"  {storage:8s} {mode:6s} {med['serialise_s']:12.1f} {med['report_s']:9.2f} {med['stall_s']:8.1f}"
                  f" {med['upload_s']:9.1f} {slow:>14s}")
            f.setdefault("summary", {})[f"{storage}_{mode}_stall_s"] = med["stall_s"]
    for storage in f["stalls"]:
        stall = f.get("summary", {}).get(f"{storage}_async_stall_s")
        if stall is None:
            continue
        print(f"  {storage}: <= 1 % of training lost to checkpoints needs an interval of at least "
              f"{stall * 100 / 60:.1f} min (async stall x 100)")
    ld = f["load"]
    print(f"\nresume: load the checkpoint {ld['load_s']:.1f} s (cold cache) + restore {ld['restore_s']:.1f} s")
    pl = f["planning"]
    print(f"planning rank 0's rest of an epoch at the lab's scale ({LAB['videos']:,} videos, {LAB['batch']} per step, "
          f"{LAB['world']} ranks, {pl['steps_per_epoch']} steps): "
          f"at 0 % {pl['at_0']['seconds']:.2f} s ({pl['at_0']['steps_planned']} steps), "
          f"at 90 % {pl['at_90']['seconds']:.2f} s ({pl['at_90']['steps_planned']} steps)")
    fb = f["first_batch"]
    print(f"first batch on Ray, HowTo100M-sized videos ({fb['videos']} videos, {fb['batch']} per step, "
          f"{fb['steps_per_epoch']} steps): at 0 % {fb['at_0']['seconds']:.2f} s, at 90 % {fb['at_90']['seconds']:.2f} s "
          f"(ratio {fb['at_90']['seconds'] / fb['at_0']['seconds']:.2f})")


if __name__ == "__main__":
    sys.exit(main())
