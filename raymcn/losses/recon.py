"""Reconstruction loss, unweighted; the weight is applied in the objective."""

from __future__ import annotations

import torch


def recon_loss(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], detach_targets: bool) -> torch.Tensor:
    """Σ_modalities mean_features (pred − target)², averaged over clips; a scalar in fp32.

    Args:
        pairs: modality -> (pred (b, F_m), target (b, F_m)); every modality has the same b.
        detach_targets: stop gradient into the targets. The original does not (audio/text targets
            are live activations), so False reproduces it.
    """
    if not pairs:
        raise ValueError("recon_loss: no (pred, target) pairs given")
    per_clip = None
    for name, (pred, target) in pairs.items():
        if pred.shape != target.shape:
            raise ValueError(f"recon_loss[{name}]: pred {tuple(pred.shape)} vs target {tuple(target.shape)}")
        if detach_targets:
            target = target.detach()
        with torch.autocast(device_type=pred.device.type, enabled=False):
            mse = (pred.float() - target.float()).pow(2).flatten(1).mean(dim=1)  # (b,)
        per_clip = mse if per_clip is None else per_clip + mse
    return per_clip.mean()
