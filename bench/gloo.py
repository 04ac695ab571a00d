"""A function run on gloo ranks in separate processes: what the tests of collectives and the
benchmarks of distributed code (bench.kmeans, bench.eval_sharding) share."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.rank_exit import end_rank


def gloo_ranks(fn: Callable[..., Any], world: int, *args, threads: int = 1, timeout_s: float | None = None) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes joined in a gloo process group; returns
    each rank's result (picklable by torch.save), in rank order.

    ``fn`` must be importable by the child processes (a module-level function). A rank that
    returns ends its process with ``rank_exit.end_rank`` (every rank's last collective done, the
    group destroyed, no interpreter finalization): returning from it with the group's gloo threads
    still releasing work aborted a rank ("terminate called without an active exception") in 2 of
    27 runs. ``timeout_s``: the group's timeout (a rank waiting in a collective the others never
    call then fails instead of hanging)."""
    with tempfile.TemporaryDirectory() as where:
        mp.spawn(_rank, args=(world, where, fn, args, threads, timeout_s), nprocs=world, join=True)
        return [torch.load(os.path.join(where, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _rank(rank: int, world: int, where: str, fn, args: tuple, threads: int, timeout_s: float | None) -> None:
    torch.set_num_threads(threads)
    extra = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group("gloo", init_method=f"file://{where}/init", rank=rank, world_size=world, **extra)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(where, f"rank{rank}.pt"))
    except BaseException:
        dist.destroy_process_group()  # no barrier: the other ranks may be gone
        raise
    end_rank(0)
