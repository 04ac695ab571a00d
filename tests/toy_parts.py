"""A model part as a contributor adds one: a class deriving from ``branch.TextEncoder`` and its
entry in ``raymcn/model/parts.py``'s table (here set by :func:`registered`, as a test must leave the
table as it found it). Nothing else of raymcn is told about it: the preflight, the batch, the
settings and the heads follow from the class."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from raymcn.config import ModelConfig
from raymcn.model.branch import TextEncoder, word_mask
from raymcn.model.parts import PARTS

TOY = "one_layer"


class OneLayerTextEncoder(TextEncoder):
    """Words -> Linear -> one self-attention layer over each caption's words (its padding masked by
    ``nwords``) -> LayerNorm -> mean over the words -> Linear(embed_dim). Its reconstruction target
    is the caption's mean word vector (word_dim wide, not embed_dim as the gated encoder's)."""

    inputs = ("text", "nwords")
    width = 16  # the attention's width
    normalize = True  # the LayerNorm after the attention (a test compares the part without it)

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.proj = nn.Linear(cfg.word_dim, self.width)
        self.attn = nn.MultiheadAttention(self.width, num_heads=2, batch_first=True)
        self.norm = nn.LayerNorm(self.width) if self.normalize else nn.Identity()
        self.out = nn.Linear(self.width, cfg.embed_dim)
        self.target_dim = cfg.word_dim

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        text = batch["text"]  # (B, W, word_dim)
        keep = word_mask(batch["nwords"], text.shape[1])  # (B, W)
        x = self.proj(text)
        attended, _ = self.attn(x, x, x, key_padding_mask=~keep, need_weights=False)
        x = self.norm(x + attended)
        weights = keep.unsqueeze(-1).to(x.dtype)
        count = weights.sum(dim=1)
        target = (text * keep.unsqueeze(-1).to(text.dtype)).sum(dim=1) / count.to(text.dtype)
        return self.out((x * weights).sum(dim=1) / count), target


class UnnormalizedTextEncoder(OneLayerTextEncoder):
    """:class:`OneLayerTextEncoder` without its LayerNorm."""

    normalize = False


@contextlib.contextmanager
def registered(name: str = TOY, cls: type = OneLayerTextEncoder, setting: str = "text_encoder") -> Iterator[str]:
    """``cls`` in the parts table as ``name`` while the block runs (the table entry a contributor writes)."""
    PARTS[setting][name] = cls
    try:
        yield name
    finally:
        del PARTS[setting][name]


def toy_model(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with the toy text encoder (the one setting a run changes)."""
    return dataclasses.replace(cfg, text_encoder=TOY)


def empty_caption_batch(cfg: ModelConfig, b: int = 3, words: int = 5) -> dict[str, Tensor]:
    """A text batch whose first caption has no word (zero vectors, nwords 0)."""
    g = torch.Generator().manual_seed(0)
    text = torch.randn(b, words, cfg.word_dim, generator=g)
    nwords = torch.tensor([0, 2, words][:b], dtype=torch.int32)
    text[torch.arange(words)[None, :] >= nwords[:, None]] = 0
    return {"text": text, "nwords": nwords}
