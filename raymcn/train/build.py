"""The run assembly: the one place that builds what a training run is made of. No Ray.

``assemble`` makes the :class:`~raymcn.train.run.Run` (the model, optionally wrapped, e.g. in
DDP, optimizer, LR schedule, objective, loop state and the caller's hooks) from the config and the
:class:`~raymcn.train.run_plan.RunPlan`; ``loop.run_epochs`` trains it. What differs between
callers is in the run's :class:`~raymcn.train.run.Hooks`: where the batches come from, the
evaluation, the checkpoint (a folder and a report in the Ray worker), what happens after each step
and epoch (a Tune report in the sweep-efficiency trials) and the progress log. The Ray worker
(``worker.py``) and every benchmark assemble their runs here, so a change to the real run is what
they measure.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from raymcn.collectives import Collectives
from raymcn.config import Config
from raymcn.losses import Clustering, Layout, MCNObjective
from raymcn.model import MCN
from raymcn.model.syncbn import global_batchnorm
from raymcn.train.compiled import CompileClock, compile_model
from raymcn.train.optim import build_optimizer, build_scheduler
from raymcn.train.run import Hooks, LoopState, Run
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
    (``optim.apply_precision``).

    Args:
        comm: this rank's collectives (default: one process).
        wrap: applied to the bare model (moved to its device) before the optimizer is built, e.g.
            Ray Train's ``prepare_model`` (DDP); default: the bare model on ``device``. With
            ``scale.compile`` the wrapped model is then compiled (``compiled.py``); ``run.net``
            stays the bare model, which the checkpoints hold.
        prepare: called with the bare model before the wrap (e.g. loading ``run.init_from`` weights).
        hooks: what the caller plugs into the run (default: none).
    """
    device = torch.device(device)
    comm = comm or Collectives()
    torch.manual_seed(cfg.run.seed)
    net = MCN(cfg.model)
    if cfg.model.sync_batchnorm:  # statistics of the global batch: a forward independent of the world size
        net = global_batchnorm(net, device.type)
    net.set_layout(cfg.scale.davenet_layout)
    if prepare is not None:
        prepare(net)
    model = wrap(net) if wrap is not None else net.to(device)
    net = getattr(model, "module", model)  # the bare model, as the checkpoints hold it
    if cfg.scale.compile:
        model = compile_model(model)
    optimizer = build_optimizer(model, cfg)
    return Run(cfg=cfg, plan=plan, comm=comm, device=device, model=model, net=net, optimizer=optimizer,
               scheduler=build_scheduler(optimizer, cfg, plan.total_steps, plan.warmup_steps),
               objective=build_objective(cfg, plan, device, comm), state=LoopState(), hooks=hooks or Hooks(),
               compile_clock=CompileClock() if cfg.scale.compile else None)
