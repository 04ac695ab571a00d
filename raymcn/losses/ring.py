"""MMS over all contrastive pairs with the other ranks' rows passed around a ring, one rank's at a time.

The gathered MMS (contrastive.py) holds every rank's rows of every modality at once: 3·B·D floats
per rank, whatever the number of ranks, which gradient caching leaves as the largest term of a
rank's loss at paper size. Here no rank ever holds more than two ranks' rows (the tiled
log-sum-exp idea of Inf-CL, Cheng et al. 2024): the modalities' rows travel around the ring
(:meth:`Collectives.ring`) and each rank scores its own rows against one peer's at a time.

With S = X·Yᵀ over the global batch, S̃ = S − δI and the notation of contrastive.py (r_i the
log-sum-exp of row i, c_j of column j), rank q owns the rows and columns of its b clips and needs:

1. **forward, first pass round the ring**: r_i of its rows and c_j of its columns, built up tile by
   tile from the (b × b_p) blocks x_q·y_pᵀ and y_q·x_pᵀ with a running log-sum-exp;
   loss = Σ_own (r_i − S̃_ii) + Σ_own (c_j − S̃_jj), over b, as the gathered loss;
2. the other ranks' normalisers: one all-gather of 2·b numbers per pair (as the gathered loss);
3. **second pass round the ring** (only when a gradient is wanted): the tiles again, and
   ∂L/∂x_i = Σ_j (exp(S̃_ij − r_i) + exp(S̃_ij − c_j) − 2·[i = j]) y_j / b, summed tile by tile
   into one (b, D) gradient per modality (and alike for the columns' ∂L/∂y_j).

The gradient is computed in the forward and only scaled in the backward, so the backward needs no
collective (as with the gathered loss, DDP's all-reduce is the only one), and what the backward
keeps is one (b, D) gradient per modality instead of the gathered (B, D) rows and the b×B slabs.
Cost: twice the gathered loss's traffic (two passes of the rows instead of one gather) and the
tile products computed twice. Values and gradients equal the gathered loss's to float rounding
(the log-sum-exp is summed in another order); tests/test_dist_losses.py checks both against one
process to 1e-5.

All pairs share one ring: each rank's rows of every modality in a pair travel once per pass, not
once per pair. The gradient is that of the pairs' *sum* (the contrastive loss); the per-pair values
come back without gradient, for the reports.
"""

from __future__ import annotations

import torch

from raymcn.collectives import Collectives


def _tile(x: torch.Tensor, y: torch.Tensor, margin: float, own: bool) -> torch.Tensor:
    """S̃ block x·yᵀ (b, b_p); on the rank's own block the diagonal is the targets, shifted by −margin."""
    s = x @ y.T
    if own:
        s.diagonal().sub_(margin)
    return s


class _RingMMS(torch.autograd.Function):
    """Sum over ``pairs`` of this rank's MMS share (see the module doc), and the per-pair values."""

    @staticmethod
    def forward(ctx, margin: float, comm: Collectives, sizes: list[int], pairs: tuple[tuple[int, int], ...],
                *emb: torch.Tensor):
        b, rank, n_pairs = emb[0].shape[0], comm.rank, len(pairs)
        r = emb[0].new_full((n_pairs, b), -float("inf"))  # row log-sum-exps, built up tile by tile
        c = torch.full_like(r, -float("inf"))  # column log-sum-exps
        targets = emb[0].new_zeros((n_pairs, 2, b))  # S̃_ii via rows, via columns
        for owner, peer in comm.ring(emb, sizes):
            own = owner == rank
            for p, (i, j) in enumerate(pairs):
                for side, (mine, theirs, norm) in enumerate(((emb[i], peer[j], r), (emb[j], peer[i], c))):
                    s = _tile(mine, theirs, margin, own)
                    if own:
                        targets[p, side] = s.diagonal()
                    torch.logaddexp(norm[p], torch.logsumexp(s, 1), out=norm[p])
                    del s
        per_pair = ((r - targets[:, 0]).sum(1) + (c - targets[:, 1]).sum(1)) / b  # (pairs,)
        everyone = comm.all_gather(torch.cat([r, c]).T.contiguous(), sizes=sizes)  # (B, 2·pairs): r then c
        if everyone.shape[0] != sum(sizes):
            raise ValueError(f"ring MMS: gathered {everyone.shape[0]} normalisers for {sum(sizes)} rows")

        grads = []
        if any(ctx.needs_input_grad[4:]):
            grads = [torch.zeros_like(e) for e in emb]
            starts = [sum(sizes[:q]) for q in range(len(sizes))]
            for owner, peer in comm.ring(emb, sizes):
                own = owner == rank
                theirs_norms = everyone[starts[owner]:starts[owner] + sizes[owner]]  # (b_p, 2·pairs)
                for p, (i, j) in enumerate(pairs):
                    # rows of x_i against peer columns y_j, then columns y_j against peer rows x_i
                    for mine, other, grad, own_norm, peer_norm in (
                            (emb[i], peer[j], grads[i], r[p], theirs_norms[:, n_pairs + p]),
                            (emb[j], peer[i], grads[j], c[p], theirs_norms[:, p])):
                        s = _tile(mine, other, margin, own)
                        g = (s - own_norm[:, None]).exp_()
                        g += s.sub_(peer_norm[None, :]).exp_()
                        del s
                        if own:
                            g.diagonal().sub_(2.0)
                        grad.addmm_(g, other)
                        del g
            for g in grads:
                g.div_(b)
        ctx.save_for_backward(*grads)
        total = per_pair.sum()
        ctx.mark_non_differentiable(per_pair)
        return total, per_pair

    @staticmethod
    def backward(ctx, grad_total, _grad_per_pair):
        # called only when an input wants a gradient, so the forward computed every modality's
        return (None, None, None, None, *(g * grad_total for g in ctx.saved_tensors))


def ring_mms_loss(emb: dict[str, torch.Tensor], pairs: list[tuple[str, str]], margin: float,
                  comm: Collectives, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of Σ_pairs MMS(x·yᵀ) with the rows passed around a ring; fp32. Collective.

    Args:
        emb: (b, D) this rank's rows of every modality in ``pairs`` (with gradient), video-major.
        pairs: (x, y) modality names; MMS(x·yᵀ) for each, in this order.
        margin: subtracted from the target (diagonal) logits only.
        comm: this rank's collectives; sizes: every rank's b (``comm.sizes``), in rank order.

    Returns:
        ``(total, per_pair)``: the sum over the pairs of (row-CE + column-CE over the b local
        targets) / b, as a scalar with gradient, and the (pairs,) values without gradient. As with
        :func:`~raymcn.losses.contrastive.mms_loss`, the gradient of ``total`` for the local rows is
        world × the full-batch gradient (DDP's average makes it the full-batch gradient).
    """
    names = list(dict.fromkeys(m for pair in pairs for m in pair))  # each modality once, in order of use
    b = emb[names[0]].shape[0]
    if any(emb[m].ndim != 2 or emb[m].shape[0] != b for m in names) or sizes[comm.rank] != b:
        shapes = {m: tuple(emb[m].shape) for m in names}
        raise ValueError(f"ring_mms_loss: rank {comm.rank}'s rows {shapes} are not all (b, D) with the b = "
                         f"{sizes[comm.rank]} its size says")
    index = tuple((names.index(x), names.index(y)) for x, y in pairs)
    with torch.autocast(device_type=emb[names[0]].device.type, enabled=False):
        return _RingMMS.apply(float(margin), comm, list(sizes), index, *(emb[m].float() for m in names))
