"""The training corpus held in memory, read from the original per-video layout.

The trainer reads shards through Ray Data (``reader.py``); this in-memory path serves the
benchmarks that need the same data without Ray (``bench/overhead.py`` bare DDP,
``bench/sweep_efficiency.py``) and ``to_tensors``, shared with the reader.

Each epoch the video order is reshuffled with (seed, epoch); rank r takes every world_size-th
video of that order, so ranks never share a video within an epoch and together cover
``steps × batch_size`` of them. Clips are drawn in the worker with a (seed, epoch, rank) generator,
so a resumed run draws exactly the clips the uninterrupted run would have drawn.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from raymcn.config import Config
from raymcn.data.features import VideoRecord, collate, load_captions, read_video_paths, read_videos, sample_clips
from raymcn.data.synthetic import CorpusPaths, ensure_corpus
from raymcn.data.words import build_vocab, read_word2vec_bin

TENSOR_KEYS = ("video", "audio", "nframes", "text")


@dataclass
class TrainVideos:
    records: list[VideoRecord]
    vocab_matrix: np.ndarray  # (V+1, word_dim), row 0 = padding
    skipped: list[tuple[str, str]]  # (video_id, reason) of unreadable videos

    @classmethod
    def from_layout(cls, paths: CorpusPaths, max_words: int) -> TrainVideos:
        """Read every video listed in ``paths.video_csv``; unreadable ones are reported, not fatal."""
        captions = load_captions(paths.captions)
        texts = [t for rec in captions.values() for t in rec["text"]]
        vocab = build_vocab(texts, read_word2vec_bin(paths.word_vectors))
        records, skipped = read_videos(read_video_paths(paths.video_csv), paths.features_root, paths.audio_root,
                                       captions, vocab.word_to_id, max_words, str(paths.captions))
        for vid, reason in skipped[:10]:
            print(f"warning: skipped video {vid}: {reason}", file=sys.stderr)
        if len(skipped) > 10:
            print(f"warning: ... and {len(skipped) - 10} more skipped videos", file=sys.stderr)
        return cls(records, np.asarray(vocab.matrix, dtype=np.float32), skipped)

    @classmethod
    def load(cls, cfg: Config) -> TrainVideos:
        """The synthetic corpus of ``cfg`` (generated once into the cache)."""
        return cls.from_layout(CorpusPaths(ensure_corpus(cfg)), cfg.data.max_words)

    def steps_per_epoch(self, cfg: Config) -> int:
        return cfg.steps_per_epoch(len(self.records))

    def batches(self, cfg: Config, epoch: int, rank: int, world_size: int, steps: int) -> Iterator[dict]:
        """This rank's ``steps`` batches of epoch ``epoch`` (torch tensors, video-major clips)."""
        order = np.random.default_rng([cfg.run.seed, epoch]).permutation(len(self.records))
        mine = order[rank::world_size]
        per_rank = cfg.data.batch_size // world_size
        rng = np.random.default_rng([cfg.run.seed, epoch, rank])
        d = cfg.data
        for step in range(steps):
            chosen = [self.records[i] for i in mine[step * per_rank:(step + 1) * per_rank]]
            clips = [sample_clips(r, d.clips_per_video, d.min_time, d.audio_frames, d.max_words, rng,
                                  self.vocab_matrix) for r in chosen]
            yield to_tensors(collate(clips, [r.video_id for r in chosen]))


def to_tensors(batch: dict) -> dict:
    """numpy batch -> torch tensors (zero-copy) for the model's keys; ``key`` stays a list."""
    out = {k: torch.from_numpy(np.ascontiguousarray(batch[k])) for k in TENSOR_KEYS}
    out["key"] = batch["key"]
    return out
