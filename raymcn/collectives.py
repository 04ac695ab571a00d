"""The only place a run's code talks to other ranks: the losses' gathers, the loop's metric means,
the sharded evaluation and the k-means refit all go through :class:`Collectives`. Torch only, below
the model and the losses (``tests/test_layering.py``).

Every method of :class:`Collectives` is a collective when the world has several ranks: it must be
called by *all* ranks, in the same order. The ranks may hold different numbers of rows (an
elastic group whose batch does not divide evenly): :meth:`Collectives.sizes` tells every rank's,
and :meth:`Collectives.all_gather` given them gathers unequal parts. With world size 1 every
method is the identity / a no-op, so the losses run unchanged in a single process.

No gradient crosses ranks here: the contrastive loss computes each rank's full gradient locally
(see contrastive.py and ring.py), so the backward pass runs no collective of the losses' own; DDP's
gradient all-reduce is the only one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist


def world_info() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` when none is initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Collectives:
    """The collectives of a run, for this ``rank`` of ``world`` (handed to the objective at
    construction, as open_clip's loss gets rank and world size, and carried by the run). With world 1 every method is the
    identity / a no-op and no process group is needed. A benchmark or test may subclass it to play
    one rank of a larger world in a single process (``bench/memory.py``)."""

    def __init__(self, rank: int = 0, world: int = 1):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of {world}")
        self.rank, self.world = int(rank), int(world)

    @torch.no_grad()
    def sizes(self, n: int, device: torch.device | str = "cpu") -> list[int]:
        """Every rank's ``n`` (e.g. its rows this step), in rank order: one all-gather of one number."""
        if self.world == 1:
            return [int(n)]
        return [int(v) for v in self.all_gather(torch.tensor([n], dtype=torch.int64, device=device)).tolist()]

    @torch.no_grad()
    def all_gather(self, x: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
        """(b_r, ...) per rank -> (Σ b_r, ...) in rank order, detached.

        ``sizes``: every rank's b_r (:meth:`sizes`); None or all equal: gathered straight into one
        tensor (no per-rank parts plus a concatenated copy). Unequal: each rank's part is padded to
        the largest, gathered, and the padding dropped (one extra copy, only then).
        """
        x = x.detach()
        if self.world == 1:
            return x
        x = x.contiguous()
        if sizes is None or len(set(sizes)) == 1:
            out = torch.empty((self.world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
            self._gather_into(out, x)
            return out
        if x.shape[0] != sizes[self.rank]:
            raise ValueError(f"rank {self.rank} gathers {x.shape[0]} rows, its size says {sizes[self.rank]}")
        most = max(sizes)
        padded = x.new_zeros((most, *x.shape[1:]))
        padded[:x.shape[0]] = x
        out = x.new_empty((self.world * most, *x.shape[1:]))
        self._gather_into(out, padded)
        return torch.cat([out[r * most:r * most + n] for r, n in enumerate(sizes)])

    @torch.no_grad()
    def ring(self, parts: tuple[torch.Tensor, ...], sizes: list[int]) -> Iterator[tuple[int, tuple[torch.Tensor, ...]]]:
        """Every rank's ``parts`` in turn, one rank's at a time, passed around a ring.

        Yields ``(r, rank r's parts)`` for every rank r: this rank's own first (the tensors given,
        no copy), then rank − 1's, rank − 2's, ... Between two yields each rank sends the parts it
        holds to rank + 1 and receives rank − 1's; the transfer runs while the caller works on the
        yielded parts (which it must not modify). So at most two ranks' parts are held at a time
        (the ones in use and the ones arriving), never the gathered whole.

        Args:
            parts: tensors (b_r, ...) with this rank's rows (detached: nothing goes back).
            sizes: every rank's b_r (:meth:`sizes`).

        Collective: every rank must run the generator to its end.
        """
        parts = tuple(p.detach().contiguous() for p in parts)
        if parts[0].shape[0] != sizes[self.rank]:
            raise ValueError(f"rank {self.rank} passes {parts[0].shape[0]} rows around the ring, its size says "
                             f"{sizes[self.rank]}")
        held, owner = parts, self.rank
        for hop in range(self.world):
            wait = None
            if hop + 1 < self.world:
                sender = (owner - 1) % self.world  # whose parts arrive next
                arriving = tuple(p.new_empty((sizes[sender], *p.shape[1:])) for p in parts)
                wait = self._pass_on(held, arriving)
            yield owner, held
            if wait is not None:
                wait()
                held, owner = arriving, sender

    def _pass_on(self, held: tuple[torch.Tensor, ...], arriving: tuple[torch.Tensor, ...]) -> Callable[[], None]:
        """Start sending ``held`` to rank + 1 and receiving rank − 1's into ``arriving``; returns the wait."""
        after, before = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        ops = [dist.P2POp(dist.isend, t, after) for t in held] + [dist.P2POp(dist.irecv, t, before) for t in arriving]
        requests = dist.batch_isend_irecv(ops)

        def wait() -> None:
            for request in requests:
                request.wait()
        return wait

    def _gather_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        # torch 2.13 names the single-tensor all-gather all_gather_single (all_gather_into_tensor
        # warns); releases before it, down to the pyproject's 2.3, have only all_gather_into_tensor.
        gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather_into(out, x)

    @torch.no_grad()
    def all_reduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of ``t`` over ranks, in place (``t`` itself when world is 1); returns ``t``."""
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def share(self, n: int) -> tuple[int, int]:
        """This rank's contiguous rows of ``n`` (⌈n/world⌉ each, the last ranks fewer): (start, end)."""
        step = -(-n // self.world)
        return min(n, self.rank * step), min(n, (self.rank + 1) * step)

    def share_sizes(self, n: int) -> list[int]:
        """Every rank's row count of :meth:`share` of ``n``, in rank order."""
        step = -(-n // self.world)
        return [min(n, (r + 1) * step) - min(n, r * step) for r in range(self.world)]

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

    def all_gather_object(self, obj: object) -> list:
        """Every rank's ``obj`` (anything picklable, e.g. what a rank says about its node), in rank
        order; ``[obj]`` when world is 1."""
        if self.world == 1:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out
