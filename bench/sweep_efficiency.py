"""Sweep efficiency: BOHB vs ASHA vs random search at equal total budget, on the synthetic task.

    python -m bench.sweep_efficiency [--seeds 8] [--budget 90] [--grace 3] [--quick] [--json]

Method
------
* The task: the tiny MCN of the embedded preset (``raymcn/presets/default.yaml``) trained
  **in-process** on the synthetic corpus, ``--epochs`` (10) epochs per full trial, scored by
  ``text_to_video_R@10`` on the held-out synthetic split after every epoch. The search space is
  ``optim.lr`` (loguniform), ``data.batch_size``, ``loss.num_clusters`` and ``schedule.stage_order``
  (all choices; see ``SPACE``). ``schedule.stage1_fraction`` is 0.1, so stage 1 is the first epoch
  and the schedulers' clock ``budget_epoch`` = epoch - 1 runs 0..9 (``max_t`` = 9).
* One Tune trial = one training run inside a Tune *function trainable* (1 CPU,
  ``torch.set_num_threads(1)``), assembled and run as the Ray worker runs it
  (``raymcn.train.build.assemble`` and ``run_epochs``, with in-memory batches and a Tune report as
  its hooks). No Ray Train: trials here are small enough to run in the trial process. Each epoch it reports ``epoch``,
  ``budget_epoch`` and R@10 with a ``tune.Checkpoint`` holding model, optimizer, LR scheduler,
  clustering state, loop counters and RNG states (``raymcn.train.checkpoints.payload``), so a trial paused
  by HyperBandForBOHB continues where it stopped instead of restarting. The training seed
  (``run.seed``) is the same for every trial: a config always gives the same curve, and the
  spread over seeds comes from the searchers alone.
* The searchers and schedulers are raymcn's real ones, from ``raymcn.sweep.tuner.build_search``:
  ``bohb`` = TuneBOHB + HyperBandForBOHB (rf 3, brackets starting before the first rung dropped);
  ``asha`` = ASHAScheduler (grace ``--grace``, rf 3) with random suggestions (``--asha-suggest
  optuna`` for TPE); ``random`` = BasicVariantGenerator + FIFO (every trial runs all its epochs).
  Seed s seeds all three searchers. The LR warm-up is the preset's, in videos (one epoch at every
  batch size); the first rung ``--grace`` (3 budget epochs = epoch 4) is the first whose R@10
  ranks configurations like the final R@10 (``bench.rung_correlation``).
* Budget = trial-epochs actually trained: one per reported result (a resumed trial reports each
  epoch once; ``repeated_epochs`` counts any (trial, epoch) reported twice, and should be 0). A
  Tune stopper ends the experiment once ``--budget`` epochs are in; results past the budget (from
  the other trial still running) are dropped, so every algorithm is scored on exactly ``--budget``
  epochs. ``curve[i]`` = best R@10 (any trial, any epoch) after i+1 trial-epochs.
* Figures, mean and 95 % Student t-interval over seeds (``raymcn.results.stats.t_interval``):
  ``best`` = curve at the full budget; ``to_random`` = epochs an algorithm needs to first reach
  **the same seed's** random-search final best (per-seed target; a seed that never reaches it
  counts as the full budget, a lower bound; the JSON also has the budget to reach the
  mean-over-seeds target); ratio = that / ``--budget``. The issue's target: bohb and asha reach it
  with a mean ratio <= 1/3.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from bench import harness

ALGORITHMS = ("bohb", "asha", "random")
SPACE = {
    "optim.lr": {"loguniform": [1.0e-4, 3.0e-2]},
    "data.batch_size": {"choice": [8, 16, 32]},
    "loss.num_clusters": {"choice": [8, 16, 32, 64]},
    "schedule.stage_order": {"choice": ["AV_T", "VT_A", "AT_V", "joint"]},
}
TRIAL_EPOCHS = 10
STAGE1_FRACTION = 0.1  # stage 1 = the first epoch; budget_epoch = epoch - 1
# First rung (budget epochs): the first at which bench.rung_correlation measured Spearman's rho of
# R@10 vs the final R@10 with its 95 % interval above 0.8 (epoch 4: 0.92 [0.84, 0.96], warm-up in videos).
FIRST_RUNG = 3
TARGET_RATIO = 1 / 3
EPS = 1e-9  # R@10 values of one (config, epoch) are bit-identical across runs
R10 = "text_to_video_R@10"  # the metric this benchmark measures and its searches maximise (raymcn/config/metrics.py)

# The smoke size (tests/test_sweep_efficiency.py): BOHB alone, HyperBand's first bracket (grace 1: 9
# trials x 2 epochs, then the promoted trials resume), one trial at a time
SMOKE = {"algorithms": "bohb", "seeds": 1, "budget": 24, "grace": 1, "max_concurrent": 1}

_CACHE: dict[tuple, Any] = {}  # per trial process: the corpus and eval set, loaded once


# --- one tiny run in this process (a trial here; bench.rung_correlation's runs) -----------------------
def trial_data(cfg):
    """The synthetic corpus's training videos and eval set for ``cfg``, loaded once per process."""
    from bench.readers import train_videos
    from raymcn.train.inputs import eval_set_of

    d = cfg.data
    key = (d.cache_dir, d.synthetic_videos, d.synthetic_eval_clips, d.synthetic_topics, d.max_words, d.eval_set,
           d.eval_audio_frames)
    if key not in _CACHE:
        _CACHE[key] = (train_videos(cfg),
                       eval_set_of(cfg))
    return _CACHE[key]


def local_hooks(cfg, plan, videos, eval_set, after_epoch):
    """The epoch loop's hooks of a one-process run: in-memory batches, R@10 on the eval set after
    every epoch, then ``after_epoch(run, metrics)``."""
    from raymcn.train.evaluate import evaluate
    from raymcn.train.run import Hooks

    return Hooks(batches=lambda r, epoch, start: (videos.batches(cfg, epoch, 0, 1, plan.steps_per_epoch, start), None),
                 evaluate=lambda r: evaluate(r.model, eval_set, r.device), after_epoch=[after_epoch])


# --- the trial (runs in a Tune actor) ---------------------------------------------------------------


def trial_fn(config: dict[str, Any], base: dict[str, Any]) -> None:
    """One trial: train the tiny MCN epoch by epoch, report + checkpoint every epoch, resume if paused."""
    import torch
    from ray import tune

    from raymcn.config import Config
    from raymcn.sweep.search_space import plain
    from raymcn.train.build import assemble
    from raymcn.train.checkpoints import payload as checkpoint
    from raymcn.train.loop import NonFiniteLossError, run_epochs
    from raymcn.train.optim import apply_precision
    from raymcn.train.run_plan import make_plan

    torch.set_num_threads(1)
    cfg = Config.from_dict(base).replace(plain(config))  # BOHB hands out np.int64 / np.str_
    videos, eval_set = trial_data(cfg)
    started = [time.perf_counter()]

    def report(run, metrics: dict) -> None:
        result = {R10: float(metrics[R10]), "epoch": run.state.epoch,
                  "budget_epoch": run.plan.budget_epoch(run.state.epoch),
                  "epoch_time_s": time.perf_counter() - started[0]}
        with tempfile.TemporaryDirectory() as d:
            checkpoint.save(d, **run.parts())
            tune.report(result, checkpoint=tune.Checkpoint.from_directory(d))
        started[0] = time.perf_counter()

    # The run as the Ray worker assembles it (one process: no wrap), its epochs through the same loop.
    plan = make_plan(cfg, videos=len(videos.records))
    apply_precision(cfg)  # the trial's process: its rank's start
    run = assemble(cfg, plan, device="cpu", hooks=local_hooks(cfg, plan, videos, eval_set, after_epoch=report))
    ckpt = tune.get_checkpoint()
    if ckpt is not None:  # resumed after a HyperBand pause (or a restart): continue, don't redo
        with ckpt.as_directory() as d:
            checkpoint.restore(checkpoint.load(d), **run.parts())
    started[0] = time.perf_counter()
    try:
        run_epochs(run)
    except NonFiniteLossError:
        return  # a diverged config ends its trial; its reported epochs stay counted


# --- the budget ledger (runs in the driver) ---------------------------------------------------------
def _ledger_classes():
    from ray import tune

    class Ledger(tune.Callback):
        """Every real (non-duplicate) result, in the order Tune processed them: one trial-epoch each."""

        def __init__(self):
            self.rows: list[dict[str, Any]] = []

        def on_trial_result(self, iteration, trials, trial, result, **info):
            if R10 in result and "epoch" in result:
                self.rows.append({"trial": trial.trial_id, "epoch": int(result["epoch"]),
                                  "r10": float(result[R10]),
                                  "train_s": float(result.get("epoch_time_s", 0.0)),
                                  "config": {k: _jsonable(v) for k, v in trial.config.items()}})

    class BudgetStopper(tune.Stopper):
        def __init__(self, ledger: Ledger, budget: int):
            self.ledger, self.budget = ledger, budget

        def __call__(self, trial_id, result):
            return False

        def stop_all(self):
            return len(self.ledger.rows) >= self.budget

    return Ledger, BudgetStopper


def _jsonable(v):
    return v.item() if hasattr(v, "item") else v


# --- one sweep ----------------------------------------------------------------------------------------
def base_config(algorithm: str, seed: int, args: argparse.Namespace):
    from raymcn.config import load_config, preset_path

    return load_config(preset_path(), {
        "scale.num_workers": 0, "schedule.epochs": args.epochs, "schedule.stage1_fraction": STAGE1_FRACTION,
        "sweep.algorithm": algorithm, "sweep.suggest": args.asha_suggest, "sweep.seed": seed,
        "sweep.num_samples": 10_000, "sweep.max_concurrent": args.max_concurrent, "sweep.grace_epochs": args.grace,
        "sweep.repeats": 1,  # one trial per configuration: the searchers' own efficiency
        "sweep.reduction_factor": 3, "sweep.space": SPACE,
    })


def run_one(algorithm: str, seed: int, args: argparse.Namespace, storage: str) -> dict[str, Any]:
    from ray import tune

    from raymcn.sweep.search_space import param_space
    from raymcn.sweep.tuner import build_search

    cfg = base_config(algorithm, seed, args)
    search_alg, scheduler = build_search(cfg)
    Ledger, BudgetStopper = _ledger_classes()
    ledger = Ledger()
    trainable = tune.with_resources(tune.with_parameters(trial_fn, base=cfg.to_dict()), {"cpu": 1})
    tuner = tune.Tuner(
        trainable,
        param_space=param_space(cfg.sweep),
        tune_config=tune.TuneConfig(metric=R10, mode="max", num_samples=cfg.sweep.num_samples,
                                    max_concurrent_trials=args.max_concurrent, search_alg=search_alg,
                                    scheduler=scheduler, reuse_actors=True),
        run_config=tune.RunConfig(name=f"{algorithm}-seed{seed}", storage_path=storage, verbose=0,
                                  stop=BudgetStopper(ledger, args.budget), callbacks=[ledger],
                                  checkpoint_config=tune.CheckpointConfig(num_to_keep=1)),
    )
    t0 = time.perf_counter()
    grid = tuner.fit()
    wall = time.perf_counter() - t0
    rows = ledger.rows[:args.budget]
    curve, best = [], -math.inf
    for r in rows:
        best = max(best, r["r10"])
        curve.append(best)
    seen: set[tuple[str, int]] = set()
    repeated = 0
    for r in ledger.rows:
        repeated += (r["trial"], r["epoch"]) in seen
        seen.add((r["trial"], r["epoch"]))
    top = max(rows, key=lambda r: r["r10"]) if rows else None
    trial_no: dict[str, int] = {}
    for r in rows:
        trial_no.setdefault(r["trial"], len(trial_no))
    configs = {r["trial"]: r["config"] for r in rows}
    return {"algorithm": algorithm, "seed": seed, "epochs_counted": len(rows), "epochs_trained": len(ledger.rows),
            "repeated_epochs": repeated, "trials": len({r["trial"] for r in rows}),
            "full_trials": len({r["trial"] for r in rows if r["epoch"] == args.epochs}),
            "errors": len(grid.errors), "best": curve[-1] if curve else None,
            "best_config": top["config"] if top else None, "best_epoch": top["epoch"] if top else None,
            "curve": curve, "wall_s": round(wall, 1),  # unrounded: reach tests compare exact values
            "train_s": round(sum(r["train_s"] for r in rows), 1),  # in-trial epoch time (train + eval)
            # the budget ledger: [trial number, epoch, R@10] per counted trial-epoch, in order
            "log": [[trial_no[r["trial"]], r["epoch"], r["r10"]] for r in rows],
            "trial_configs": [configs[t] for t in trial_no]}


# --- figures ---------------------------------------------------------------------------------------
def epochs_to_reach(curve: list[float], target: float | None) -> int | None:
    if target is None:
        return None
    for i, v in enumerate(curve):
        if v >= target - EPS:
            return i + 1
    return None


def _interval(values: list[float]) -> dict[str, Any]:
    """mean, sample std and the 95 % Student t-interval of the mean (``raymcn.results.stats``)."""
    from raymcn.results.stats import t_interval

    if not values:
        return {"mean": None, "std": None, "ci95": [None, None], "n": 0}
    low, high = t_interval(values)
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
            "ci95": [None if math.isnan(low) else low, None if math.isnan(high) else high], "n": len(values)}


def summarise(runs: list[dict[str, Any]], budget: int, seeds: list[int],
              algorithms: tuple[str, ...] = ALGORITHMS) -> dict[str, Any]:
    """Per algorithm, over seeds: the best R@10 at the full budget, and the trial-epochs needed to
    first reach the same seed's random-search final best. A seed that never reaches it within the
    budget counts as the full budget (``cost``: a lower bound on what it would have needed), so the
    mean ratio is never flattered by leaving the misses out; ``reached`` says how many did."""
    by = {(r["algorithm"], r["seed"]): r for r in runs}
    targets = {s: by[("random", s)]["best"] if ("random", s) in by else None for s in seeds}
    known = [t for t in targets.values() if t is not None]
    mean_target = statistics.fmean(known) if known else None
    out: dict[str, Any] = {}
    for alg in algorithms:
        rs = [by[(alg, s)] for s in seeds]
        reach = [epochs_to_reach(r["curve"], targets[r["seed"]]) for r in rs]
        cost = [float(budget if e is None else e) for e in reach]
        ratio = _interval([c / budget for c in cost])
        out[alg] = {
            "best_r10": _interval([r["best"] for r in rs if r["best"] is not None]),
            "best_r10_per_seed": [r["best"] for r in rs],
            "epochs_to_random_best_per_seed": reach, "cost_per_seed": cost,
            "epochs_to_random_best": _interval(cost), "ratio_to_budget": ratio,
            "reached": sum(e is not None for e in reach), "of": len(rs),
            "epochs_to_mean_random_best_per_seed": [epochs_to_reach(r["curve"], mean_target) for r in rs],
            "trials_mean": statistics.fmean(r["trials"] for r in rs),
            "full_trials_mean": statistics.fmean(r["full_trials"] for r in rs),
            "repeated_epochs": sum(r["repeated_epochs"] for r in rs), "errors": sum(r["errors"] for r in rs),
            "wall_s_mean": statistics.fmean(r["wall_s"] for r in rs),
        }
        if alg != "random":
            out[alg]["meets_target"] = bool(ratio["mean"] is not None and ratio["mean"] <= TARGET_RATIO)
            out[alg]["interval_below_target"] = bool(ratio["ci95"][1] is not None and ratio["ci95"][1] <= TARGET_RATIO)
    return {"random_best_per_seed": [targets[s] for s in seeds], "random_best_mean": mean_target,
            "algorithms": out}


def _ci(iv: dict[str, Any], fmt: str) -> str:
    low, high = iv["ci95"]
    return "-" if low is None else f"[{format(low, fmt)}, {format(high, fmt)}]"


def table(summary: dict[str, Any], budget: int, nseeds: int) -> str:
    from raymcn.results.render import render_table

    rows = []
    for alg, a in summary["algorithms"].items():
        b, e, r = a["best_r10"], a["epochs_to_random_best"], a["ratio_to_budget"]
        rows.append({"algorithm": alg, f"best R@10 at {budget}": b["mean"], "95% CI": _ci(b, ".1f"),
                     "trial-epochs to random's best": e["mean"], "95% CI ": _ci(e, ".1f"),
                     f"ratio to {budget}": r["mean"], "95% CI  ": _ci(r, ".2f"),
                     "seeds reached": f"{a['reached']}/{a['of']}", "trials": a["trials_mean"],
                     "full-length trials": a["full_trials_mean"]})
    spec = {f"ratio to {budget}": ".2f", "trials": ".1f", "full-length trials": ".1f"}
    text = render_table(rows, spec=lambda c: spec.get(c, ".1f"), right=("95% CI", "95% CI ", "95% CI  "))
    mean_target = summary["random_best_mean"]
    lines = [text.rstrip("\n"),
             f"\nmean and 95 % t-interval over {nseeds} seed(s); target per seed = that seed's random-search best "
             f"(mean {'n/a' if mean_target is None else f'{mean_target:.2f}'}); a seed that does not reach it counts "
             f"as the full {budget} trial-epochs."]
    for alg in ("bohb", "asha"):
        a = summary["algorithms"].get(alg)
        if a is None:
            continue
        lines.append(f"{alg}: {'meets' if a['meets_target'] else 'misses'} the target (mean ratio <= 1/3; "
                     f"interval {'entirely' if a['interval_below_target'] else 'not entirely'} below it); "
                     f"repeated epochs {a['repeated_epochs']}, errored trials {a['errors']}")
    return "\n".join(lines)


# --- main ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = harness.parser(__doc__.split("\n\n")[0], raw=True,
                       smoke="BOHB alone, 1 seed, 24 trial-epochs, grace 1, one trial at a time")
    p.add_argument("--seeds", type=int, default=8, help="searcher seeds 0..N-1 (default 8)")
    p.add_argument("--budget", type=int, default=90, help="total trial-epochs per algorithm and seed (default 90)")
    p.add_argument("--epochs", type=int, default=TRIAL_EPOCHS, help="epochs of a full trial (default 10)")
    p.add_argument("--grace", type=int, default=FIRST_RUNG, help=f"first rung of asha and bohb in budget epochs "
                   f"(sweep.grace_epochs; default {FIRST_RUNG}, chosen by bench.rung_correlation)")
    p.add_argument("--asha-suggest", choices=("random", "optuna"), default="random",
                   help="where ASHA's configs come from (default random, as sweep.suggest)")
    p.add_argument("--max-concurrent", type=int, default=2, help="trials at once, 1 CPU each (default 2)")
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs given to the local Ray instance (default 2)")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS),
                   help="comma-separated subset of bohb,asha,random (random supplies the target; default all)")
    p.add_argument("--quick", action="store_true", help="1 seed, 30 trial-epochs: a run of a few minutes")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = harness.parse_args(p, argv, SMOKE)
    if args.quick:
        args.seeds, args.budget = 1, 30
    names = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    if not names or any(a not in ALGORITHMS for a in names):
        p.error(f"--algorithms {args.algorithms!r}: expected a comma-separated subset of {','.join(ALGORITHMS)}")
    args.algorithms = tuple(a for a in ALGORITHMS if a in names)  # fixed order
    if args.seeds < 1 or args.budget < 1 or args.epochs < 2 or args.max_concurrent < 1 or args.grace < 1:
        p.error("--seeds, --budget, --max-concurrent, --grace must be >= 1 and --epochs >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # the legacy reporter is silent at verbose=0
    # num_to_keep=1 (a trial checkpoint is ~14 MB) forces a small experiment snapshot per checkpoint;
    # Tune warns about that every few seconds.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    import ray

    seeds = list(range(args.seeds))
    base_config("bohb", 0, args)  # a bad setting fails here, before Ray starts
    started = not ray.is_initialized()  # else this process's instance is used
    if started:  # in-process function trials hold no Train placement groups: no dashboard needed
        ray.init(num_cpus=args.num_cpus, object_store_memory=100 * 1024**2, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    storage = tempfile.mkdtemp(prefix="raymcn-sweep-efficiency-")
    runs = []
    t0 = time.perf_counter()
    with harness.Results("sweep_efficiency", args) as results:
        try:
            for seed in seeds:
                for alg in args.algorithms:
                    r = run_one(alg, seed, args, storage)
                    runs.append(r)
                    results.save(runs=runs)
                    best = "n/a" if r["best"] is None else f"{r['best']:.2f}"
                    print(f"[{time.perf_counter() - t0:6.0f}s] {alg:6s} seed {seed}: best R@10 {best} "
                          f"after {r['epochs_counted']} trial-epochs, {r['trials']} trials ({r['full_trials']} full), "
                          f"repeated epochs {r['repeated_epochs']}, errors {r['errors']}, {r['wall_s']:.0f}s wall "
                          f"({r['train_s']:.0f}s in epochs)",
                          file=sys.stderr, flush=True)
        finally:
            if started:
                ray.shutdown()
            shutil.rmtree(storage, ignore_errors=True)
        summary = summarise(runs, args.budget, seeds, args.algorithms)
        total = time.perf_counter() - t0
        print(table(summary, args.budget, len(seeds)))
        print(f"wall time {total:.0f} s")
        settings = {"seeds": seeds, "budget": args.budget, "trial_epochs": args.epochs,
                    "stage1_fraction": STAGE1_FRACTION, "asha_suggest": args.asha_suggest, "grace_epochs": args.grace,
                    "algorithms": list(args.algorithms), "max_concurrent": args.max_concurrent,
                    "num_cpus": args.num_cpus, "space": SPACE,
                    "target": "per-seed random-search best R@10; ratio = mean epochs to reach it / budget",
                    "wall_s": round(total, 1)}
        results.finish({"settings": settings, **summary, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
