"""The batch contract: what every loader yields and the model takes (:class:`Batch`), and one
random batch of it (:func:`random_batch`) for the tests, the benchmarks and the step probe.

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
        text: (b, W, 300) the captions' word vectors (bfloat16 from the reader on a GPU run).
        key: b names, ``"<video id>#<clip>"``.
    """

    video: torch.Tensor
    audio: torch.Tensor
    nframes: torch.Tensor
    text: torch.Tensor
    key: list[str]


def random_batch(cfg: Config, clips: int, seed: int = 0) -> Batch:
    """``clips`` rows of the batch contract at ``cfg``'s dims, on the host, drawn from ``seed``:
    video U[0, 1), audio N(0, 1) in float16 with every frame counted (nframes = T), text N(0, 1) in
    the dtype the reader delivers it in (bfloat16 with ``scale.use_gpu``), keys of
    ``data.clips_per_video`` clips per video. One rank's whole step: ``clips = cfg.clips_per_step``."""
    m, d = cfg.model, cfg.data
    g = torch.Generator().manual_seed(seed)
    return {"video": torch.rand(clips, m.video_dim, generator=g),
            "audio": torch.randn(clips, m.mel_bins, d.audio_frames, generator=g).half(),
            "nframes": torch.full((clips,), d.audio_frames, dtype=torch.int32),
            "text": torch.randn(clips, d.max_words, m.word_dim, generator=g).to(
                torch.bfloat16 if cfg.scale.use_gpu else torch.float32),
            "key": [f"v{i // d.clips_per_video}#{i % d.clips_per_video}" for i in range(clips)]}
