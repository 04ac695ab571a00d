"""Evaluation once instead of once per rank: the epoch's evaluation time, unsharded vs sharded.

    python -m bench.eval_sharding                      # paper dims, 256 clips, 2 gloo ranks (~3 min)
    python -m bench.eval_sharding --clips 64 --quick   # the preset's tiny MCN
    python -m bench.eval_sharding --json               # the table, then one JSON line

Before, every rank embedded and scored the whole eval set after each epoch (``worker.py``); now
each rank embeds its contiguous share (⌈N/world⌉ clips), the shares are gathered and rank 0 scores
once (``raymcn.train.evaluate.evaluate`` with ``comm``). Both run here on ``--world`` gloo processes
(1 torch thread each, the model at initialisation in eval mode, random inputs of the eval set's
shapes, 1000 audio frames at paper dims), ``--repeats`` times each, alternating; the figure is the
slowest rank's wall time (the epoch waits for it), median over repeats. Both must give the same
metrics (checked).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from bench import harness
from bench.gloo import gloo_ranks
from bench.readers import random_eval_set
from raymcn.collectives import Collectives
from raymcn.config import ModelConfig
from raymcn.model import MCN
from raymcn.results.render import render_table
from raymcn.train.evaluate import evaluate

TINY = ModelConfig(embed_dim=128, audio_channels=(16, 16, 32, 32, 64), recon_hidden=64)


def _worker(rank: int, world: int, args: dict) -> dict:
    model_cfg = TINY if args["quick"] else ModelConfig()
    torch.manual_seed(0)
    model = MCN(model_cfg)
    eval_set = random_eval_set(args["clips"], model_cfg.video_dim, model_cfg.mel_bins, 128 if args["quick"] else 1000,
                               20, model_cfg.word_dim)
    device, comm = torch.device("cpu"), Collectives(rank, world)
    times = {"every rank, whole set (before)": [], "sharded, scored once (now)": []}
    metrics = {}
    for _ in range(args["repeats"]):
        for name, c in zip(times, (None, comm)):
            dist.barrier()
            started = time.perf_counter()
            metrics[name] = evaluate(model, eval_set, device, comm=c)
            times[name].append(time.perf_counter() - started)
    return {"times": times, "metrics": metrics}


SMOKE = {"clips": 16, "repeats": 1, "quick": True}


def build_parser():
    ap = harness.parser(__doc__, smoke="the tiny MCN, 16 clips, 1 repeat", raw=True)
    ap.add_argument("--clips", type=int, default=256, help="eval clips (default 256)")
    ap.add_argument("--world", type=int, default=2, help="gloo ranks (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="timed evaluations of each kind (default 3)")
    ap.add_argument("--quick", action="store_true", help="the preset's tiny MCN instead of paper dims")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = harness.parse_args(build_parser(), argv, SMOKE)
    with harness.Results("eval_sharding", args) as results:
        same = measure(args, results)
    return 0 if same else 1


def measure(args, results: harness.Results) -> bool:
    """Both evaluations on the gloo ranks, the table; whether they gave the same metrics."""
    ranks = gloo_ranks(_worker, args.world, {k: getattr(args, k) for k in ("clips", "repeats", "quick")})
    names = list(ranks[0]["times"])
    slowest = {n: [max(r["times"][n][i] for r in ranks) for i in range(args.repeats)] for n in names}
    median = {n: statistics.median(v) for n, v in slowest.items()}
    same = all(r["metrics"][names[0]] == r["metrics"][names[1]] for r in ranks)
    base = median[names[0]]
    rows = [{"evaluation": n, "slowest rank s (median)": f"{median[n]:.2f}", "vs before": f"{median[n] / base:.2f}"}
            for n in names]
    print(f"bench.eval_sharding: {'tiny' if args.quick else 'paper-dim'} MCN, {args.clips} clips, "
          f"{args.world} gloo ranks x 1 thread, {args.repeats} repeats")
    print(render_table(rows))
    print(f"same metrics both ways on every rank: {same}")
    settings = {k: getattr(args, k) for k in ("clips", "world", "repeats", "quick", "json")}
    results.finish({"settings": settings, "slowest_rank_s": slowest, "median_s": median, "same": same})
    return same


if __name__ == "__main__":
    sys.exit(main())
