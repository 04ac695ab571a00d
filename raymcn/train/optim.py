"""The optimizer, the LR schedule and the precision policy of a run. No Ray."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from raymcn.config import Config
from raymcn.train.run_plan import warmup_steps as planned_warmup


def autocast(device: torch.device):
    """bf16 autocast on GPU (no GradScaler needed for bf16); plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def apply_precision(cfg: Config) -> None:
    """The process's precision policy: process-wide torch flags, set once at a rank's start (the
    Ray worker, the step probe, a benchmark's rank), never by the run's assembly.

    * The model's forward runs under :func:`autocast` (bf16 on GPU); the losses, k-means and the
      retrieval scores compute in fp32 (they disable autocast themselves).
    * Those fp32 matrix products use ``scale.matmul_precision``: ``"highest"`` = true fp32 (TF32
      off for matmuls and for cuDNN), ``"high"`` = TF32 allowed on Ampere and later GPUs (the
      default argued in ``config/sections.py`` and docs/memory.md).
    * ``cudnn.benchmark`` on: a run's convolutions see few shapes (a share of ⌊B/N⌋ or ⌈B/N⌉ videos,
      gradient-caching chunks, the evaluation), so each is tuned once and reused for the whole run.
      The price on CUDA: each process picks its algorithms by timing them, and some of cuDNN's use
      atomics, so a restarted attempt's convolutions may round differently from the attempt it
      replaces; GPU runs are therefore reproducible to rounding, not bitwise (on CPU they are,
      docs/development.md, "Equal on any x86-64 CPU").
    """
    torch.set_float32_matmul_precision(cfg.scale.matmul_precision)  # also sets cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = cfg.scale.matmul_precision != "highest"
    torch.backends.cudnn.benchmark = True


def build_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up from 0 to 1, then a half cosine to 0 at ``total_steps`` (clamped there).

    Defined over the *global* step, so a resumed run continues the same curve.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return step / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config, total_steps: int, warmup_steps: int | None = None):
    """The LR schedule of a run: :func:`lr_factor` over the global step. ``warmup_steps`` is the
    run plan's (``plan.warmup_steps``); None derives it from ``cfg`` the same way."""
    if warmup_steps is None:
        warmup_steps = planned_warmup(cfg)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warmup_steps, total_steps))
