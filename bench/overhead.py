"""What Ray costs raymcn's training step, arm by arm, in one run: torchrun -> Ray -> Ray Train -> Ray Data.

    python -m bench.overhead                       # 3 repeats x 4 arms x 4 epochs, 2 ranks (~4 min, 2 cores)
    python -m bench.overhead --quick               # 1 repeat x 3 epochs (~1.5 min)
    python -m bench.overhead --arms torchrun ray-ddp train-local train-raydata train-raydata-noprefetch \
        --out docs/measurements/overhead.json      # docs/ray-cost.md's figures (~5.5 min)
    python -m bench.overhead --from docs/measurements/overhead.json.partial   # the tables of the
                                                   # repeats a run that died had finished

Four arms, the same step in each: the embedded default preset (``scale.num_workers`` ranks, gloo
on CPU), assembled by ``raymcn.train.build.assemble`` and run by ``loop.run_epochs``, seeded the
same, over the same shards, the same batches (the step rows of ``data/read/stream.py``: the same videos,
clips and bytes in every arm), the same number of torch threads per rank (``scale.torch_threads``;
every rank records ``torch.get_num_threads()``, ``OMP_NUM_THREADS`` and its niceness):

1. ``torchrun``: bare DDP, ``python -m torch.distributed.run --standalone`` (the reference); the
   rank builds its batches in its own process (``bench.readers.LocalStream``, on the prefetch thread).
2. ``ray-ddp``: the same rank function as 1, in one Ray actor per rank on a fresh local Ray
   instance (``scale.cpus_per_worker`` each), forming its own gloo group: how Ray's release
   benchmark (``air_benchmarks/workloads/torch_benchmark.py``) launches its "vanilla" baseline.
   1 -> 2 is Ray's runtime: worker processes, their niceness, Ray's daemons beside the ranks.
3. ``train-local``: ``TorchTrainer`` running raymcn's own worker (``train/on_ray/worker.py``:
   evaluation, checkpoint and report every epoch, progress, watchdog), its batches built in-process
   as in 1 and 2 (:func:`local_reader_worker`: ``on_ray/worker.train_func_per_worker`` with
   ``bench.readers.LocalStream`` as its stream). 2 -> 3 is the Train layer.
4. ``train-raydata``: raymcn as it runs: ``TorchTrainer``, each rank's batches from its own Ray Data
   stream (``datasource.RankStream``: read tasks build the step rows). 3 -> 4 is the data path.

Timed, as Ray's benchmark times it, is the training loop only: samples/s = clips / the time of a
rank's steps (``train_one_epoch``'s phases; evaluation and checkpoints lie outside), averaged over
the ranks, times the ranks; **steady** = the mean over the epochs after the first (warm-up), then
the median over the repeats. Ray is started for each Ray arm the way ``raymcn train`` starts it
(``on_ray/cluster.ray_session``, a fresh local instance) and stopped after it (unless this process
already has one: the test suite's smoke run shares its instance). The arms run in the order 1 2 3
4, then 4 3 2 1, and so on. Every arm's figures go to the partial file as the arm ends
(``bench.harness``): ``--from`` prints the tables of the repeats a run that died had finished.

CPU per kind of process (``bench.procstat``, ``/proc`` every 0.25 s) during the steady epochs'
steps: the ranks (split into their training thread and their other threads), Ray Data's read
tasks and coordinator, the Train controller, the Tune driver, raylet, GCS, the dashboard, idle Ray
workers, this driver, and every process on the machine that is not this benchmark's (other users'
jobs: on a shared machine they take CPU from the arms unevenly, so compare within one run). The
machine and ``os.getloadavg()`` are printed beside the figures.

Goal: arm 4 >= 0.9 x arm 2 (Ray's own comparison, training loop only). Ray's published threshold
for its own TorchTrainer vs vanilla comparison is a time ratio <= 1.15.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import harness, procstat
from bench.harness import read_jsonl
from bench.rank_exit import end_rank, leave_group
from bench.services import free_port
from raymcn.train.monitor import timeline

ARMS = ("torchrun", "ray-ddp", "train-local", "train-raydata")
NOPREFETCH = "train-raydata-noprefetch"  # optional: arm 4 with each batch fetched in the step (data.prefetch_batches=0)
LABELS = {"torchrun": "1 bare DDP under torchrun", "ray-ddp": "2 plain DDP in Ray actors",
          "train-local": "3 TorchTrainer, in-process reader", "train-raydata": "4 TorchTrainer + Ray Data (raymcn)",
          NOPREFETCH: "4 with data.prefetch_batches=0"}
GOAL = 0.9  # arm 4 / arm 2
RAY_THRESHOLD = 1.15  # Ray's release benchmark: TorchTrainer time / vanilla time
PHASES = ("data", "forward", "loss", "backward", "optimizer", "checkpoint")
TRACE = "RAYMCN_TIMELINE"
# The smoke size: arms 1 and 4 (bare DDP under torchrun, raymcn as it runs), 1 repeat of 2 epochs
# over the test suite's tiny corpus
SMOKE_ARMS = ("torchrun", "train-raydata")
SMOKE_SETTINGS = ["data.synthetic_videos=64", "data.synthetic_eval_clips=64", "data.batch_size=16"]


def make_config(workers: int, epochs: int, overrides: list[str]):
    from raymcn.config import load_config, preset_path

    return load_config(preset_path(), [f"scale.num_workers={workers}", f"schedule.epochs={epochs}", *overrides])


# --- arms 1 and 2: one rank, plain DDP ----------------------------------------------------------------
def rank_main(spec: dict, rank: int, world: int) -> None:
    """One rank of arms 1 and 2: gloo group from MASTER_ADDR/PORT, the run as raymcn's worker
    assembles it, DDP as ``ray.train.torch.prepare_model`` wraps it, the in-process reader. The
    group is left (``rank_exit.leave_group``) once every rank is done; a torchrun rank's process
    then ends with ``rank_exit.end_rank`` (returning from its main aborted a rank at exit)."""
    import torch
    import torch.distributed as dist

    from bench.readers import LocalStream
    from raymcn.collectives import Collectives, world_info
    from raymcn.config import Config
    from raymcn.environment import Environment
    from raymcn.train import probes
    from raymcn.train.build import assemble
    from raymcn.train.loop import run_epochs
    from raymcn.train.optim import apply_precision
    from raymcn.train.run import Hooks

    settings = Environment(timeline=spec["trace"])  # the timeline's marks, as a Ray Train rank makes them
    cfg, plan = Config.from_dict(spec["config"]), spec["plan"]
    threads = cfg.scale.torch_threads
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    probes.rank_started(settings, rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        comm = Collectives(*world_info())
        stream = LocalStream(plan.shards_dir, plan.inputs.index, cfg, rank, world,
                             steps_per_epoch=plan.steps_per_epoch, log=None)
        unused = cfg.schedule.stage_order != "joint" and cfg.scale.find_unused_parameters

        def record(run, metrics: dict) -> None:
            if rank == 0:
                with open(spec["records"], "a") as f:
                    f.write(json.dumps({**metrics, "reported": time.time()}) + "\n")

        apply_precision(cfg)  # a rank's start
        hooks = Hooks(batches=lambda r, epoch, start: stream.epoch(epoch, start), after_epoch=[record])
        run = assemble(cfg, plan, comm=comm, hooks=hooks, wrap=lambda net: torch.nn.parallel.DistributedDataParallel(
            net, find_unused_parameters=unused, gradient_as_bucket_view=True))
        probes.install(run, settings)
        run_epochs(run)
    except BaseException:
        dist.destroy_process_group()  # no barrier: the other rank may be gone
        raise
    leave_group()


def run_torchrun(spec_file: Path, workers: int, threads: int, verbose: bool) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = harness.module_command("torch.distributed.run", "--standalone", f"--nproc_per_node={workers}",
                                 "-m", "bench.overhead", "--_rank_child", str(spec_file))
    proc = subprocess.run(cmd, env=env, cwd=harness.REPO, capture_output=not verbose, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stdout or ''}\n{proc.stderr or ''}")


def run_ray_ddp(spec: dict, cfg) -> None:
    import ray

    @ray.remote
    class VanillaRank:
        def run(self, spec: dict, rank: int, world: int, port: int) -> None:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            rank_main(spec, rank, world)

    world, port = cfg.scale.num_workers, free_port()
    actors = [VanillaRank.options(num_cpus=cfg.scale.cpus_per_worker).remote() for _ in range(world)]
    ray.get([a.run.remote(spec, r, world, port) for r, a in enumerate(actors)])
    for a in actors:
        ray.kill(a)


def local_stream(cfg, plan, rank: int, world: int):
    """A rank's batches built in its own process (arm 3)."""
    from bench.readers import LocalStream

    return LocalStream(plan.shards_dir, plan.inputs.index, cfg, rank, world, steps_per_epoch=plan.steps_per_epoch)


def local_reader_worker(loop_config: dict) -> dict:
    """raymcn's worker with :func:`local_stream` in place of its Ray Data stream (arm 3): this
    worker process's ``worker.ray_data_stream`` is replaced before the worker runs."""
    from raymcn.train.on_ray import worker

    worker.ray_data_stream = local_stream
    return worker.train_func_per_worker(loop_config)


def run_train(cfg, plan, reader: str, records: Path, trace: Path, storage: Path) -> None:
    from ray.train.v2.api.callback import UserCallback

    from raymcn.environment import Environment
    from raymcn.train.on_ray import launch
    from raymcn.train.on_ray.cluster import scoped_env

    class Record(UserCallback):  # runs in the Train controller: rank 0's epoch metrics
        def after_report(self, run_context, metrics, checkpoint):
            with open(records, "a") as f:
                f.write(json.dumps({**metrics[0], "reported": time.time()}) + "\n")

    real = launch.train_func_per_worker
    if reader == "local":  # what every worker runs: arm 3's variant of raymcn's worker function
        launch.train_func_per_worker = local_reader_worker
    try:
        trainer = launch.build_trainer(cfg, plan, str(storage / f"overhead-{records.stem}"), callbacks=[Record()],
                                       env=Environment(timeline=str(trace)))
    finally:
        launch.train_func_per_worker = real
    with scoped_env(launch.controller_env(cfg)):
        trainer.fit()


# --- one arm, measured ----------------------------------------------------------------------------------
def run_arm(arm: str, cfg, plan, where: Path, sampler: procstat.ProcessSampler, args) -> dict:
    records, trace_file = where / f"{arm}.jsonl", where / f"{arm}.timeline"
    # the plan holds its inputs and the shards' video index (pickled, as Ray hands it to the workers)
    spec = {"config": cfg.to_dict(), "plan": plan, "records": str(records), "trace": str(trace_file)}
    os.environ[TRACE] = str(trace_file)  # the ray-ddp arm's actors inherit it (a local instance started here)
    timeline.start(str(trace_file))  # this driver's own marks
    load_before = procstat.load()
    t0 = time.time()
    from raymcn.train.monitor.console import Console

    try:
        # As `raymcn train` runs it: Ray's and the workers' output goes to a log file, not the terminal.
        with Console(where / "console.log", verbose=args.verbose):
            if arm == "torchrun":
                spec_file = where / "spec.pkl"
                spec_file.write_bytes(pickle.dumps(spec))
                run_torchrun(spec_file, cfg.scale.num_workers, cfg.scale.torch_threads, args.verbose)
            else:
                from raymcn.train.on_ray.cluster import ray_session

                with ray_session("local"):  # a new instance, or this process's (the smoke run's)
                    if arm == "ray-ddp":
                        run_ray_ddp(spec, cfg)
                    else:
                        if arm == NOPREFETCH:
                            cfg = cfg.replace({"data.prefetch_batches": 0})
                        run_train(cfg, plan, "local" if arm == "train-local" else "ray", records, trace_file, where / "results")
    finally:
        del os.environ[TRACE]
        timeline.start("")
    wall = time.time() - t0
    return summarise(arm, read_jsonl(records), read_jsonl(trace_file), sampler, cfg, wall, load_before)


def summarise(arm: str, records: list[dict], events: list[dict], sampler, cfg, wall: float, load_before) -> dict:
    epochs = [r for r in records if "samples_per_s" in r]
    if len(epochs) != cfg.schedule.epochs:
        raise RuntimeError(f"{arm}: expected {cfg.schedule.epochs} epoch records, got {len(epochs)}")
    world = cfg.scale.num_workers
    job = [r["samples_per_s"] * world for r in epochs]
    steady = epochs[1:]
    ms = {p: statistics.fmean(r.get(f"time_{p}_s", 0.0) for r in steady) * 1e3 for p in PHASES}
    ms["data"] = statistics.fmean(  # the wait for each batch after the epoch's first
        (r["time_data_s"] * r["steps"] - r["time_first_batch_s"]) / max(1.0, r["steps"] - 1) for r in steady) * 1e3
    ms["first batch"] = statistics.fmean(r["time_first_batch_s"] for r in steady) * 1e3  # once per epoch
    ranks = sorted(({k: e.get(k) for k in ("rank", "threads", "omp", "nice")} for e in events
                    if e["event"] == timeline.WORKER_ENTERED), key=lambda e: e["rank"])
    # CPU during the steady epochs' steps only: rank 0's [steps started, steps done] of each epoch >= 1
    spans = {}
    for e in events:
        if e.get("rank") == 0 and e["event"] in ("epoch: steps started", "epoch: steps done") and e["epoch"] >= 1:
            spans.setdefault(e["epoch"], {})[e["event"]] = e["t"]
    cpu_s: dict[str, float] = {}
    threads = {"training thread": 0.0, "other threads": 0.0}
    window = 0.0
    for span in spans.values():
        u = sampler.cpu(span["epoch: steps started"], span["epoch: steps done"])
        if not u:
            continue
        window += u["window_s"]
        for k, v in u["cpu_s"].items():
            cpu_s[k] = cpu_s.get(k, 0.0) + v
        for k, v in u["rank_threads"].items():
            threads[k] += v
    pct = {k: 100 * v / window for k, v in cpu_s.items()} if window else {}
    # CPU per sample moves much less than samples/s with the rest of the machine's load (a shared
    # machine takes cores away unevenly; it hardly changes what a step costs)
    samples = sum(r["steps"] for r in steady) * cfg.clips_per_step
    ours = sum(v for k, v in cpu_s.items() if k != procstat.OTHERS)
    per_sample = ({"ranks": 1e3 * cpu_s.get("training ranks", 0.0) / samples, "all": 1e3 * ours / samples}
                  if window else {})
    return {"cpu_ms_per_sample": per_sample, "others_percent": pct.get(procstat.OTHERS, 0.0),
            "steady_samples_per_s": statistics.fmean(job[1:]), "epoch_samples_per_s": job, "step_ms": ms,
            "ms_per_step": statistics.fmean(sum(r.get(f"time_{p}_s", 0.0) for p in PHASES) for r in steady) * 1e3,
            "ranks": ranks, "cpu_percent_of_one_core": pct,
            "rank_threads_percent": {k: 100 * v / window for k, v in threads.items()} if window else {},
            "cpu_window_s": window, "wall_s": wall, "load_before": load_before, "load_after": procstat.load()}


# --- driver ---------------------------------------------------------------------------------------------
def _table(head: tuple[str, ...], rows: list[tuple]) -> str:
    from raymcn.results.render import render_table

    return render_table([dict(zip(head, map(str, row))) for row in rows], right=head[1:])


def build_parser() -> argparse.ArgumentParser:
    p = harness.parser(__doc__, smoke=f"arms {' '.join(SMOKE_ARMS)}, 1 repeat x 2 epochs, a corpus of 64 videos")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4, help="epochs per arm; the first is warm-up (default 4)")
    p.add_argument("--workers", type=int, default=2, help="ranks in every arm (default 2)")
    p.add_argument("--quick", action="store_true", help="1 repeat, 3 epochs")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=(*ARMS, NOPREFETCH),
                   help=f"which arms (default the four; {NOPREFETCH}: arm 4 fetching each batch in the step)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every arm (repeatable)")
    p.add_argument("--from", dest="source", metavar="PARTIAL",
                   help="print the tables of the arms a run measured before it died (its partial file)")
    p.add_argument("--verbose", action="store_true", help="show torchrun's output")
    p.add_argument("--_rank_child", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args._rank_child:  # a torchrun child
        rank_main(pickle.loads(Path(args._rank_child).read_bytes()), int(os.environ["RANK"]),
                  int(os.environ["WORLD_SIZE"]))
        end_rank(0)
    if args.source:
        return report_partial(Path(args.source), args)
    if args.quick:
        args.repeats, args.epochs = 1, 3
    if args.smoke:
        args.repeats, args.epochs, args.arms = 1, 2, list(SMOKE_ARMS)
        args.overrides = [*SMOKE_SETTINGS, *args.overrides]
    if args.epochs < 2:
        p.error("--epochs must be >= 2 (the first is warm-up)")
    from raymcn.train.inputs import resolve_inputs
    from raymcn.train.run_plan import plan_of

    cfg = make_config(args.workers, args.epochs, args.overrides)
    plan = plan_of(cfg, resolve_inputs(cfg))  # the synthetic shards are generated once, before any timing
    with harness.Results("overhead", args) as results:
        info = results.machine
        print(f"machine: {info}; load average {procstat.load()} (1, 5, 15 min)")
        print(f"config: default preset, {cfg.scale.num_workers} ranks x {cfg.scale.cpus_per_worker} CPU, "
              f"{cfg.scale.torch_threads} torch thread(s) each; {args.epochs} epochs x {plan.steps_per_epoch} steps, "
              f"{cfg.data.batch_size} videos x {cfg.data.clips_per_video} clips per step; {args.repeats} repeat(s)",
              flush=True)
        runs: dict[str, list[dict]] = {arm: [] for arm in args.arms}
        settings = {k: getattr(args, k) for k in ("workers", "epochs", "repeats", "overrides")}
        t_bench = time.time()
        with tempfile.TemporaryDirectory(prefix="raymcn-overhead-") as tmp, \
                procstat.ProcessSampler(every_s=0.25) as sampler:
            for rep in range(args.repeats):
                order = list(args.arms) if rep % 2 == 0 else list(reversed(args.arms))
                for arm in order:
                    where = Path(tmp) / f"{arm}-{rep}"
                    where.mkdir()
                    r = run_arm(arm, cfg, plan, where, sampler, args)
                    runs[arm].append(r)
                    results.save(settings=settings, runs=runs)
                    threads = ", ".join(f"rank {x['rank']}: {x['threads']} thread(s), OMP_NUM_THREADS={x['omp']}, "
                                        f"nice {x['nice']}" for x in r["ranks"])
                    print(f"repeat {rep + 1} {arm:13s}: steady {r['steady_samples_per_s']:.0f} samples/s (epochs "
                          f"{', '.join(f'{x:.0f}' for x in r['epoch_samples_per_s'])}), wall {r['wall_s']:.0f} s, "
                          f"load {r['load_before']} -> {r['load_after']}; {threads}", flush=True)
        total = time.time() - t_bench
        results.finish(report(runs, args, info, total))
    return 0


def report_partial(path: Path, args) -> int:
    """The tables of what a run's partial file holds (the arms it finished before it died)."""
    saved = json.loads(path.read_text())
    runs = {arm: rs for arm, rs in saved["runs"].items() if rs}
    for key, value in saved["settings"].items():
        setattr(args, key, value)
    args.repeats = max(len(rs) for rs in runs.values())
    print(f"from {path}: " + ", ".join(f"{arm} {len(rs)} repeat(s)" for arm, rs in runs.items()))
    figures = report(runs, args, saved["machine"], float("nan"))
    if args.json:
        print(harness.dumps(figures))
    return 0


def _median(rs: list[dict], get) -> float:
    values = [get(r) for r in rs]
    return statistics.median(values) if values else float("nan")


def report(runs: dict[str, list[dict]], args, info: str, total: float) -> dict:
    """Print the tables; returns every figure."""
    arms = list(runs)
    thr = {a: _median(runs[a], lambda r: r["steady_samples_per_s"]) for a in arms}
    print(f"\nsteady samples/s (all ranks), median of {args.repeats}; epochs 2..{args.epochs}; "
          f"machine: {info}; load average now {procstat.load()}")
    base = thr.get("ray-ddp") or thr.get(arms[0])
    per = {a: {k: _median(runs[a], lambda r, k=k: r["cpu_ms_per_sample"].get(k, float("nan")))
               for k in ("ranks", "all")} for a in arms}
    print(_table(("arm", "samples/s", "vs arm 2", "repeats", "CPU ms/sample: ranks", "all of ours",
                  "the rest of the machine, % of a core"),
                 [(LABELS[a], f"{thr[a]:.0f}", f"{thr[a] / base:.3f}",
                   ", ".join(f"{r['steady_samples_per_s']:.0f}" for r in runs[a]), f"{per[a]['ranks']:.3f}",
                   f"{per[a]['all']:.3f}", f"{_median(runs[a], lambda r: r['others_percent']):.0f}") for a in arms]))
    att = {}
    steps = [("Ray runtime (1 -> 2)", "torchrun", "ray-ddp"), ("Train layer (2 -> 3)", "ray-ddp", "train-local"),
             ("data path (3 -> 4)", "train-local", "train-raydata"),
             ("all of Ray (1 -> 4)", "torchrun", "train-raydata")]
    rows = []
    for name, a, b in steps:
        if a in thr and b in thr:
            att[name] = {"throughput_ratio": thr[b] / thr[a], "time_ratio": thr[a] / thr[b]}
            rows.append((name, f"{thr[b] / thr[a]:.3f}", f"{thr[a] / thr[b]:.3f}"))
    if rows:
        print("\nattribution: each step's throughput ratio, and its time ratio (Ray's threshold for its own "
              f"TorchTrainer vs vanilla: <= {RAY_THRESHOLD})")
        print(_table(("step", "samples/s ratio", "time ratio"), rows))
    goal = thr["train-raydata"] / thr["ray-ddp"] if {"train-raydata", "ray-ddp"} <= set(thr) else None
    if goal is not None:
        ray_own = thr["torchrun"] / thr["ray-ddp"] if "torchrun" in thr else None
        print(f"arm 4 / arm 2 = {goal:.3f}: goal >= {GOAL} " + ("met" if goal >= GOAL else "NOT met")
              + (f"; Ray's own cost, arm 2's time / arm 1's = {ray_own:.3f} (Ray's threshold {RAY_THRESHOLD})"
                 if ray_own else ""))
    ms = {a: {k: _median(runs[a], lambda r, k=k: r["step_ms"][k]) for k in runs[a][0]["step_ms"]} for a in arms}
    print("\nms per step, ranks' mean, steady epochs (median over repeats; data = the wait for each later batch, "
          "first batch = the wait for each epoch's first)")
    print(_table(("phase", *arms), [(k, *(f"{ms[a][k]:.1f}" for a in arms)) for k in runs[arms[0]][0]["step_ms"]]))
    cpu = {a: {k: _median(runs[a], lambda r, k=k: r["cpu_percent_of_one_core"].get(k, 0.0))
               for k in procstat.kinds_order()} for a in arms}
    thr_split = {a: {k: _median(runs[a], lambda r, k=k: r["rank_threads_percent"].get(k, 0.0))
                     for k in ("training thread", "other threads")} for a in arms}
    shown = [k for k in procstat.kinds_order() if any(cpu[a][k] >= 0.05 for a in arms)]
    print("\nCPU during the steady epochs' steps, % of one core (median over repeats)")
    rows = [(k, *(f"{cpu[a][k]:.1f}" for a in arms)) for k in shown]
    rows += [("  ranks: their training threads", *(f"{thr_split[a]['training thread']:.1f}" for a in arms)),
             ("  ranks: all their other threads", *(f"{thr_split[a]['other threads']:.1f}" for a in arms)),
             ("all of this benchmark's", *(f"{sum(v for k, v in cpu[a].items() if k != procstat.OTHERS):.1f}"
                                           for a in arms))]
    print(_table(("processes", *arms), rows))
    print(f"bench time {total:.0f} s")
    return {
        "machine": info, "load_end": procstat.load(), "workers": args.workers, "epochs": args.epochs,
        "repeats": args.repeats, "overrides": args.overrides, "goal": GOAL, "ray_threshold": RAY_THRESHOLD,
        "steady_samples_per_s": thr, "cpu_ms_per_sample": per, "attribution": att, "arm4_over_arm2": goal,
        "step_ms": ms, "cpu_percent_of_one_core": cpu, "rank_threads_percent": thr_split, "runs": runs,
        "bench_s": total}


if __name__ == "__main__":
    sys.exit(main())
