"""Exact gradient caching for one training step ("GradCache", Gao et al. 2021). No Ray.

A worker's activation memory is that of one chunk of its share, while the objective still sees
every embedding of the global batch. A share of b clips in chunks of n (whole videos,
``scale.grad_cache_clips``) takes three passes: (1) each chunk embedded without autograd; (2) the
objective once on those embeddings as leaves, whose backward leaves the cached gradients
d total / d embedding; (3) each chunk re-forwarded with autograd (its pass-1 RNG state replayed,
through the DDP wrapper) and its rows of the cached gradients pushed through it, with its part of
the reconstruction term, which is per clip and so not cached (the objective weights it:
``MCNObjective.recon_term``). Only the objective's public calls are used: its step's rows
(``rows``), the loss on given rows, and the reconstruction term's weight (``recon_term``, ``in_total``). BatchNorm's running statistics are updated once per step
(:class:`ChunkedBatchNorm`). Terms, gradients, queue and centroids equal the plain step's to 1e-5
(tests/test_gradcache.py, tests/test_dist_losses.py); what is exact and why: docs/memory.md,
"Gradient caching: what is exact".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from raymcn.config import MODALITIES
from raymcn.data.formats.batch import Batch
from raymcn.losses import MCNObjective, StepRows
from raymcn.model.syncbn import GlobalBatchNorm2d


def chunk_bounds(clips: int, chunk: int) -> list[tuple[int, int]]:
    """(start, end) rows of each chunk of ``chunk`` clips over ``clips`` rows; the last may be shorter."""
    if chunk < 1:
        raise ValueError(f"chunk of {chunk} clips")
    return [(s, min(s + chunk, clips)) for s in range(0, clips, chunk)]


def share_clips(batch: Batch) -> int:
    """Clips in ``batch`` (the common first dimension of its tensors)."""
    sizes = {v.shape[0] for v in batch.values() if isinstance(v, Tensor)}
    if len(sizes) != 1:
        raise ValueError(f"batch tensors disagree on the number of clips: {sorted(sizes)}")
    return sizes.pop()


def slice_batch(batch: Batch, start: int, end: int) -> Batch:
    """Rows ``start:end`` of every per-clip entry of ``batch`` (tensors and per-clip lists)."""
    clips = share_clips(batch)
    return {k: v[start:end] if isinstance(v, Tensor) or (isinstance(v, (list, tuple)) and len(v) == clips) else v
            for k, v in batch.items()}


class ChunkedBatchNorm:
    """The training-mode BatchNorm layers of ``net`` under gradient caching (see the module doc).

    ``frozen()`` around both passes turns the layers' own running-statistics update off (they still
    normalise with the statistics of the chunk they see); ``recording()`` around pass 1 pools each
    layer's input statistics over the chunks; ``commit()`` applies one update per layer.
    """

    def __init__(self, net: nn.Module):
        self.layers = [m for m in net.modules() if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
        if any(isinstance(m, (nn.SyncBatchNorm, GlobalBatchNorm2d)) for m in self.layers):
            raise ValueError("scale.grad_cache_clips with model.sync_batchnorm: its statistics are a collective "
                             "per forward, which chunking changes; not supported")
        self._stats: dict[nn.Module, tuple[int, Tensor, Tensor]] = {}  # layer -> (count, mean, M2), float64

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        for m in self.layers:
            m.track_running_stats = False  # training mode: batch statistics, running buffers untouched
        try:
            yield
        finally:
            for m in self.layers:
                m.track_running_stats = True

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        handles = [m.register_forward_pre_hook(self._record) for m in self.layers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _record(self, module: nn.Module, inputs: tuple) -> None:
        x = inputs[0].detach()  # (N, C, ...): statistics over every axis but the channels
        dims = [0, *range(2, x.dim())]
        n = x.numel() // x.shape[1]
        var, mean = torch.var_mean(x.float(), dim=dims, correction=0)
        mean, m2 = mean.double(), var.double() * n
        prev = self._stats.get(module)
        if prev is not None:  # Chan et al.: combine two (count, mean, M2) without a second pass
            n0, mean0, m20 = prev
            total = n0 + n
            delta = mean - mean0
            mean, m2 = mean0 + delta * (n / total), m20 + m2 + delta.square() * (n0 * n / total)
            n = total
        self._stats[module] = (n, mean, m2)

    @torch.no_grad()
    def commit(self) -> None:
        """One running-statistics update per recorded layer, as ``_BatchNorm.forward`` makes it
        (momentum, or a cumulative average when momentum is None; unbiased variance)."""
        for m, (n, mean, m2) in self._stats.items():
            m.num_batches_tracked.add_(1)
            factor = 1.0 / float(m.num_batches_tracked) if m.momentum is None else m.momentum
            var = m2 / max(n - 1, 1)
            m.running_mean.mul_(1 - factor).add_(mean.to(m.running_mean.dtype), alpha=factor)
            m.running_var.mul_(1 - factor).add_(var.to(m.running_var.dtype), alpha=factor)
        self._stats.clear()


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: tuple[Tensor, Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _embeddings(net: nn.Module, batch: Batch, active: frozenset[str]) -> dict[str, Tensor]:
    embed = getattr(net, "embed", None)
    if embed is not None:
        return embed(batch, active)
    return {m: x for m, x in net(batch, active).items() if m in MODALITIES}  # a model without ``embed``


def cached_step(model: nn.Module, objective: MCNObjective, batch: Batch, active: frozenset[str], step: int,
                chunk_clips: int, *, forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                lap: Callable[[str], None] | None = None) -> dict[str, Tensor]:
    """Forward, objective and backward of one step with gradient caching; returns the detached terms.

    Afterwards the parameters' ``.grad`` hold what ``objective(model(batch, active), active,
    step)["total_loss"].backward()`` would leave (see the module doc for what "exact" means under
    BatchNorm), DDP-averaged when ``model`` is a DDP wrapper; the optimizer step is the caller's.

    Args:
        model: the trained module (a DDP wrapper or the bare model); ``model(batch, active)``
            returns ``{m: (c, D)}`` and ``{"recon_m": (pred (c, F_m), target (c, F_m))}`` for c clips.
        objective: the run's :class:`~raymcn.losses.MCNObjective` (called once, on the whole share;
            it weights the reconstruction term, which runs chunk by chunk).
        batch: this rank's share, b clips, video-major (the batch contract of ``train_one_epoch``).
        chunk_clips: n, clips per chunk: whole videos (a multiple of ``objective.layout.clips_per_video``).
        forward_context: entered around every forward (the loop's autocast).
        lap: called with a phase name as each phase ends: "forward" (pass 1), "loss",
            "backward" (the loss's backward, then each chunk's), "reforward" (each chunk's forward).

    Returns:
        the objective's terms, detached, with ``recon_loss`` (when the model has heads) and
        ``total_loss`` including the reconstruction term as the objective composes it.
    """
    lap = lap or (lambda phase: None)
    b = share_clips(batch)
    cpv = objective.layout.clips_per_video
    if chunk_clips < 1 or chunk_clips % cpv:
        raise ValueError(f"scale.grad_cache_clips={chunk_clips}: chunks must be whole videos of {cpv} clips")
    chunks = _Chunks(model, batch, active, chunk_bounds(b, chunk_clips), forward_context)
    bn = ChunkedBatchNorm(chunks.net)
    with bn.frozen():
        cache = chunks.embed(bn)  # 1.
        after_pass1 = _rng_state(chunks.device)
        lap("forward")
        rows = objective.rows(b, step, chunks.device)  # the share's place in the step (and its terms' weight)
        terms, grads = _objective_backward(objective, cache, active, step, rows, lap)  # 2.
        del cache
        lap("backward")
        recon = chunks.reforward(grads, objective, rows, lap)  # 3.
        _set_rng_state(after_pass1, chunks.device)
    bn.commit()
    if recon is not None:
        terms["recon_loss"] = recon
        terms["total_loss"] = terms["total_loss"] + objective.in_total(recon)
    return terms


class _Chunks:
    """One step's share cut into chunks, for passes 1 and 3: the module, the share, its active
    modalities, each chunk's (start, end) rows and the RNG state each chunk's first forward started
    from (filled by pass 1, replayed by pass 3)."""

    def __init__(self, model: nn.Module, batch: Batch, active: frozenset[str], bounds: list[tuple[int, int]],
                 forward_context: Callable[[], contextlib.AbstractContextManager]):
        self.model, self.batch, self.active, self.bounds = model, batch, active, bounds
        self.forward_context = forward_context
        self.net = getattr(model, "module", model)
        self.device = next(self.net.parameters()).device
        self.starts: list = []

    @property
    def clips(self) -> int:
        return self.bounds[-1][1]

    def embed(self, bn: ChunkedBatchNorm) -> dict[str, Tensor]:
        """Pass 1: the share embedded chunk by chunk without autograd; only the embeddings are
        kept. Returns {m: (b, D)}."""
        cache: dict[str, Tensor] = {}
        with torch.no_grad(), bn.recording():
            for s, e in self.bounds:
                self.starts.append(_rng_state(self.device))
                with self.forward_context():
                    out = _embeddings(self.net, slice_batch(self.batch, s, e), self.active)
                for m, x in out.items():
                    if m not in cache:
                        cache[m] = x.new_empty((self.clips, *x.shape[1:]))
                    cache[m][s:e] = x
                del out
        return cache

    def reforward(self, grads: dict[str, Tensor], objective: MCNObjective, rows: StepRows, lap) -> Tensor | None:
        """Pass 3: each chunk re-forwarded with autograd (its pass-1 RNG state restored) and its
        rows of the cached gradients pushed through it, with its part of the reconstruction term
        (weighted by the objective) and that part's own gradient; DDP syncs only the last chunk's
        backward. Returns the reconstruction term of the share (None without heads)."""
        recon_parts: list[Tensor] = []
        no_sync = getattr(self.model, "no_sync", None)
        for i, (s, e) in enumerate(self.bounds):
            last = i == len(self.bounds) - 1
            with contextlib.nullcontext() if last or no_sync is None else no_sync():
                _set_rng_state(self.starts[i], self.device)
                with self.forward_context():
                    out = self.model(slice_batch(self.batch, s, e), self.active)
                lap("reforward")
                outputs = [out[m] for m in grads]
                seeds = [g[s:e] for g in grads.values()]
                pairs = {m: out[f"recon_{m}"] for m in MODALITIES if m in self.active and f"recon_{m}" in out}
                if pairs:
                    part = objective.recon_term(pairs, rows, (e - s) / self.clips)
                    recon_parts.append(part.detach())
                    outputs.append(objective.in_total(part))
                    seeds.append(torch.ones_like(outputs[-1]))
                torch.autograd.backward(outputs, seeds)
                del out, outputs, seeds, pairs
            lap("backward")
        return torch.stack(recon_parts).sum() if recon_parts else None


def _objective_backward(objective: MCNObjective, cache: dict[str, Tensor], active: frozenset[str], step: int,
                        rows: StepRows, lap) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Pass 2: the objective once, on the whole share; its backward fills the cached embeddings'
    gradients. Returns (the detached terms, {m: (b, D) gradient})."""
    leaves = {m: x.requires_grad_() for m, x in cache.items()}
    terms = objective(leaves, active, step, rows)
    lap("loss")
    terms["total_loss"].backward()
    grads = {m: x.grad for m, x in leaves.items() if x.grad is not None}
    return {k: v.detach() for k, v in terms.items()}, grads  # detached: the leaves can go
