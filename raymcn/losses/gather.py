"""The only place the losses talk to other ranks.

Every function here is a collective when a process group is initialised: it must be called by
*all* ranks, in the same order, with tensors of the same shape on every rank (the gathers assume
an equal local batch per rank). Without a process group (or with world size 1) every function is
the identity / a no-op, so the losses run unchanged in a single process.

No gradient crosses ranks here: the contrastive loss computes each rank's full gradient locally
(see contrastive.py), so the backward pass runs no collective of the losses' own; DDP's gradient
all-reduce is the only one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_info() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` when none is initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@torch.no_grad()
def all_gather_no_grad(x: torch.Tensor) -> torch.Tensor:
    """(b, ...) per rank -> (world·b, ...) in rank order, detached. Identity (detached) when world is 1.

    Gathered straight into one (world·b, ...) tensor: no per-rank parts plus a concatenated copy.
    """
    _, world = world_info()
    x = x.detach()
    if world == 1:
        return x
    x = x.contiguous()
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    # torch 2.13 names the single-tensor all-gather all_gather_single (all_gather_into_tensor
    # warns); releases before it, down to the pyproject's 2.3, have only all_gather_into_tensor.
    gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_into(out, x)
    return out


@torch.no_grad()
def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean of ``t`` over ranks (a detached copy), for reporting; ``t.detach()`` when world is 1."""
    _, world = world_info()
    t = t.detach().clone()
    if world == 1:
        return t
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / world


@torch.no_grad()
def broadcast_from_rank0(t: torch.Tensor) -> torch.Tensor:
    """Overwrite ``t`` (same shape/dtype on every rank) with rank 0's value, in place; returns ``t``."""
    _, world = world_info()
    if world > 1:
        dist.broadcast(t, src=0)
    return t
