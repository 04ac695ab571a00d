"""A :class:`raymcn.train.loop.Run` from a test's own model (a stand-in for MCN, a DDP wrapper),
as ``raymcn.train.build.assemble`` would hold it: the config's one-step plan (the same plan the
test objective ``conftest.objective_for`` is built from), Adam, the LR curve over 100 steps."""

from __future__ import annotations

import torch
from conftest import objective_for

from raymcn.collectives import Collectives
from raymcn.train.loop import Hooks, LoopState, Run, build_optimizer, build_scheduler
from raymcn.train.run_plan import make_plan


def run_of(cfg, model: torch.nn.Module, *, objective=None, state: LoopState | None = None,
           comm: Collectives | None = None, hooks: Hooks | None = None) -> Run:
    optimizer = build_optimizer(model, cfg)
    return Run(cfg=cfg, plan=make_plan(cfg, videos=cfg.data.batch_size), comm=comm or Collectives(),
               device=torch.device("cpu"), model=model, net=getattr(model, "module", model), optimizer=optimizer,
               scheduler=build_scheduler(optimizer, cfg, 100), objective=objective or objective_for(cfg, comm=comm),
               state=state or LoopState(), hooks=hooks or Hooks())
