"""The training loop as plain functions: optimizer, LR schedule, one epoch, evaluation. No Ray.

``train_one_epoch`` and ``evaluate`` return ``dict[str, float]``; the Ray side (``worker.py``)
only wires them to data, checkpoints and ``ray.train.report``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from raymcn.config import RETRIEVAL_METRICS, Config, PermanentError
from raymcn.losses import Collectives
from raymcn.train import faults
from raymcn.train.gradcache import cached_step, share_clips
from raymcn.train.metrics import ranks_of_matches, retrieval_metrics
from raymcn.train.stages import active_modalities, stage_of

# "reforward": gradient caching's second forward of each chunk (scale.grad_cache_clips; 0 s when off)
TIMING_PHASES = ("data", "forward", "loss", "backward", "reforward", "optimizer")


class NonFiniteLossError(RuntimeError, PermanentError):
    """Raised when the loss or gradients stayed non-finite for too many consecutive steps."""


@dataclass
class LoopState:
    """Counters that must survive a resume (checkpointed with the model)."""

    step: int = 0  # next global step
    epoch: int = 0  # next epoch
    nonfinite_streak: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict[str, int]:
        return dict(vars(self))

    def load_state_dict(self, d: dict[str, int]) -> None:
        for k, v in d.items():
            setattr(self, k, int(v))


def autocast(device: torch.device):
    """bf16 autocast on GPU (no GradScaler needed for bf16); plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def build_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up from 0 to 1, then a half cosine to 0 at ``total_steps`` (clamped there).

    Defined over the *global* step, so a resumed run continues the same curve (spec §3.2 quirk fixed).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return step / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config, total_steps: int, warmup_steps: int | None = None):
    """The LR schedule of a run: :func:`lr_factor` over the global step. ``warmup_steps`` is the
    run plan's (``plan.warmup_steps``); None derives it from ``cfg`` the same way."""
    if warmup_steps is None:
        from raymcn.train.plan import warmup_steps as planned

        warmup_steps = planned(cfg)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warmup_steps, total_steps))


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _sync(device: torch.device) -> float:
    # Without a sync, GPU kernels still queued would be billed to the next phase.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def train_one_epoch(model: nn.Module, objective: Callable, optimizer: torch.optim.Optimizer, scheduler,
                    batches: Iterable[dict], *, cfg: Config, state: LoopState, device: torch.device,
                    switch: int, log: Callable[[str], None] | None = None,
                    total_steps: int | None = None, rank: int = 0) -> dict[str, float]:
    """Run one pass over ``batches``; returns per-step means of every ``*_loss`` term and timings
    (``time_<phase>_s`` per step, ``time_first_batch_s`` the wait for the epoch's first batch,
    ``time_epoch_s`` the whole pass, ``samples_per_s`` = clips / that).

    Args:
        batches: dicts following the batch contract (video (b,4096), audio (b,40,T), nframes (b,),
            text (b,W,300), key); b = local videos × clips per video, video-major.
        switch: first global step of stage 2 (see ``stages.switch_step``).
        log: called with a progress line every ``cfg.run.log_every`` steps (rank 0 passes print).
        rank: this process's rank (fault injection picks a rank).

    With ``cfg.scale.grad_cache_clips`` smaller than the share, forward, loss and backward are
    :func:`raymcn.train.gradcache.cached_step` (chunked, exact; its re-forward is ``time_reforward_s``).

    Raises:
        NonFiniteLossError: more than ``cfg.optim.max_nonfinite_steps`` non-finite steps in a row.
    """
    model.train()
    sums: dict[str, float] = defaultdict(float)
    times = dict.fromkeys(TIMING_PHASES, 0.0)
    steps = clips = skipped = 0
    order = cfg.schedule.stage_order
    params = [p for p in model.parameters() if p.requires_grad]
    cache_clips = cfg.scale.grad_cache_clips
    epoch_start = tick = _sync(device)

    def lap(phase: str) -> None:  # the cached step's phases end inside it
        nonlocal tick
        tick = _lap(times, phase, tick, device)

    for batch in batches:
        batch = to_device(batch, device)
        # Free last step's gradients before the forward: holding them through forward and loss
        # costs one copy of the parameters (0.9 GB at paper size; measured by bench/step.py).
        optimizer.zero_grad(set_to_none=True)
        active = active_modalities(order, state.step, switch)
        tick = _lap(times, "data", tick, device)
        if steps == 0:  # the epoch's first batch: Ray Data starts the epoch (its own metric)
            first_batch = times["data"]
        if 0 < cache_clips < share_clips(batch):  # a chunk as large as the share would save nothing
            terms = cached_step(model, objective, batch, active, state.step, cache_clips,
                                forward_context=lambda: autocast(device), lap=lap,
                                poison=faults.at_step(state.step, rank))
        else:
            with autocast(device):
                out = model(batch, active)
            tick = _lap(times, "forward", tick, device)
            terms = objective(out, active, state.step)
            del out  # the embeddings and reconstructions are freed by the backward, not held through Adam
            if faults.at_step(state.step, rank):
                terms["total_loss"] = terms["total_loss"] * float("nan")
            tick = _lap(times, "loss", tick, device)
            terms["total_loss"].backward()  # DDP all-reduces gradients inside backward
            tick = _lap(times, "backward", tick, device)
        # Gradients are all-reduced, so every rank sees the same norm and takes the same decision.
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip or float("inf"))
        if torch.isfinite(norm):
            optimizer.step()
            state.nonfinite_streak = 0
        else:
            skipped += 1
            state.skipped_steps += 1
            state.nonfinite_streak += 1
            if log:
                log(f"non-finite loss/gradient at step {state.step} (skipped; {state.nonfinite_streak} in a row)")
            if state.nonfinite_streak > cfg.optim.max_nonfinite_steps:
                raise NonFiniteLossError(
                    f"loss or gradients non-finite for {state.nonfinite_streak} consecutive steps "
                    f"(last at global step {state.step}, terms: "
                    f"{ {k: v.item() for k, v in terms.items()} }); optim.max_nonfinite_steps="
                    f"{cfg.optim.max_nonfinite_steps}. Lower optim.lr or check the input data.")
        scheduler.step()
        state.step += 1
        tick = _lap(times, "optimizer", tick, device)
        values = {k: v.item() for k, v in terms.items()}  # one host sync per step
        for k, v in values.items():  # every key on every rank: metrics are averaged across ranks by key
            sums[k] += v if math.isfinite(v) else 0.0
        steps += 1
        clips += int(batch["video"].shape[0])
        if log and (steps % cfg.run.log_every == 0):
            log(_progress_line(state, steps, total_steps, values, clips, tick - epoch_start, order, switch))
    elapsed = max(tick - epoch_start, 1e-9)
    metrics = {k: v / max(1, steps - skipped) for k, v in sums.items()}
    metrics.update({f"time_{k}_s": v / max(1, steps) for k, v in times.items()})
    metrics.update(time_first_batch_s=first_batch if steps else 0.0, time_epoch_s=elapsed)
    metrics.update(samples_per_s=clips / elapsed, steps=float(steps), skipped_steps=float(skipped),
                   lr=float(optimizer.param_groups[0]["lr"]), stage=float(stage_of(order, state.step - 1, switch)))
    return metrics


def _lap(times: dict[str, float], phase: str, since: float, device: torch.device) -> float:
    now = _sync(device)
    times[phase] += now - since
    return now


def _progress_line(state: LoopState, steps: int, total: int | None, values: dict[str, float], clips: int,
                   elapsed: float, order: str, switch: int) -> str:
    terms = " ".join(f"{k.removesuffix('_loss')}={v:.4g}" for k, v in values.items() if k != "total_loss")
    of = f"/{total}" if total else ""
    return (f"epoch {state.epoch + 1} step {state.step}{of} stage {stage_of(order, state.step - 1, switch)} "
            f"loss={values['total_loss']:.4g} [{terms}] {clips / max(elapsed, 1e-9):.1f} clips/s")


@torch.no_grad()
def evaluate(model: nn.Module, eval_set, device: torch.device, chunk: int = 256,
             comm: Collectives | None = None) -> dict[str, float]:
    """Text-to-video retrieval on ``eval_set`` with all three branches; restores train mode after.

    With ``comm`` of several ranks every rank embeds its contiguous share of the clips (⌈N/world⌉,
    the last rank fewer), the shares are all-gathered (in rank order they are the set in order),
    rank 0 scores the whole set and broadcasts the metrics:
    each clip is embedded once instead of once per rank, and the metrics are those of one
    process scoring everything. Every rank must call it (collectives).

    Args:
        eval_set: object with arrays or tensors ``video`` (N,4096), ``audio`` (N,40,T),
            ``nframes`` (N,), ``text`` (N,W,300) and ``num_queries_total`` (R@K denominator).
        chunk: clips embedded at a time.
        comm: this rank's collectives (default: one process).
    """
    net = getattr(model, "module", model)  # bypass DDP: evaluation needs no gradient sync
    comm = comm or Collectives()
    was_training = net.training
    net.eval()
    try:
        n = eval_set.video.shape[0]
        share = -(-n // comm.world)
        bounds = [(min(n, r * share), min(n, (r + 1) * share)) for r in range(comm.world)]
        start, end = bounds[comm.rank]
        rows = torch.empty(end - start, 2, net.cfg.embed_dim, dtype=torch.float32, device=device)  # (text, gallery)
        for s in range(start, end, chunk):
            sl = slice(s, min(s + chunk, end))
            batch = to_device({k: torch.as_tensor(getattr(eval_set, k)[sl])
                               for k in ("video", "audio", "nframes", "text")}, device)
            with autocast(device):
                out = net.encode(batch)  # all three branches, no reconstruction heads
            rows[s - start:sl.stop - start, 0] = out["text"].float()
            rows[s - start:sl.stop - start, 1] = out["video"].float() + out["audio"].float()
        everyone = comm.all_gather(rows, sizes=[e - s for s, e in bounds])  # (N, 2, D): every clip once, in order
        total = float(getattr(eval_set, "num_queries_total", None) or n)
        keys = [*RETRIEVAL_METRICS, "eval_size"]
        values = torch.zeros(len(keys), dtype=torch.float64, device=device)
        if comm.rank == 0:
            metrics = retrieval_metrics(ranks_of_matches(everyone[:, 0], everyone[:, 1]), int(total))
            metrics["eval_size"] = total
            values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=device)
        return dict(zip(keys, comm.broadcast_from_rank0(values).tolist()))
    finally:
        net.train(was_training)
