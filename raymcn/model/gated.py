"""Gated building blocks of MCN (context gating, gated embedding unit, sentence max-pool) and the
original's video and text encoders made of them (``model.video_encoder: gated``,
``model.text_encoder: gated``).

All Linear layers keep PyTorch's default initialisation, as the original did.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from raymcn.config import ModelConfig
from raymcn.model.branch import Encoder, TextEncoder


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


class GatedVideoEncoder(Encoder):
    """The original's video branch: GU(video_dim -> embed_dim), (B, 4096) -> (B, 6144) at paper size;
    its reconstruction target is the video input itself."""

    modality = "video"
    inputs = ("video",)
    original_names = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.gu_video = GatedEmbeddingUnit(cfg.video_dim, cfg.embed_dim)
        self.target_dim = cfg.video_dim

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        video = batch["video"]  # (B, video_dim)
        return self.gu_video(video), video


class GatedTextEncoder(TextEncoder):
    """The original's text branch: SentenceMaxpool(word_dim -> embed_dim) then GU(embed_dim),
    (B, 20, 300) -> (B, 6144) at paper size; its reconstruction target is the sentence max-pool
    (embed_dim wide). Padding is not masked, as in the original (``nwords`` is not read)."""

    inputs = ("text",)
    original_names = True
    bf16_input = True  # its first operation on the word vectors is SentenceMaxpool's Linear

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.text_pool = SentenceMaxpool(cfg.word_dim, cfg.embed_dim)
        self.gu_text = GatedEmbeddingUnit(cfg.embed_dim, cfg.embed_dim)
        self.target_dim = cfg.embed_dim

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        pooled = self.text_pool(batch["text"])  # (B, max_words, word_dim) -> (B, embed_dim)
        return self.gu_text(pooled), pooled
