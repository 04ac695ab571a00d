"""Distributed k-means assignment (losses/cluster.py, ``comm=``): 2 and 3 gloo ranks, each assigning
its contiguous share of the rows (1001 rows never divide evenly) with the centroid sums and counts
all-reduced, give the centroids and labels of one process doing all of it, to 1e-5, with random
initialisation, with a warm start that leaves clusters empty (re-seeded from the global worst-fit
rows), and with an early stop by the tolerance (every rank stops at the same iteration)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import last_json

from bench.gloo import gloo_ranks
from raymcn.collectives import Collectives
from raymcn.losses import cosine_kmeans

pytestmark = pytest.mark.dist

N, D, K = 1001, 24, 12
CASES = {  # name -> (iterations, tolerance, warm start?)
    "random init, all iterations": (15, 0.0, False),
    "warm start with empty clusters": (15, 0.0, True),
    "stops by tolerance": (200, 1e-3, False),
}


def _points() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    centres = torch.randn(K, D, generator=g) * 3
    x = centres[torch.randint(0, K, (N,), generator=g)] + torch.randn(N, D, generator=g)
    x = x.relu()  # non-negative, like the fused post-ReLU embeddings
    # a warm start whose last 4 centroids point where no row is: empty on the first pass
    init = torch.cat([x[:K - 4], -torch.ones(4, D)])
    return x, init


def _fit(comm: Collectives) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    x, init = _points()
    out = {}
    for name, (iters, tol, warm) in CASES.items():
        out[name] = cosine_kmeans(x, K, iters, tol, init=init if warm else None,
                                  generator=torch.Generator().manual_seed(11), chunk_rows=97, comm=comm)
    return out


def _fit_on_rank(rank: int, world: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return _fit(Collectives(rank, world))


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_sharing_the_assignment_give_the_centroids_of_one_process(tmp_path, world):
    reference = _fit(Collectives())
    x, init = _points()
    assert (reference["warm start with empty clusters"][1].bincount(minlength=K) > 0).all()  # reseeded
    # The group's timeout: a rank left waiting fails naming the collective it waited in, well inside
    # pytest's limit (a rank left in the last barrier once waited past it: bench/rank_exit.py)
    ranks = gloo_ranks(_fit_on_rank, world, timeout_s=300)
    for name, (centroids, labels) in reference.items():
        for r, fitted in enumerate(ranks):
            got_c, got_l = fitted[name]
            torch.testing.assert_close(got_c, centroids, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} rank {r}: {m}")
            assert torch.equal(got_l, labels), f"{name} rank {r}: labels differ"


def test_shares_cover_every_row_once():
    for n in (0, 1, 7, 1001):
        for world in (1, 2, 3, 4):
            bounds = [Collectives(r, world).share(n) for r in range(world)]
            assert [hi - lo for lo, hi in bounds] == Collectives(0, world).share_sizes(n)
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


@pytest.mark.slow  # the benchmark's own ranks: the full tier
def test_the_benchmark_reports_the_same_centroids_on_two_ranks():
    """bench.kmeans (the before/after figure of docs/performance.md) at its smoke size: 1 rank, then 2
    (the suite's smoke run of bench.kmeans)."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "bench.kmeans", "--smoke", "--json"],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = last_json(proc.stdout)["rows"]
    assert [r["world"] for r in rows] == [1, 2]
    assert rows[1]["max_centroid_diff"] <= 1e-5 and rows[0]["max_centroid_diff"] == 0
