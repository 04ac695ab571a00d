"""k-means refit at paper size: rank 0 alone (before) vs every rank assigning its share (after).

    python -m bench.kmeans                    # paper size, 1 and 2 ranks x 1 thread, 3 iterations (~1 min)
    python -m bench.kmeans --world 1 2 4      # more ranks (each a gloo process with its own threads)
    python -m bench.kmeans --quick            # a small size: the path works
    python -m bench.kmeans --json             # the table, then one JSON line with every figure

What runs: ``raymcn.losses.cosine_kmeans`` on the refit's input at the paper's sizes: the queue
(20 steps x 4096 clips x half of each video's clips = 40 960 rows) plus the step's 4096 clips,
D = 6144, K = 256, fp32, warm-started from the previous centroids as in training (here: the first
K rows), ``--iters`` Lloyd iterations with the tolerance off (the training refit stops at
``loss.kmeans_iters`` = 100 or when the centroids stop moving). With 1 rank the process does all of
the assignment, which is what the refit cost before (rank 0 fitted, the other ranks waited in the
broadcast); with N ranks every rank is a gloo process with ``--threads`` torch threads that
assigns its ⌈rows/N⌉ rows, and the centroid sums and counts are all-reduced (the same centroids).
Each rank is timed from a barrier to its end; a row reports the slowest rank. On CPU each rank
needs its own cores (N x threads <= cores) to stand for N GPUs.

Figures: seconds per Lloyd iteration, the extrapolated seconds of a 100-iteration refit, the speed-up
over 1 rank, and the largest centroid difference from 1 rank's (float rounding of the summed shares).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from bench import harness
from bench.gloo import gloo_ranks
from raymcn.collectives import Collectives
from raymcn.losses import cosine_kmeans

PAPER = {"rows": 40960 + 4096, "dim": 6144, "k": 256}
QUICK = {"rows": 4000, "dim": 256, "k": 32}
REFIT_ITERS = 100  # loss.kmeans_iters


def points(rows: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Feature-like rows: non-negative (post-ReLU fused embeddings), a few hundred directions."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(64, dim, generator=g)
    return (centres[torch.randint(0, 64, (rows,), generator=g)] + torch.randn(rows, dim, generator=g)).relu_()


def fit(comm: Collectives, size: dict, iters: int) -> tuple[float, torch.Tensor]:
    x = points(size["rows"], size["dim"])
    init = x[:size["k"]].clone()
    if comm.world > 1:
        dist.barrier()
    start = time.perf_counter()
    centroids, _ = cosine_kmeans(x, size["k"], iters, 0.0, init=init, comm=comm)
    return time.perf_counter() - start, centroids


def _rank(rank: int, world: int, size: dict, iters: int) -> dict:
    seconds, centroids = fit(Collectives(rank, world), size, iters)
    return {"seconds": seconds, "centroids": centroids if rank == 0 else None}


def run(world: int, threads: int, size: dict, iters: int) -> tuple[float, torch.Tensor]:
    """The slowest rank's seconds and rank 0's centroids."""
    if world == 1:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return fit(Collectives(), size, iters)
        finally:
            torch.set_num_threads(before)
    results = gloo_ranks(_rank, world, size, iters, threads=threads)
    return max(r["seconds"] for r in results), results[0]["centroids"]


def build_parser():
    ap = harness.parser(__doc__, smoke="the --quick size, 1 rank then 2, 2 iterations")
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.quick, args.world, args.iters = True, [1, 2], 2
    size = QUICK if args.quick else PAPER
    if max(args.world) * args.threads > (os.cpu_count() or 1):
        print(f"note: {max(args.world)} ranks x {args.threads} threads exceed this machine's "
              f"{os.cpu_count()} CPUs: the ranks share cores and the speed-up understates N devices")
    print(f"k-means refit input: {size['rows']} rows x D={size['dim']}, K={size['k']}, fp32, "
          f"{args.iters} iterations, {args.threads} thread(s) per rank")
    rows, base = [], None
    with harness.Results("kmeans", args) as results:
        for world in args.world:
            seconds, centroids = run(world, args.threads, size, args.iters)
            per_iter = seconds / args.iters
            if base is None:
                base = (per_iter, centroids)
            diff = float((centroids - base[1]).abs().max())
            rows.append({"world": world, "s_per_iteration": per_iter, "s_per_refit": per_iter * REFIT_ITERS,
                         "speedup": base[0] / per_iter, "max_centroid_diff": diff})
            results.save(rows=rows)
        table(rows)
        results.finish({"size": size, "iters": args.iters, "threads": args.threads, "rows": rows})
    return 0


def table(rows: list[dict]) -> None:
    print(f"{'ranks':>5} | {'s / iteration':>13} | {'s / refit (100 it.)':>19} | {'speed-up':>8} | "
          f"{'max |C - C_1|':>13}")
    for r in rows:
        print(f"{r['world']:>5} | {r['s_per_iteration']:>13.3f} | {r['s_per_refit']:>19.1f} | "
              f"{r['speedup']:>7.2f}x | {r['max_centroid_diff']:>13.2e}")


if __name__ == "__main__":
    sys.exit(main())
