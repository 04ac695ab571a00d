"""The real training step of a config, measured on one device of this machine: no Ray, no shards.

One process, a 1-rank process group (NCCL on CUDA, gloo on CPU) and the model wrapped in DDP as a
Ray Train worker wraps it (``gradient_as_bucket_view``), so the step is the one a worker runs:
``build.assemble`` (precision policy, model, Adam, LR schedule, objective) and
``loop.train_one_epoch`` over batches fed by ``feed.Prefetcher`` (pinned and copied on a side stream
on CUDA), forward under bf16 autocast, losses and k-means in fp32. The batches are random tensors
of the batch contract at the config's dims (``data/formats/batch.random_batch``).
``bench/gpu_smoke.py`` and ``raymcn doctor --step`` both measure through :func:`measure_step`.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from raymcn.collectives import Collectives
from raymcn.config import Config
from raymcn.data.formats.batch import random_batch
from raymcn.train.build import assemble
from raymcn.train.feed import Prefetcher
from raymcn.train.loop import train_one_epoch
from raymcn.train.monitor.epoch_metrics import EpochProgress
from raymcn.train.optim import apply_precision
from raymcn.train.preflight.footprint import allocator_total, estimate_worker_memory
from raymcn.train.run_plan import make_plan


@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[None]:
    """A process group of this process alone (the DDP wrap needs one), unless one exists."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def measure_step(cfg: Config, device: torch.device, warmup: int = 2, steps: int = 5) -> dict:
    """``warmup`` steps (cuDNN autotuning, the first k-means fit; not timed), then ``steps`` timed
    steps of ``cfg``'s share of one worker (``data.batch_size`` videos on this one device).

    Returns: ``clips`` per step, ``s_per_step_wall``, ``samples_per_s``, ``phases_s`` (seconds per
    step by phase), ``losses`` (the timed steps' means), ``estimate_bytes`` (the preflight's
    estimate of what torch's allocator holds: ``footprint.allocator_total``, the CUDA context left
    out, as the peak leaves it out), ``peak_bytes`` (allocated device memory at its peak; None on
    CPU) and ``estimate_over_peak``.
    """
    cfg = cfg.replace({"scale.num_workers": 1, "scale.use_gpu": device.type == "cuda",
                       "schedule.steps_per_epoch": warmup + steps, "schedule.epochs": 2, "optim.warmup_steps": 1})
    plan = make_plan(cfg, cfg.data.batch_size * (warmup + steps))
    cuda = device.type == "cuda"
    if cuda:
        # First, before any other CUDA call: it initialises CUDA on this device. A fresh process (the
        # doctor's Ray task) has not, and the allocator's statistics below raise until it has
        # ("Invalid device argument ... did you call init?"); NCCL's group then binds this device.
        torch.cuda.set_device(device)
    with one_rank_group(device):
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) if cuda else 0

        def wrap(net):
            net = net.to(device)
            return DistributedDataParallel(net, device_ids=[device.index] if cuda else None,
                                           find_unused_parameters=False, gradient_as_bucket_view=True)

        apply_precision(cfg)  # as a rank sets it at its start
        run = assemble(cfg, plan, device=device, comm=Collectives(0, 1), wrap=wrap)
        batch = random_batch(cfg, cfg.clips_per_step)

        def epoch(n: int) -> dict:
            feed = Prefetcher((batch for _ in range(n)), device, depth=cfg.data.prefetch_batches)
            try:
                return train_one_epoch(run, feed)
            finally:
                feed.close()

        epoch(warmup)
        run.state.progress = EpochProgress()  # the timed steps' metrics only
        started = time.perf_counter()
        metrics = epoch(steps)
        wall = (time.perf_counter() - started) / steps
        peak = (torch.cuda.max_memory_allocated(device) - base) if cuda else None
    estimate = allocator_total(estimate_worker_memory(cfg))
    return {"clips": cfg.clips_per_step, "s_per_step_wall": wall, "samples_per_s": metrics["samples_per_s"],
            "phases_s": {k[5:-2]: v for k, v in metrics.items() if k.startswith("time_") and k.endswith("_s")
                         and k not in ("time_epoch_s", "time_first_batch_s")},
            "losses": {k: v for k, v in metrics.items() if k.endswith("_loss")},
            "estimate_bytes": estimate, "peak_bytes": peak, "estimate_over_peak": estimate / peak if peak else None}

