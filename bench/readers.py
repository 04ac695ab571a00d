"""The training data without Ray Data, for the benchmarks and tests.

* :class:`TrainVideos`: the corpus held in memory, read from the original per-video layout (no
  shards, no Ray). The videos are indexed by sorted id, as ``order.VideoIndex`` indexes the shards,
  and each step is built by the same ``stream.assemble_step`` in the same order, so both paths give
  the same batches; :func:`train_videos` holds the synthetic corpus of a config.
* :class:`LocalStream`: a rank's step rows built in the rank's own process, the same rows in the
  same order as ``datasource.RankStream``'s read tasks build (``bench/overhead.py``'s measure of
  what Ray Data costs).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from raymcn.config import Config
from raymcn.data.formats.features import VideoRecord, load_captions, read_video_paths, read_videos
from raymcn.data.formats.words import build_vocab, read_word2vec_bin
from raymcn.data.read.order import VideoIndex, rank_steps
from raymcn.data.read.stream import (
    EpochStats,
    SlotRecord,
    StepJob,
    assemble_step,
    log_stderr,
    model_vocab,
    read_steps,
    step_jobs,
    step_rows,
    to_tensors,
)
from raymcn.data.synthetic import CorpusPaths, ensure_corpus
from raymcn.model.parts import text_in_bf16


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
        vocab = model_vocab(self.vocab_matrix, text_in_bf16(cfg.model, cfg.scale.use_gpu))
        for s in slices:
            slots = [SlotRecord(self.records[v].video_id, "", self.records[v]) for v in s.videos]
            batch, previous = assemble_step(slots, s.first, cfg, epoch, vocab, previous)
            yield to_tensors(batch)


def train_videos(cfg: Config) -> TrainVideos:
    """The synthetic corpus of ``cfg``'s training videos in memory; the corpus is generated into the
    cache once."""
    return TrainVideos.from_layout(CorpusPaths(ensure_corpus(cfg)), cfg.data.max_words)


class LocalStream:
    """This rank's batches built in its own process: the same step rows, in the same order, as
    ``datasource.RankStream``'s read tasks build, without Ray Data (``epoch`` has its signature).

    For measuring what Ray Data costs a run (``bench/overhead.py``): the rows are read, checked and
    drawn by :func:`read_steps` where they are consumed (on the caller's prefetch thread), so the
    batches are identical and only the path differs.
    """

    def __init__(self, shards_dir: str | os.PathLike, index: VideoIndex, cfg: Config, rank: int, world: int, *,
                 steps_per_epoch: int, log: Callable[[str], None] | None = log_stderr):
        self._dir, self._index, self._cfg = str(shards_dir), index, cfg
        self._rank, self._world, self._steps, self._log = rank, world, steps_per_epoch, log

    def epoch(self, epoch: int, start: int = 0) -> tuple[Iterator[dict], EpochStats]:
        """The batches of ``epoch`` from in-epoch step ``start`` to its end, and its counters
        (filled as the batches are built; complete when the iterator is exhausted)."""
        slices = rank_steps(self._cfg.run.seed, epoch, len(self._index), self._cfg.data.batch_size, self._steps,
                            self._rank, self._world, start)
        stats = EpochStats()
        return self._batches(step_jobs(self._index, slices), epoch, stats), stats

    def _batches(self, jobs: list[StepJob], epoch: int, stats: EpochStats) -> Iterator[dict]:
        text_bf16 = text_in_bf16(self._cfg.model, self._cfg.scale.use_gpu)
        for batch, info in step_rows(read_steps(self._dir, jobs, self._cfg, epoch, text_bf16=text_bf16)):
            stats.add_step(info, self._log)
            yield to_tensors(batch)
        stats.summarise(self._log)


def random_eval_set(clips: int, video_dim: int, mel_bins: int, frames: int, words: int, word_dim: int, *,
                    seed: int = 0, least_frames: int | None = None, queries: int | None = None):
    """An eval set of ``clips`` random clips in the layout ``EvalSet`` gives ``evaluate`` (video
    fp32, audio fp16 spectrograms of ``frames`` frames, text fp32 word vectors): every clip's
    audio full, or with ``least_frames`` a random length from it to ``frames``; ``queries`` the
    query count (default ``clips``; more counts the absent ones as misses, as MSR-VTT's)."""
    from types import SimpleNamespace

    rng = np.random.default_rng(seed)
    video = rng.standard_normal((clips, video_dim)).astype(np.float32)
    audio = rng.standard_normal((clips, mel_bins, frames)).astype(np.float16)
    nframes = np.full(clips, frames) if least_frames is None else rng.integers(least_frames, frames + 1, clips)
    return SimpleNamespace(video=video, audio=audio, nframes=nframes.astype(np.int32),
                           text=rng.standard_normal((clips, words, word_dim)).astype(np.float32),
                           nwords=np.full(clips, words, np.int32),
                           num_queries_total=clips if queries is None else queries)
