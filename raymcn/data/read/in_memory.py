"""The training corpus held in memory, read from the original per-video layout: no shards, no Ray.

For the benchmarks and tests that need the shard path's batches without Ray: the videos are
indexed by sorted id, as ``order.VideoIndex`` indexes the shards, and each step is built by the
same ``stream.assemble_step`` in the same order, so both paths give the same batches.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from raymcn.config import Config
from raymcn.data.formats.features import VideoRecord, load_captions, read_video_paths, read_videos
from raymcn.data.formats.words import build_vocab, read_word2vec_bin
from raymcn.data.read.order import rank_steps
from raymcn.data.read.stream import SlotRecord, assemble_step, model_vocab, text_in_bf16, to_tensors


@dataclass
class TrainVideos:
    """The training corpus held in memory, read from the original per-video layout (no shards, no Ray).

    For the benchmarks that need the same data without Ray. The videos are indexed by sorted id,
    as the shard path's :class:`order.VideoIndex` is, so the epoch order, each rank's share of a
    step and every clip are those of the shard path: both give the same batches.
    """

    records: list[VideoRecord]  # sorted by video id
    vocab_matrix: np.ndarray  # (V+1, word_dim), row 0 = padding
    skipped: list[tuple[str, str]]  # (video_id, reason) of unreadable videos

    @classmethod
    def from_layout(cls, paths, max_words: int) -> TrainVideos:
        """Read every video listed in ``paths.video_csv`` (``paths``: a ``synthetic.CorpusPaths``, or
        anything with its ``video_csv``, ``features_root``, ``audio_root``, ``captions`` and
        ``word_vectors``); unreadable ones are reported, not fatal."""
        captions = load_captions(paths.captions)
        texts = [t for rec in captions.values() for t in rec["text"]]
        vocab = build_vocab(texts, read_word2vec_bin(paths.word_vectors))
        records, skipped = read_videos(read_video_paths(paths.video_csv), paths.features_root, paths.audio_root,
                                       captions, vocab.word_to_id, max_words, str(paths.captions))
        for vid, reason in skipped[:10]:
            print(f"warning: skipped video {vid}: {reason}", file=sys.stderr)
        if len(skipped) > 10:
            print(f"warning: ... and {len(skipped) - 10} more skipped videos", file=sys.stderr)
        return cls(sorted(records, key=lambda r: r.video_id), np.asarray(vocab.matrix, dtype=np.float32), skipped)

    def batches(self, cfg: Config, epoch: int, rank: int, world: int, steps: int, start: int = 0) -> Iterator[dict]:
        """This rank's batches (torch tensors) of epoch ``epoch``, steps ``start .. steps - 1``
        (``steps`` = the epoch's steps; the plan's rotating shares of ``data.batch_size``)."""
        slices = rank_steps(cfg.run.seed, epoch, len(self.records), cfg.data.batch_size, steps, rank, world, start)
        previous: list[VideoRecord] = []
        vocab = model_vocab(self.vocab_matrix, text_in_bf16(cfg))
        for s in slices:
            slots = [SlotRecord(self.records[v].video_id, "", self.records[v]) for v in s.videos]
            batch, previous = assemble_step(slots, s.first, cfg, epoch, vocab, previous)
            yield to_tensors(batch)
