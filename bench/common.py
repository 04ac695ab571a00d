"""What several benchmarks (and the tests of collectives) share: the machine line printed beside
every figure, and a function run on gloo ranks in separate processes."""

from __future__ import annotations

import os
import platform
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def machine_line() -> str:
    """CPU model, cores, host and torch version: the figures of a benchmark depend on them."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return (f"{model}, {os.cpu_count()} cores, {platform.node()}, torch {torch.__version__} with "
            f"{torch.get_num_threads()} threads")


def gloo_ranks(fn: Callable[..., Any], world: int, *args, threads: int = 1, timeout_s: float | None = None) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes joined in a gloo process group; returns
    each rank's result (picklable by torch.save), in rank order.

    ``fn`` must be importable by the child processes (a module-level function). Every rank waits at
    a barrier for the others' last collectives before the group is destroyed: destroying it right
    after DDP's last step, with gloo work still in flight, aborted a rank ("terminate called without
    an active exception") in 2 of 27 runs. ``timeout_s``: the group's timeout (a rank waiting in a
    collective the others never call then fails instead of hanging)."""
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
        dist.barrier()
    finally:
        dist.destroy_process_group()
