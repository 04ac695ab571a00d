"""The original's reconstruction head (``model.recon_head: mlp``)."""

from __future__ import annotations

from torch import nn

from raymcn.config import ModelConfig
from raymcn.model.branch import ReconHead


class MLPReconHead(ReconHead, nn.Sequential):
    """embed_dim -> recon_hidden -> target_dim, a ReLU after each Linear (the final ReLU is the
    original's; the targets are >= 0 in the paper's setup). Its parameters keep the original's
    ``Sequential`` indices (``recon.video.0.weight``, ``recon.video.2.weight``)."""

    def __init__(self, cfg: ModelConfig, target_dim: int):
        nn.Sequential.__init__(self, nn.Linear(cfg.embed_dim, cfg.recon_hidden), nn.ReLU(inplace=True),
                               nn.Linear(cfg.recon_hidden, target_dim), nn.ReLU(inplace=True))
        self.target_dim = target_dim
