"""The real training step of a config, measured on one device of this machine: no Ray, no shards.

One process, a 1-rank process group (NCCL on CUDA, gloo on CPU) and the model wrapped in DDP as a
Ray Train worker wraps it (``gradient_as_bucket_view``), so the step is the one a worker runs:
``build.assemble`` (precision policy, model, Adam, LR schedule, objective) and
``loop.train_one_epoch`` over batches fed by ``feed.Prefetcher`` (pinned and copied on a side stream
on CUDA), forward under bf16 autocast, losses and k-means in fp32. The batches are random tensors
of the batch contract at the config's dims (``data/formats/batch.random_batch``).
``bench/gpu_smoke.py`` and ``raymcn doctor --step`` both measure through :func:`measure_step`;
``bench/gpu_smoke.py --compare`` times several :class:`StepRig` in turn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from raymcn.collectives import Collectives
from raymcn.config import Config
from raymcn.data.formats.batch import random_batch
from raymcn.model.parts import text_in_bf16
from raymcn.train.build import assemble
from raymcn.train.feed import Prefetcher
from raymcn.train.loop import cache_chunk, train_one_epoch
from raymcn.train.monitor.epoch_metrics import EpochProgress
from raymcn.train.optim import apply_precision
from raymcn.train.preflight.footprint import allocator_total, estimate_worker_memory
from raymcn.train.run_plan import make_plan


def rig_config(cfg: Config, cuda: bool, max_steps: int = 1000) -> Config:
    """``cfg`` as :class:`StepRig` measures it: one worker, on the GPU or not, room for ``max_steps``."""
    return cfg.replace({"scale.num_workers": 1, "scale.use_gpu": cuda, "schedule.steps_per_epoch": max_steps,
                        "schedule.epochs": 2, "optim.warmup_steps": 1})


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


class StepRig:
    """One worker's share of ``cfg``'s step on ``device``, built once and run in blocks of steps, so
    that several rigs (variants of one step) can be timed in turn in one process: its run (the
    model wrapped in DDP on the one-rank group, as a Ray Train worker wraps it; Adam; the objective)
    and its batch stay allocated between blocks. Needs the process group (:func:`one_rank_group`).

    Attributes:
        cfg: ``cfg`` as measured (one worker, the step count of :meth:`steps`).
        run: the assembled run; ``run.compile_clock`` is set with ``scale.compile``.
        held_bytes: device memory the rig holds between its blocks of steps (parameters, gradient
            buckets, optimizer state once it exists, queue): what its build and its blocks added to
            the allocator and kept, other rigs' memory left out (None on CPU).
    """

    def __init__(self, cfg: Config, device: torch.device, max_steps: int = 1000):
        self.cfg = rig_config(cfg, device.type == "cuda", max_steps)
        self.device, self.cuda = device, device.type == "cuda"
        plan = make_plan(self.cfg, self.cfg.data.batch_size * max_steps)
        before = torch.cuda.memory_allocated(device) if self.cuda else 0

        def wrap(net):
            net = net.to(device)
            return DistributedDataParallel(net, device_ids=[device.index] if self.cuda else None,
                                           find_unused_parameters=False, gradient_as_bucket_view=True)

        apply_precision(self.cfg)  # as a rank sets it at its start
        self.run = assemble(self.cfg, plan, device=device, comm=Collectives(0, 1), wrap=wrap)
        self.batch = random_batch(self.cfg, self.cfg.clips_per_step,
                                  text_bf16=text_in_bf16(self.cfg.model, self.cuda))  # as the reader sends it
        self.held_bytes = (torch.cuda.memory_allocated(device) - before) if self.cuda else None

    def steps(self, n: int) -> tuple[dict[str, float], float, int | None]:
        """``n`` training steps (an epoch's loop over prefetched copies of the batch): (the loop's
        metrics over them, wall seconds per step, this rig's device memory at the block's peak:
        what it held when the block began plus the most the block added; None on CPU). Ends with
        the loop's host sync."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            start_bytes = torch.cuda.memory_allocated(self.device)
        self.run.state.progress = EpochProgress()  # this block's metrics only
        feed = Prefetcher((self.batch for _ in range(n)), self.device, depth=self.cfg.data.prefetch_batches)
        started = time.perf_counter()
        try:
            metrics = train_one_epoch(self.run, feed)
        finally:
            feed.close()
        wall = (time.perf_counter() - started) / n
        if not self.cuda:
            return metrics, wall, None
        peak = self.held_bytes + torch.cuda.max_memory_allocated(self.device) - start_bytes
        self.held_bytes += torch.cuda.memory_allocated(self.device) - start_bytes  # e.g. Adam's state, once
        return metrics, wall, peak

    def step_flops(self) -> int:
        """Floating-point operations of one forward, objective and backward of the step, as torch's
        ``FlopCounterMode`` counts them (matrix products and convolutions), run eagerly on the bare
        model: the same arithmetic in every layout and with or without compiling."""
        from torch.utils.flop_counter import FlopCounterMode

        from raymcn.train.loop import forward_backward
        from raymcn.train.stages import active_modalities

        run = self.run
        batch = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in self.batch.items()}
        active = active_modalities(self.cfg.schedule.stage_order, run.state.step, run.plan.switch_step)
        eager = dataclasses.replace(run, model=run.net)  # bare and uncompiled: every op is seen
        counter = FlopCounterMode(display=False)
        with counter:
            forward_backward(eager, batch, active, cache_chunk(self.cfg, 1), lambda phase: None)
        run.optimizer.zero_grad(set_to_none=True)
        return int(counter.get_total_flops())


def measure_step(cfg: Config, device: torch.device, warmup: int = 2, steps: int = 5) -> dict:
    """``warmup`` steps (cuDNN autotuning, the first k-means fit; not timed), then ``steps`` timed
    steps of ``cfg``'s share of one worker (``data.batch_size`` videos on this one device).

    Returns: ``clips`` per step, ``s_per_step_wall``, ``samples_per_s``, ``phases_s`` (seconds per
    step by phase), ``losses`` (the timed steps' means), ``estimate_bytes`` (the preflight's
    estimate of what torch's allocator holds: ``footprint.allocator_total``, the CUDA context left
    out, as the peak leaves it out), ``peak_bytes`` (allocated device memory at its peak; None on
    CPU) and ``estimate_over_peak``.
    """
    cuda = device.type == "cuda"
    if cuda:
        # First, before any other CUDA call: it initialises CUDA on this device. A fresh process (the
        # doctor's Ray task) has not, and the allocator's statistics below raise until it has
        # ("Invalid device argument ... did you call init?"); NCCL's group then binds this device.
        torch.cuda.set_device(device)
    with one_rank_group(device):
        if cuda:
            torch.cuda.empty_cache()
        rig = StepRig(cfg, device, max_steps=warmup + steps)
        _, _, warming = rig.steps(warmup)  # its peak counts too: cuDNN's autotuning, the first k-means fit
        metrics, wall, timed = rig.steps(steps)
        peak = max(warming, timed) if cuda else None
    return step_figures(rig, metrics, wall, peak)


def step_figures(rig: StepRig, metrics: dict[str, float], wall: float, peak: int | None) -> dict:
    """:func:`measure_step`'s dict for ``rig``'s timed steps (their ``metrics`` and ``wall`` seconds
    per step) and the device memory ``peak``."""
    estimate = allocator_total(estimate_worker_memory(rig.cfg))
    return {"clips": rig.cfg.clips_per_step, "s_per_step_wall": wall, "samples_per_s": metrics["samples_per_s"],
            "phases_s": {k[5:-2]: v for k, v in metrics.items() if k.startswith("time_") and k.endswith("_s")
                         and k not in ("time_epoch_s", "time_first_batch_s", "time_compile_s")},
            "losses": {k: v for k, v in metrics.items() if k.endswith("_loss")},
            "estimate_bytes": estimate, "peak_bytes": peak, "estimate_over_peak": estimate / peak if peak else None}
