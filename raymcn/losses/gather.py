"""The only place the losses talk to other ranks.

Every method of :class:`Collectives` is a collective when the world has several ranks: it must be
called by *all* ranks, in the same order, with tensors of the same shape on every rank (the
gathers assume an equal local batch per rank). With world size 1 every method is the identity /
a no-op, so the losses run unchanged in a single process.

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


class Collectives:
    """The collectives of the losses, for this ``rank`` of ``world`` (handed to the objective at
    construction, as open_clip's loss gets rank and world size). With world 1 every method is the
    identity / a no-op and no process group is needed. A benchmark or test may subclass it to play
    one rank of a larger world in a single process (``bench/memory.py``)."""

    def __init__(self, rank: int = 0, world: int = 1):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of {world}")
        self.rank, self.world = int(rank), int(world)

    @classmethod
    def from_process_group(cls) -> Collectives:
        """This process's rank and world in torch.distributed's default group (0 of 1 without one)."""
        return cls(*world_info())

    @torch.no_grad()
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(b, ...) per rank -> (world·b, ...) in rank order, detached; gathered straight into one
        tensor (no per-rank parts plus a concatenated copy)."""
        x = x.detach()
        if self.world == 1:
            return x
        x = x.contiguous()
        out = torch.empty((self.world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        self._gather_into(out, x)
        return out

    def _gather_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        # torch 2.13 names the single-tensor all-gather all_gather_single (all_gather_into_tensor
        # warns); releases before it, down to the pyproject's 2.3, have only all_gather_into_tensor.
        gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather_into(out, x)

    @torch.no_grad()
    def all_reduce_mean(self, t: torch.Tensor) -> torch.Tensor:
        """Mean of ``t`` over ranks (a detached copy), for reporting; ``t.detach()`` when world is 1."""
        t = t.detach().clone()
        if self.world == 1:
            return t
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t / self.world

    @torch.no_grad()
    def broadcast_from_rank0(self, t: torch.Tensor) -> torch.Tensor:
        """Overwrite ``t`` (same shape/dtype on every rank) with rank 0's value, in place; returns ``t``."""
        if self.world > 1:
            dist.broadcast(t, src=0)
        return t
