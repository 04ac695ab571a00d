"""Does an early rung rank configurations like the full run? Spearman of R@10 at each epoch vs the final R@10.

    python -m bench.rung_correlation [--configs 24] [--epochs 10] [--processes 2] [--json] [--from JSON]

Method
------
* ``--configs`` random configurations are drawn (numpy, ``--seed``) from the search space of
  ``bench.sweep_efficiency`` (lr loguniform 1e-4..3e-2, batch 8/16/32, K 8/16/32/64, stage
  order), on the embedded preset's tiny MCN and synthetic corpus (256 videos), ``--epochs`` epochs
  each with ``schedule.stage1_fraction`` 0.1 (stage 1 = the first epoch), exactly as that
  benchmark's trials: in-process, 1 torch thread, assembled and run by
  ``raymcn.train.build.assemble``/``run_epochs``, R@10 on the held-out synthetic split after
  every epoch.
* Every configuration is trained under two LR schedules, the only difference between the arms:
  ``before`` = ``optim.warmup_steps: 16`` (the fixed step count the preset had: one epoch at
  batch 16, half an epoch at batch 8, two epochs at batch 32); ``after`` = ``optim.warmup_videos:
  256`` (one epoch at every batch size: 32, 16 and 8 steps). At batch 16 both arms are the same
  run (16 steps), so those configurations are trained once and used in both arms.
* For each epoch e: Spearman's rho between the configurations' R@10 at epoch e and their R@10 at
  the last epoch, with a 95 % interval from Fisher's z with the Bonett-Wright standard error
  sqrt((1 + rho^2 / 2) / (n - 3)). A configuration whose loss diverged (``NonFiniteLossError``) in
  either arm is left out of both, so both arms rank the same configurations. The sweep schedulers'
  clock is ``budget_epoch = epoch - 1`` here, so epoch e is rung ``budget_epoch = e - 1``. A second
  table does the same over each arm's upper half by final R@10, where a scheduler's promotions
  decide which configuration wins (the lower half is mostly configurations that never learn,
  which any rung ranks last).
"""

from __future__ import annotations

import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench import harness
from bench.sweep_efficiency import R10, SPACE, local_hooks, trial_data

ARMS = {"before": {"optim.warmup_steps": 16}, "after": {"optim.warmup_steps": 0, "optim.warmup_videos": 256}}
STAGE1_FRACTION = 0.1
# The smoke size: 4 configurations (the fewest a rank correlation takes) x 2 epochs, one process,
# on the test suite's corpus of 64 videos (the warm-ups stay 16 steps and 256 videos)
SMOKE = {"configs": 4, "epochs": 2, "processes": 1}
SMOKE_CORPUS = {"data.synthetic_videos": 64, "data.synthetic_eval_clips": 64}


def draw_configs(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` configurations drawn from the efficiency benchmark's space (loguniform and choice)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        cfg = {}
        for key, spec in SPACE.items():
            (domain, args), = spec.items()
            if domain == "loguniform":
                cfg[key] = float(math.exp(rng.uniform(math.log(args[0]), math.log(args[1]))))
            elif domain == "choice":
                v = args[int(rng.integers(len(args)))]
                cfg[key] = v.item() if hasattr(v, "item") else v
            else:
                raise ValueError(f"{key}: domain {domain} not drawn here")
        out.append(cfg)
    return out


def train_curve(config: dict[str, Any], arm: dict[str, Any], epochs: int,
                corpus: dict[str, Any] | None = None) -> dict[str, Any]:
    """R@10 after every epoch of one configuration under one arm's schedule (runs in a pool
    process); ``corpus``: settings of the synthetic corpus (default the preset's 256 videos)."""
    import torch

    from raymcn.config import load_config, preset_path
    from raymcn.train.build import assemble
    from raymcn.train.loop import NonFiniteLossError, run_epochs
    from raymcn.train.run_plan import make_plan

    torch.set_num_threads(1)
    cfg = load_config(preset_path(), {**(corpus or {}), "scale.num_workers": 0, "schedule.epochs": epochs,
                                      "schedule.stage1_fraction": STAGE1_FRACTION, **config, **arm})
    videos, eval_set = trial_data(cfg)
    plan = make_plan(cfg, videos=len(videos.records))
    curve: list[float] = []
    hooks = local_hooks(cfg, plan, videos, eval_set, after_epoch=lambda r, m: curve.append(float(m[R10])))
    run = assemble(cfg, plan, device="cpu", hooks=hooks)
    t0 = time.perf_counter()
    diverged = False
    try:
        run_epochs(run)
    except NonFiniteLossError:
        diverged = True
    return {"curve": curve, "diverged": diverged, "warmup_steps": plan.warmup_steps,
            "steps_per_epoch": plan.steps_per_epoch, "seconds": time.perf_counter() - t0}


def spearman_interval(x, y, confidence: float = 0.95) -> tuple[float, float, float]:
    """(rho, low, high): Spearman's rho of ``x`` and ``y`` and its Fisher-z interval with the
    Bonett-Wright standard error; NaN when fewer than 4 pairs or a constant input."""
    from scipy import stats as st

    n = len(x)
    if n < 4 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return math.nan, math.nan, math.nan
    rho = float(st.spearmanr(x, y).statistic)
    if abs(rho) >= 1:
        return rho, rho, rho
    z, se = math.atanh(rho), math.sqrt((1 + rho * rho / 2) / (n - 3))
    q = float(st.norm.ppf(0.5 + confidence / 2))
    return rho, math.tanh(z - q * se), math.tanh(z + q * se)


def correlations(curves: dict[str, list[list[float]]], epochs: int, top: float = 1.0) -> list[dict[str, Any]]:
    """One row per epoch: rho (and interval) of R@10 at that epoch vs at the last, per arm; over
    the ``top`` share of each arm's configurations by final R@10 (1.0: all of them). The upper
    half is where a scheduler's promotions decide which configuration wins."""
    rows = []
    for e in range(1, epochs + 1):
        row: dict[str, Any] = {"epoch": e, "rung (budget_epoch)": e - 1}
        for arm, cs in curves.items():
            cs = sorted(cs, key=lambda c: -c[-1])[:max(4, math.ceil(top * len(cs)))]
            x = np.array([c[e - 1] for c in cs])
            y = np.array([c[-1] for c in cs])
            rho, low, high = spearman_interval(x, y)
            row[f"{arm} rho"] = rho
            row[f"{arm} 95% CI"] = "-" if math.isnan(low) else f"[{low:.2f}, {high:.2f}]"
        rows.append(row)
    return rows


def build_parser():
    p = harness.parser(__doc__.split("\n\n")[0], raw=True,
                       smoke=f"{SMOKE['configs']} configurations x {SMOKE['epochs']} epochs, in this process")
    p.add_argument("--configs", type=int, default=24, help="random configurations (default 24)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draw (default 0)")
    p.add_argument("--epochs", type=int, default=10, help="epochs of every run (default 10)")
    p.add_argument("--processes", type=int, default=2, help="runs at once, 1 torch thread each (default 2)")
    p.add_argument("--from", dest="source", metavar="JSON", help="recompute the tables from the last line of a "
                   "previous --json output instead of training")
    return p


def main(argv: list[str] | None = None) -> int:
    args = harness.parse_args(build_parser(), argv, SMOKE)
    from raymcn.results.render import render_table

    t0 = time.perf_counter()
    with harness.Results("rung_correlation", args) as results:
        if args.source:
            saved = json.loads(Path(args.source).read_text().strip().splitlines()[-1])
            configs, args.epochs = saved["configs"], saved["settings"]["epochs"]
            runs = {(r["config"], r["arm"]): r for r in saved["runs"]}
            jobs: dict[tuple[int, str], Any] = {}
        else:
            configs = draw_configs(args.configs, args.seed)
            runs, jobs = train_all(configs, args, results)
        kept = [i for i in range(len(configs))
                if not any(runs[(i, a)]["diverged"] or len(runs[(i, a)]["curve"]) < args.epochs for a in ARMS)]
        curves = {arm: [runs[(i, arm)]["curve"] for i in kept] for arm in ARMS}
        rows = correlations(curves, args.epochs)
        upper = correlations(curves, args.epochs, top=0.5)
        wall = time.perf_counter() - t0
        print(render_table(rows, spec=lambda col: ".2f"), end="")
        print(f"\nSpearman rho of R@10 at each epoch vs at epoch {args.epochs}, over the same {len(kept)} of "
              f"{len(configs)} random configurations ({len(configs) - len(kept)} diverged in an arm and are left out); "
              f"95 % interval from Fisher's z. before = optim.warmup_steps 16, after = optim.warmup_videos 256.\n")
        print(render_table(upper, spec=lambda col: ".2f"), end="")
        print(f"\nThe same over each arm's upper half by final R@10 ({math.ceil(len(kept) / 2)} configurations): "
              "where promotions decide the winner.")
        if args.source:
            print(f"recomputed from {args.source}")
        else:
            print(f"wall time {wall:.0f} s ({sum(r['seconds'] for k, r in runs.items() if k in jobs):.0f} s of "
                  f"training in {len(jobs)} runs)")
        settings = {k: getattr(args, k) for k in ("configs", "seed", "epochs", "processes", "json", "source")}
        results.finish({"settings": {**settings, "arms": ARMS, "stage1_fraction": STAGE1_FRACTION},
                        "configs": configs, "kept": kept, "rows": rows, "upper_half": upper, "wall_s": round(wall, 1),
                        "runs": [{"config": i, "arm": a, **r} for (i, a), r in sorted(runs.items())]})
    return 0


def train_all(configs: list[dict], args, results: harness.Results) -> tuple[dict, dict]:
    """Every configuration under both arms (one run where the arms coincide), ``args.processes`` at
    once; returns ((config, arm) -> its run, the runs trained), each run saved as it ends."""
    jobs: dict[tuple[int, str], Any] = {}
    runs: dict[tuple[int, str], dict] = {}
    with ProcessPoolExecutor(args.processes) as pool:
        for i, c in enumerate(configs):
            for arm, settings in ARMS.items():
                if arm == "after" and c["data.batch_size"] == 16:
                    continue  # 256 videos at batch 16 = the 16 fixed steps: the same run as `before`
                jobs[(i, arm)] = pool.submit(train_curve, c, settings, args.epochs,
                                             SMOKE_CORPUS if args.smoke else None)
        for key, job in jobs.items():
            runs[key] = job.result()
            results.save(configs=configs, runs=[{"config": i, "arm": a, **r} for (i, a), r in runs.items()])
    for i, c in enumerate(configs):
        if (i, "after") not in runs:
            runs[(i, "after")] = runs[(i, "before")]
    return runs, jobs


if __name__ == "__main__":
    sys.exit(main())
