"""MMS ("masked margin softmax") contrastive loss, sharded so no device builds a B×B matrix.

With S = X·Yᵀ over the global batch (B clips) and margin δ on the diagonal only (spec §2.1):

    MMS(S) = mean_i CE(S_i· − δ e_i, i) + mean_j CE(S_·j − δ e_j, j)

Each rank owns b = B / world consecutive clips starting at ``offset`` and computes only its own
rows (x_local·y_allᵀ, b×B) and its own columns (y_local·x_allᵀ, b×B, i.e. the transposed column
slab). Both terms are *local* means (÷b): the gather's backward sums every rank's gradient
contribution into the owner, which makes each rank's gradient world× the full-batch one, and DDP's
averaging over ranks divides that back. So the DDP-averaged gradient equals the full-batch
gradient and the mean over ranks of the returned values equals the full-batch loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


def mms_loss(x_local: torch.Tensor, y_local: torch.Tensor, x_all: torch.Tensor, y_all: torch.Tensor,
             offset: int, margin: float) -> torch.Tensor:
    """This rank's share of MMS(x·yᵀ), in fp32; a scalar.

    Args:
        x_local, y_local: (b, D) this rank's rows (with gradient).
        x_all, y_all: (B, D) all ranks' rows in rank order (gathered with gradient); this rank's
            rows sit at ``offset:offset+b``. With one process pass the same tensors as local and 0.
        margin: subtracted from the target (diagonal) logit only.

    Returns:
        mean row-CE + mean column-CE over the b local targets.
    """
    b = x_local.shape[0]
    if y_local.shape[0] != b or x_all.shape[0] != y_all.shape[0] or offset + b > x_all.shape[0]:
        raise ValueError(f"mms_loss: inconsistent shapes x_local {tuple(x_local.shape)}, y_local "
                         f"{tuple(y_local.shape)}, x_all {tuple(x_all.shape)}, y_all {tuple(y_all.shape)}, offset {offset}")
    target = torch.arange(offset, offset + b, device=x_local.device)
    # Losses stay fp32 even inside a bf16 autocast region of the training step.
    with torch.autocast(device_type=x_local.device.type, enabled=False):
        rows = x_local.float() @ y_all.float().T  # (b, B): S[offset+k, :]
        cols = y_local.float() @ x_all.float().T  # (b, B): S[:, offset+k]ᵀ
        return margin_cross_entropy(rows, target, margin) + margin_cross_entropy(cols, target, margin)
