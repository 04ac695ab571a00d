"""What a part of MCN is: a modality's encoder, or a reconstruction head. Each part is a class
deriving from one of these, named in ``parts.py``'s table and chosen by its setting
(``model.text_encoder: gated``); ``mcn.py`` builds the parts the settings name and runs them.

An encoder reads only the batch keys it lists in ``inputs`` and returns its modality's embedding
and the target its reconstruction head rebuilds. Nothing else describes a part: the memory preflight
traces the built module on the meta device (``train/preflight/model_trace.py``), so its forward must
run there: no ``.item()``, no shape that depends on a tensor's values.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from raymcn.config import ModelConfig


class Encoder(nn.Module):
    """One modality's branch: ``forward(batch) -> (embedding (B, embed_dim), target (B, target_dim))``.

    A subclass sets the class attributes ``modality`` ("video", "audio" or "text") and ``inputs``
    (the batch keys its forward reads: only the active modalities' keys are present), and
    ``target_dim`` in ``__init__(cfg)``. The target is returned live: whether the reconstruction
    loss detaches it is the loss's setting (``loss.detach_recon_targets``).

    ``original_names``: the part is the original release's, whose parameters keep their top-level
    names in every state dict (``gu_text.fc.weight``, not ``text_encoder.gu_text.fc.weight``), so the
    original weights' import (``original.py``) and every older checkpoint load as they are. A new
    part leaves it False: its parameters are named under its setting (``text_encoder.*``).
    """

    modality: ClassVar[str]
    inputs: ClassVar[tuple[str, ...]]
    original_names: ClassVar[bool] = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.target_dim = 0  # set by the subclass

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError


class TextEncoder(Encoder):
    """The text branch. The batch carries ``text`` (B, W, word_dim) word vectors, zero rows after
    each caption's words, and ``nwords`` (B,) int32, each caption's word count (0 for a caption
    none of whose words has a vector: :func:`word_mask` keeps attention defined there).

    ``bf16_input``: on a GPU run the reader may send the word vectors as bfloat16 (half the bytes
    on the host and over PCIe) because every use of them under bf16 autocast would round them to
    bf16 first (the encoder's first operation on them is a Linear or a convolution), so no number
    changes. False, the safe default, sends float32.
    """

    modality = "text"
    bf16_input: ClassVar[bool] = False


class ReconHead(nn.Module):
    """A reconstruction head: ``forward(embedding (B, embed_dim)) -> prediction (B, target_dim)``,
    built as ``cls(cfg, target_dim)`` once per modality (the target's width is its encoder's)."""

    def __init__(self, cfg: ModelConfig, target_dim: int):
        super().__init__()
        self.target_dim = target_dim


def word_mask(nwords: Tensor, max_words: int) -> Tensor:
    """(B, max_words) bool, True at each caption's words, from ``nwords`` (B,) word counts.

    An empty caption (0 words) keeps its first slot (a zero vector): attention whose every key is
    masked divides by a sum of zeros (NaN), while one zero key gives a defined, constant output.
    """
    n = nwords.long().clamp(1, max_words)
    return torch.arange(max_words, device=nwords.device) < n[:, None]
