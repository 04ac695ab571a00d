"""Gated building blocks of MCN: context gating, gated embedding unit, sentence max-pool.

All Linear layers keep PyTorch's default initialisation, as the original did.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class ContextGating(nn.Module):
    """x * sigmoid(W x + b) for x (..., d) -> (..., d).

    The original writes this as a GLU over cat(x, Wx + b); the product form is the same function.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(self.fc(x))


class GatedEmbeddingUnit(nn.Module):
    """Linear(in -> out) then ContextGating(out): (..., in) -> (..., out).

    No L2 normalisation: MCN scores with raw dot products.
    """

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.fc = nn.Linear(in_dim, out_dim)
        self.gate = ContextGating(out_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.gate(self.fc(x))


class SentenceMaxpool(nn.Module):
    """Per-word Linear(word_dim -> out), ReLU, max over words: (B, words, word_dim) -> (B, out).

    Zero-padded word slots are not masked, as in the original: they contribute ReLU(bias) to the max.
    """

    def __init__(self, word_dim: int, out_dim: int):
        super().__init__()
        self.fc = nn.Linear(word_dim, out_dim)

    def forward(self, words: Tensor) -> Tensor:
        return torch.relu(self.fc(words)).max(dim=1).values
