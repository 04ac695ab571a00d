"""The run assembly: the one place that builds what a training run is made of, and runs its epochs.

``assemble`` makes the :class:`~raymcn.train.loop.Run` (the model, optionally wrapped, e.g. in
DDP, optimizer, LR schedule, objective, loop state and the caller's hooks) from the config and the
:class:`~raymcn.train.run_plan.RunPlan`; ``run_epochs`` runs the epoch loop on it. What differs
between callers is in the run's :class:`~raymcn.train.loop.Hooks`: where the batches come from,
the evaluation, what happens after each step and epoch (checkpoint and report in the Ray worker; a
Tune report in the sweep-efficiency trials) and the progress log. The Ray worker (``worker.py``)
and every benchmark use these two functions, so a change to the real run is what they measure. No Ray.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from raymcn.collectives import Collectives
from raymcn.config import Config
from raymcn.losses import Clustering, Layout, MCNObjective
from raymcn.model import MCN
from raymcn.model.syncbn import global_batchnorm
from raymcn.train.feed import Prefetcher
from raymcn.train.loop import (
    EpochProgress,
    Hooks,
    LoopState,
    Run,
    build_optimizer,
    build_scheduler,
    train_one_epoch,
)
from raymcn.train.monitor import timeline
from raymcn.train.run_plan import RunPlan


def build_objective(cfg: Config, plan: RunPlan, device: torch.device | str,
                    comm: Collectives | None = None) -> MCNObjective:
    """The objective of a run: its loss settings, its clustering state (on ``device``) and the
    layout of its steps' rows the plan fixed, every rank's share of each step among them (the
    ranks exchange no row counts)."""
    comm = comm or Collectives()

    def shares(step: int) -> list[int]:
        return [v * plan.clips_per_video for v in plan.shares(comm.world, step)]

    cluster = Clustering(cfg.loss, embed_dim=cfg.model.embed_dim, queue_rows=plan.queue_rows,
                         queue_clips_per_video=plan.queue_clips_per_video, seed=cfg.run.seed, device=device)
    return MCNObjective(cfg.loss, cluster, comm, Layout(plan.clips_per_video, shares, cfg.scale.ring_contrastive))


def assemble(cfg: Config, plan: RunPlan, *, device: torch.device | str = "cpu", comm: Collectives | None = None,
             wrap: Callable[[nn.Module], nn.Module] | None = None,
             prepare: Callable[[nn.Module], None] | None = None, hooks: Hooks | None = None) -> Run:
    """Build one rank's run. The model is seeded with ``run.seed`` (every rank starts identical).
    No process-wide flag is set here: the rank's start sets the precision policy once
    (``loop.apply_precision``).

    Args:
        comm: this rank's collectives (default: one process).
        wrap: applied to the bare model (moved to its device) before the optimizer is built, e.g.
            Ray Train's ``prepare_model`` (DDP); default: the bare model on ``device``.
        prepare: called with the bare model before the wrap (e.g. loading ``run.init_from`` weights).
        hooks: what the caller plugs into the run (default: none).
    """
    device = torch.device(device)
    comm = comm or Collectives()
    torch.manual_seed(cfg.run.seed)
    net = MCN(cfg.model)
    if cfg.model.sync_batchnorm:  # statistics of the global batch: a forward independent of the world size
        net = global_batchnorm(net, device.type)
    if prepare is not None:
        prepare(net)
    model = wrap(net) if wrap is not None else net.to(device)
    net = getattr(model, "module", model)
    optimizer = build_optimizer(model, cfg)
    return Run(cfg=cfg, plan=plan, comm=comm, device=device, model=model, net=net, optimizer=optimizer,
               scheduler=build_scheduler(optimizer, cfg, plan.total_steps, plan.warmup_steps),
               objective=build_objective(cfg, plan, device, comm), state=LoopState(), hooks=hooks or Hooks())


def run_epochs(run: Run) -> dict[str, float]:
    """Train from ``run.state`` (an epoch boundary, or inside an epoch after a mid-epoch
    checkpoint) to the plan's last epoch, with ``run.hooks``; returns the last epoch's metrics.

    Each epoch's metrics: the per-step means of every loss term and timing phase, averaged over the
    ranks (``bad_samples`` and ``videos_read`` summed), ``workers`` (the world size), the
    evaluation's metrics with ``time_eval_s``, ``epoch`` (completed), ``global_step`` and
    ``budget_epoch`` (the sweep schedulers' clock).
    """
    plan, state, hooks = run.plan, run.state, run.hooks
    metrics: dict[str, float] = {}
    for epoch in range(state.epoch, plan.epochs):
        state.epoch = epoch
        start = state.step_in_epoch(plan.steps_per_epoch)  # > 0 only when resumed inside this epoch
        timeline.mark("epoch: steps started", rank=run.comm.rank, epoch=epoch)
        batches, stats = hooks.batches(run, epoch, start)
        # The next batches are fetched (and moved to the device) while the step runs.
        feed = Prefetcher(batches, run.device, depth=run.cfg.data.prefetch_batches,
                          stats=stats if hasattr(stats, "as_metrics") else None)
        try:
            metrics = train_one_epoch(run, feed, feed.stats)
        finally:
            feed.close()
        timeline.mark("epoch: steps done", rank=run.comm.rank, epoch=epoch)
        state.epoch = epoch + 1
        state.progress = EpochProgress()  # the epoch-end checkpoint holds no partial epoch
        metrics["workers"] = float(run.comm.world)  # an elastic group's size in this epoch
        if hooks.evaluate is not None:
            hooks.watch("evaluation", state.step)
            started = time.perf_counter()
            metrics.update(hooks.evaluate(run))
            metrics["time_eval_s"] = time.perf_counter() - started  # the epoch's evaluation, wall seconds
        metrics.update(epoch=float(state.epoch), global_step=float(state.step),
                       budget_epoch=float(plan.budget_epoch(state.epoch)))
        if hooks.log:
            hooks.log(f"epoch {state.epoch}/{plan.epochs} " + " ".join(
                f"{k}={v:.4g}" for k, v in metrics.items() if k.startswith("text_to_video") or k == "total_loss"))
        if hooks.after_epoch:
            hooks.watch("report", state.step)
            for hook in hooks.after_epoch:
                hook(run, metrics)
    return metrics
