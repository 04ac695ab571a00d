"""The only place the losses talk to other ranks.

Every function here is a collective when a process group is initialised: it must be called by
*all* ranks, in the same order, with tensors of the same shape on every rank (the gathers assume
an equal local batch per rank). Without a process group (or with world size 1) every function is
the identity / a no-op, so the losses run unchanged in a single process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_info() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` when none is initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _AllGatherWithGrad(torch.autograd.Function):
    """All-gather along dim 0 that carries gradient back to the rank that produced each slice.

    Forward: (b, ...) on every rank -> (world·b, ...), rank-ordered.
    Backward: every rank holds a gradient for the *whole* gathered tensor (its own loss's view of
    it); the true gradient of a slice is the sum of those over ranks. gloo has no reduce_scatter,
    so we all_reduce(SUM) the full gradient and keep our own slice.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: D401
        rank, world = world_info()
        ctx.rank, ctx.b = rank, x.shape[0]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()  # all_reduce is in place; never mutate autograd's buffer
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[ctx.rank * ctx.b:(ctx.rank + 1) * ctx.b]


def all_gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """(b, ...) per rank -> (world·b, ...) concatenated in rank order, differentiable.

    Identity when world size is 1. Collective: every rank must call it, including in backward
    (a rank that skips ``backward()`` while others run it deadlocks the group).
    """
    _, world = world_info()
    if world == 1:
        return x
    return _AllGatherWithGrad.apply(x)


@torch.no_grad()
def all_gather_no_grad(x: torch.Tensor) -> torch.Tensor:
    """(b, ...) per rank -> (world·b, ...) in rank order, detached. Identity (detached) when world is 1."""
    _, world = world_info()
    x = x.detach()
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=0)


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
