"""Which videos a global step reads, and where their bytes are: a function of (seed, epoch, step) alone.

The data order of a run is fixed before it starts, the way MosaicML Streaming's "elastic
determinism" fixes it: every epoch is one permutation of the corpus drawn from ``(run.seed,
epoch)``; global step ``s`` of the epoch holds the ``data.batch_size`` videos at positions
``[s·B, (s+1)·B)`` of it; rank ``r`` of ``world`` holds a contiguous slice of those (its rotating
share, :func:`share`), and each video's clips are drawn from a generator of ``(seed, epoch,
position)``. Nothing depends on timing, on the number of ranks, on restarts or on how Ray Data
places its blocks, so a run resumed at step ``s`` on any number of workers continues with exactly
the batches the uninterrupted run would have had, and reads nothing of the consumed part.

``VideoIndex`` says where each video's bytes lie: (shard, first header byte, end of its last
member), from the manifest's ``spans`` (written by ``raymcn shards``) or, for shards written
before the manifest carried them, found once by reading the tar headers only (``tarfmt``).

Imports: numpy, ``tarfmt`` (no Ray, no torch).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raymcn.data.formats.tarfmt import scan_file_spans

ORDER_SALT = 0x0DE5  # separates the epoch permutation's stream from every other use of (seed, epoch)
CLIP_SALT = 0xC11B


def share(batch: int, rank: int, world: int, step: int) -> int:
    """Videos of a ``batch``-video global step that ``rank`` of ``world`` holds at global ``step``.

    ⌊batch/world⌋ each, and the ``batch % world`` extra videos go to ranks that rotate with the
    step (rank r takes one at steps where (r - step) mod world < batch % world), so over any
    ``world`` consecutive steps every rank holds the same number of videos.
    """
    base, extra = divmod(batch, world)
    return base + ((rank - step) % world < extra)


def rank_slots(batch: int, rank: int, world: int, step: int) -> tuple[int, int]:
    """[lo, hi): the positions within global step ``step`` that ``rank`` holds (ranks in order)."""
    lo = sum(share(batch, r, world, step) for r in range(rank))
    return lo, lo + share(batch, rank, world, step)


def epoch_order(seed: int, epoch: int, videos: int) -> np.ndarray:
    """The epoch's permutation of the corpus's video indices, (videos,) int64."""
    return np.random.default_rng([int(seed), int(epoch), ORDER_SALT]).permutation(videos)


def clip_rng(seed: int, epoch: int, position: int) -> np.random.Generator:
    """The generator that draws the clips of the video at ``position`` of the epoch's order
    (``step_in_epoch · batch + slot``): the same on whichever rank reads it."""
    return np.random.default_rng([int(seed), int(epoch), int(position), CLIP_SALT])


@dataclass(frozen=True)
class StepSlice:
    """One rank's part of one global step: what a read task needs to build that rank's batch.

    Attributes:
        step: the global step; in_epoch: its index within the epoch.
        first: the epoch position of the slice's first video (``in_epoch · batch + lo``).
        videos: corpus indices of the slice's videos, in slot order.
    """

    step: int
    in_epoch: int
    first: int
    videos: tuple[int, ...]


def rank_steps(seed: int, epoch: int, num_videos: int, batch: int, steps_per_epoch: int, rank: int, world: int,
               start: int = 0, stop: int | None = None) -> list[StepSlice]:
    """This rank's slices of the epoch's steps ``start .. stop - 1`` (indices within the epoch).

    Raises:
        ValueError: the corpus cannot fill the steps, or a rank would get no video.
    """
    stop = steps_per_epoch if stop is None else stop
    if steps_per_epoch * batch > num_videos:
        raise ValueError(f"{steps_per_epoch} steps of {batch} videos need {steps_per_epoch * batch} videos; "
                         f"the corpus has {num_videos}")
    order = epoch_order(seed, epoch, num_videos)
    out = []
    for k in range(start, stop):
        step = epoch * steps_per_epoch + k
        lo, hi = rank_slots(batch, rank, world, step)
        if hi <= lo:
            raise ValueError(f"rank {rank} of {world} holds no video of step {step} (batch {batch})")
        out.append(StepSlice(step, k, k * batch + lo, tuple(int(v) for v in order[k * batch + lo:k * batch + hi])))
    return out


@dataclass(frozen=True)
class VideoIndex:
    """Where every video of a shard folder lies, sorted by video id (video index = position here).

    Sorted by id, not in manifest order, so the data order of a run does not depend on how the
    corpus was cut into shards, and the benchmarks' in-memory corpus (``bench/readers.py``) indexes
    its videos the same way.

    Attributes:
        ids: (N,) video ids; shard: (N,) int32 index into ``shard_names``;
        start, end: (N,) int64 byte range of the video's sample in its shard (its first tar header
            up to the end of its last member's data: re-scannable on its own).
    """

    shard_names: tuple[str, ...]
    ids: np.ndarray
    shard: np.ndarray
    start: np.ndarray
    end: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


def spans_from_headers(path: str | os.PathLike, expected: Sequence[str]) -> dict[str, tuple[int, int]]:
    """video id -> (start, end) of the expected videos found in a shard by reading its tar headers
    only (no member data). A video absent (lost to truncation) is left out; the reader reports it."""
    wanted = set(expected)
    return {s.key: (s.start, s.end) for s in scan_file_spans(path) if s.key in wanted}


def build_index(shards_dir: str | os.PathLike, manifest: dict) -> VideoIndex:
    """The :class:`VideoIndex` of a shard folder: from the manifest's per-shard ``spans``, or by
    reading each shard's tar headers when the manifest has none. A listed video whose bytes cannot
    be located keeps an empty range (start = end = 0), which the reader reports as a bad sample."""
    names, ids, shard, start, end = [], [], [], [], []
    for i, s in enumerate(manifest["shards"]):
        names.append(s["name"])
        videos = list(s["videos"])
        spans = s.get("spans")
        if spans is None or len(spans) != len(videos):
            try:
                found = spans_from_headers(Path(shards_dir) / s["name"], videos)
            except OSError:
                found = {}
            spans = [found.get(v, (0, 0)) for v in videos]
        ids += videos
        shard += [i] * len(videos)
        start += [int(a) for a, _ in spans]
        end += [int(b) for _, b in spans]
    by_id = sorted(range(len(ids)), key=ids.__getitem__)  # canonical: the order does not depend on the sharding
    return VideoIndex(tuple(names), np.asarray([ids[i] for i in by_id], dtype=object),
                      np.asarray(shard, np.int32)[by_id], np.asarray(start, np.int64)[by_id],
                      np.asarray(end, np.int64)[by_id])
