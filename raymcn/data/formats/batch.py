"""The batch contract: what every loader yields and the model takes (:class:`Batch`), its arrays'
shapes and dtypes (:func:`batch_arrays`, which the memory preflight reads), and one random batch
of it (:func:`random_batch`) for the tests, the benchmarks and the step probe.

b = videos × clips per video rows, video-major: the ``data.clips_per_video`` clips of one video
are consecutive.
"""

from __future__ import annotations

from typing import TypedDict

import torch

from raymcn.config import Config


class Batch(TypedDict):
    """One rank's batch of a step (a dict at run time).

    Attributes:
        video: (b, 4096) the clips' appearance and motion features.
        audio: (b, 40, T) log-mel spectrograms (dB), float16 as the shards store them.
        nframes: (b,) int32, each clip's audio frames (an eval set's may exceed T: the unclipped length).
        text: (b, W, 300) the captions' word vectors, zero rows after the caption's words (bfloat16
            from the reader on a GPU run whose text encoder allows it: ``model/parts.text_in_bf16``).
        nwords: (b,) int32, each caption's word count (0 when none of its words has a vector).
        key: b names, ``"<video id>#<clip>"``.
    """

    video: torch.Tensor
    audio: torch.Tensor
    nframes: torch.Tensor
    text: torch.Tensor
    nwords: torch.Tensor
    key: list[str]


def batch_arrays(cfg: Config, clips: int, text_bf16: bool = False) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The batch contract's arrays for ``clips`` rows at ``cfg``'s dims: key -> (shape, dtype), as
    every loader delivers them (``text`` in bfloat16 when ``text_bf16``)."""
    m, d = cfg.model, cfg.data
    return {"video": ((clips, m.video_dim), torch.float32),
            "audio": ((clips, m.mel_bins, d.audio_frames), torch.float16),
            "nframes": ((clips,), torch.int32),
            "text": ((clips, d.max_words, m.word_dim), torch.bfloat16 if text_bf16 else torch.float32),
            "nwords": ((clips,), torch.int32)}


def random_batch(cfg: Config, clips: int, seed: int = 0, text_bf16: bool = False) -> Batch:
    """``clips`` rows of the batch contract at ``cfg``'s dims (:func:`batch_arrays`), on the host,
    drawn from ``seed``: video U[0, 1), audio N(0, 1) in float16 with every frame counted
    (nframes = T), text N(0, 1) with every word counted (nwords = W), in bfloat16 when
    ``text_bf16`` (what the reader sends a GPU run whose text encoder allows it:
    ``model/parts.text_in_bf16``), keys of ``data.clips_per_video`` clips per video. One rank's
    whole step: ``clips = cfg.clips_per_step``."""
    shapes = batch_arrays(cfg, clips, text_bf16)
    g = torch.Generator().manual_seed(seed)
    d = cfg.data
    return {"video": torch.rand(shapes["video"][0], generator=g),
            "audio": torch.randn(shapes["audio"][0], generator=g).half(),
            "nframes": torch.full((clips,), d.audio_frames, dtype=torch.int32),
            "text": torch.randn(shapes["text"][0], generator=g).to(shapes["text"][1]),
            "nwords": torch.full((clips,), d.max_words, dtype=torch.int32),
            "key": [f"v{i // d.clips_per_video}#{i % d.clips_per_video}" for i in range(clips)]}
