"""MMS ("masked margin softmax") contrastive loss, sharded so no device builds a B×B matrix.

With S = X·Yᵀ over the global batch (B clips) and margin δ on the diagonal only,
S̃ = S − δI:

    MMS(S) = mean_i CE(S̃_i·, i) + mean_j CE(S̃_·j, j)

Each rank owns b = B / world consecutive clips starting at ``offset`` and computes only its own
rows (x_local·y_allᵀ, b×B) and its own columns (y_local·x_allᵀ, b×B, the transposed column slab).
The other ranks' rows ``x_all``, ``y_all`` arrive detached: no gradient flows back through the
gather, so no rank holds a (B, D) gradient and the backward needs no collective. Instead every
rank computes the *whole* gradient for its own rows. With r_i = logsumexp of row i and c_j of
column j,

    ∂L/∂S_ij = (exp(S̃_ij − r_i) + exp(S̃_ij − c_j) − 2·[i = j]) / B

Row i of this needs S_i· (the row slab), its own r_i and every column's c_j; column j needs the
column slab, c_j and every row's r_i. So the only exchange is one all-gather of the 2·b
normalisers per pair (``gather``), in the forward. Each rank's gradient is scaled by 1/b instead
of 1/B (= world × the full-batch gradient of its rows), because DDP averages the parameter
gradients over ranks; the DDP-averaged gradient then equals the full-batch gradient, and the mean
over ranks of the returned values equals the full-batch loss (both tested with 2 gloo processes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from raymcn.collectives import Collectives

# (x, y, short name): L_con = MMS(t·vᵀ) + MMS(a·tᵀ) + MMS(a·vᵀ), the original's pairs and directions.
PAIRS: tuple[tuple[str, str, str], ...] = (("text", "video", "tv"), ("audio", "text", "at"), ("audio", "video", "av"))


def margin_cross_entropy(logits: torch.Tensor, target: torch.Tensor, margin: float) -> torch.Tensor:
    """Mean CE of ``logits`` (n, C) against ``target`` (n,), with ``margin`` subtracted from the target logit.

    Out-of-place scatter: one (n, C) copy, no identity / one-hot matrix.
    """
    logits = logits.float()
    shifted = logits.scatter_add(1, target[:, None],
                                 torch.full((logits.shape[0], 1), -float(margin), dtype=logits.dtype,
                                            device=logits.device))
    return F.cross_entropy(shifted, target)


def _slabs(x_local, y_local, x_all, y_all, offset: int, margin: float):
    """Margin-shifted row slab S̃[offset:offset+b, :] and column slab S̃[:, offset:offset+b]ᵀ, both (b, B)."""
    b = x_local.shape[0]
    k = torch.arange(b, device=x_local.device)
    rows = x_local @ y_all.T
    cols = y_local @ x_all.T
    rows[k, offset + k] -= margin
    cols[k, offset + k] -= margin
    return rows, cols, k


class _ShardedMMS(torch.autograd.Function):
    """This rank's share of MMS with the full-batch gradient for its own rows (see the module doc)."""

    @staticmethod
    def forward(ctx, x_local, y_local, x_all, y_all, offset: int, margin: float, gather: Callable):
        rows, cols, k = _slabs(x_local, y_local, x_all, y_all, offset, margin)
        norms = torch.stack([torch.logsumexp(rows, 1), torch.logsumexp(cols, 1)], dim=1)  # (b, 2): r, c
        diag = offset + k
        loss = ((norms[:, 0] - rows[k, diag]).sum() + (norms[:, 1] - cols[k, diag]).sum()) / x_local.shape[0]
        everyone = gather(norms)  # (B, 2): every row's r and every column's c, in rank order
        if everyone.shape[0] != x_all.shape[0]:
            raise ValueError(f"mms_loss: gathered {everyone.shape[0]} normalisers for {x_all.shape[0]} rows")
        ctx.save_for_backward(rows, cols, norms, everyone, x_all, y_all)
        ctx.offset = offset
        return loss

    @staticmethod
    def backward(ctx, grad):
        rows, cols, norms, everyone, x_all, y_all = ctx.saved_tensors
        b = rows.shape[0]
        k = torch.arange(b, device=rows.device)
        diag = ctx.offset + k
        scale = grad / b

        def slab_grad(slab, own, other):  # (b, B): exp(S̃ − own norm) + exp(S̃ − the other direction's norms) − 2δ
            g = (slab - own[:, None]).exp_()
            g += (slab - other[None, :]).exp_()
            g[k, diag] -= 2.0
            return g

        dx = slab_grad(rows, norms[:, 0], everyone[:, 1]) @ y_all
        dy = slab_grad(cols, norms[:, 1], everyone[:, 0]) @ x_all
        return dx.mul_(scale), dy.mul_(scale), None, None, None, None, None


def mms_loss(x_local: torch.Tensor, y_local: torch.Tensor, x_all: torch.Tensor, y_all: torch.Tensor,
             offset: int, margin: float, gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
             ) -> torch.Tensor:
    """This rank's share of MMS(x·yᵀ), in fp32; a scalar. Collective when a process group is up.

    Args:
        x_local, y_local: (b, D) this rank's rows (with gradient).
        x_all, y_all: (B, D) all ranks' rows in rank order (gathered, treated as constants); this
            rank's rows sit at ``offset:offset+b``. With one process pass the same tensors as
            local and 0.
        margin: subtracted from the target (diagonal) logit only.
        gather: (b, 2) -> (B, 2), every rank's normalisers in rank order (``Collectives.all_gather``);
            default: one process (the identity).

    Returns:
        (sum of row-CE + column-CE over the b local targets) / b. Its gradient for the local rows
        is world × the full-batch gradient (see the module doc); no gradient reaches ``*_all``.
    """
    b = x_local.shape[0]
    if y_local.shape[0] != b or x_all.shape[0] != y_all.shape[0] or offset + b > x_all.shape[0]:
        raise ValueError(f"mms_loss: inconsistent shapes x_local {tuple(x_local.shape)}, y_local "
                         f"{tuple(y_local.shape)}, x_all {tuple(x_all.shape)}, y_all {tuple(y_all.shape)}, offset {offset}")
    # Losses stay fp32 even inside a bf16 autocast region of the training step.
    with torch.autocast(device_type=x_local.device.type, enabled=False):
        return _ShardedMMS.apply(x_local.float(), y_local.float(), x_all.detach().float(), y_all.detach().float(),
                                 int(offset), float(margin), gather or Collectives().all_gather)
