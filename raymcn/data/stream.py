"""Ray-free data stream: shard files -> checked records -> per-rank batches, with bad-sample accounting.

The stages, each a plain function (``reader.py`` only puts Ray Data between the second and third)::

    iter_shard_chunks(path, expected)        a shard in 64 MB pieces, each checked (ShardScan)
    read_shard_blocks(path, name, expected)  -> Arrow tables of sample bytes   (a Ray read task's body)
    records_from_tables(tables, stats)       -> VideoRecord views              (each rank, after Ray Data)
    batches_from_records(records, ...)       -> exactly `steps` torch batches  (each rank)

Without Ray: :func:`iter_shard_records` reads shards in one process (tests, ``bench/loader.py``'s
reference row), and :class:`TrainVideos` holds a corpus in memory (benchmarks that need the data
without Ray) and feeds the same :func:`batches_from_records`. Bad samples are never dropped
silently: they travel as rows with an ``error`` and are counted (:class:`EpochStats`) and logged.

Imports: numpy, pyarrow, ``config``, ``features``, ``words``, ``sample``, ``tarfmt``; torch only
inside :func:`to_tensors` (worker side), so the read tasks importing this module never load it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute

from raymcn.config import Config
from raymcn.data.features import VideoRecord, collate, load_captions, read_video_paths, read_videos, sample_clips
from raymcn.data.sample import LAYOUT_WIDTH, SampleError, ShardChecker, ShardScan, decode_layout, span_layout
from raymcn.data.tarfmt import read_pieces
from raymcn.data.words import Vocab, build_vocab, read_word2vec_bin

if TYPE_CHECKING:
    from raymcn.data.synthetic import CorpusPaths

DEFAULT_CHUNK_BYTES = 64 << 20  # the same pieces as the Ray read tasks (reader.DEFAULT_BLOCK_MB)
SCHEMA = pa.schema([("key", pa.string()), ("shard", pa.string()), ("sample", pa.large_binary()),
                    ("layout", pa.list_(pa.int64(), LAYOUT_WIDTH)), ("error", pa.string()),
                    ("epoch", pa.int32())])  # the epoch whose shard order the read task was planned for
TENSOR_KEYS = ("video", "audio", "nframes", "text")
_LOG_LIMIT = 20  # bad samples logged one by one per epoch and rank; the rest are summarised


class DataEpochError(RuntimeError):
    """The shard order of an epoch could not be planned from the trainer's epoch: no epoch was
    announced, or the plan Ray Data executed belongs to another epoch than the one being read."""


def log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# =====================================================================================================
# Shard files -> checked samples
# =====================================================================================================
def iter_shard_chunks(path: str | os.PathLike, expected: Sequence[str] | None = None, *,
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES, verify: bool = True,
                      decode: bool = True) -> Iterator[tuple[np.ndarray, ShardScan]]:
    """Read a shard sequentially in ~chunk_bytes pieces; yields ``(buffer, ShardScan)`` per piece.

    The good spans of each piece index into that piece's buffer (``tarfmt.read_pieces``: only
    complete samples, memory about one piece). Bad samples are reported where found; the expected
    samples that never appeared come last, with an empty buffer.

    Args:
        expected: the shard's video ids from the manifest (unlisted keys are bad, absent ones lost).
        verify: check each sample's CRC-32 list.
        decode: also decode each good sample (``ShardScan.records``) — which checks the ``.npy``
            headers, dtypes and shapes; without it only members and CRCs are checked.

    Raises:
        OSError: if the shard cannot be opened or read.
    """
    checker = ShardChecker(expected, verify, decode)
    for buf, spans in read_pieces(path, chunk_bytes, checker.damage):
        yield buf, checker.feed(buf, spans)
    lost = checker.finish()
    if lost:
        yield np.empty(0, np.uint8), ShardScan([], lost)


def iter_shard_records(path: str | os.PathLike, expected: Sequence[str] | None = None, verify: bool = True,
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES
                       ) -> Iterator[tuple[str, VideoRecord | None, str | None]]:
    """Sequential single-process reader (no Ray): ``(video_id, record, None)`` or ``(video_id, None, reason)``.

    Records are zero-copy views into the piece buffers. An unreadable shard file yields every
    ``expected`` id as bad (or raises if none is given).
    """
    done: set[str] = set()
    try:
        for _, scan in iter_shard_chunks(path, expected, chunk_bytes=chunk_bytes, verify=verify):
            for span, rec in zip(scan.good, scan.records):
                done.add(span.key)
                yield span.key, rec, None
            for key, reason in scan.bad:
                done.add(key)
                yield key, None, reason
    except OSError as e:
        if expected is None:
            raise
        for k in expected:
            if k not in done:
                yield k, None, f"shard unreadable: {e}"


# =====================================================================================================
# Checked samples -> Arrow blocks (the read tasks) -> records (each rank)
# =====================================================================================================
def _block_table(key, shard, data, offsets, layout, errors, epoch: int) -> pa.Table:
    n = len(key)
    sample = pa.LargeBinaryArray.from_buffers(pa.large_binary(), n,
                                              [None, pa.py_buffer(np.asarray(offsets, np.int64)), data])
    flat = pa.array(np.asarray(layout, np.int64).reshape(-1), pa.int64())
    return pa.Table.from_arrays([pa.array(key, pa.string()), pa.array([shard] * n, pa.string()), sample,
                                 pa.FixedSizeListArray.from_arrays(flat, LAYOUT_WIDTH),
                                 pa.array(errors, pa.string()), pa.array(np.full(n, epoch, np.int32))],
                                schema=SCHEMA)


def _bad_table(name: str, bad: Sequence[tuple[str, str]], epoch: int) -> pa.Table:
    n = len(bad)
    return _block_table([k for k, _ in bad], name, pa.py_buffer(b""), np.zeros(n + 1, np.int64),
                        np.zeros((n, LAYOUT_WIDTH), np.int64), [r for _, r in bad], epoch)


def read_shard_blocks(path: str, name: str, expected: Sequence[str], block_bytes: int,
                      verify: bool = True, epoch: int = 0) -> Iterator[pa.Table]:
    """The read task of one shard: Arrow tables (:data:`SCHEMA`) of ~block_bytes, bad samples as rows of their own.

    The shard is read sequentially in pieces (:func:`iter_shard_chunks`), so tables leave before
    the whole shard is read and memory stays at about one piece. Each sample is checked here
    (members present, CRC-32 of every member); the ``.npy`` headers are parsed once, in the
    consumer. Good row: ``sample`` = the shard bytes from this video's first tar header up to the
    next video's (a zero-copy slice of the piece buffer), ``layout`` = (offset, size) of each
    ``.npy`` member in it. Bad row: empty ``sample``, ``error`` = the reason. Every row carries
    the ``epoch`` the read was planned for, which the consumer checks (:func:`records_from_tables`).
    """
    emitted: set[str] = set()
    try:
        for buf, scan in iter_shard_chunks(path, expected, chunk_bytes=block_bytes, verify=verify, decode=False):
            good = scan.good
            if good:
                s0 = good[0].start
                offsets = [g.start - s0 for g in good] + [good[-1].end - s0]  # value k runs to the next sample
                yield _block_table([g.key for g in good], name, pa.py_buffer(buf).slice(s0, good[-1].end - s0),
                                   offsets, [span_layout(g) for g in good], [None] * len(good), epoch)
                emitted.update(g.key for g in good)
            if scan.bad:
                yield _bad_table(name, scan.bad, epoch)
                emitted.update(k for k, _ in scan.bad)
    except OSError as e:
        bad = [(k, f"shard unreadable: {e}") for k in expected if k not in emitted]
        if bad:
            yield _bad_table(name, bad, epoch)


def read_shards_blocks(jobs: Sequence[tuple[str, str, Sequence[str]]], block_bytes: int,
                       verify: bool = True, epoch: int = 0) -> Iterator[pa.Table]:
    """One read task of ``epoch``: the shards ``jobs`` = [(path, name, expected ids)] one after the other."""
    for path, name, expected in jobs:
        yield from read_shard_blocks(path, name, expected, block_bytes, verify, epoch)


@dataclass
class EpochStats:
    """What one rank saw in one epoch; ``as_metrics()`` gives the numbers to report.

    Attributes:
        videos: readable videos received.
        bad_samples: samples skipped (undecodable or missing member, bad CRC, wrong shape, missing
            from a truncated shard); ``bad_by_shard`` splits them by shard name.
        reused: batch slots filled with a video this rank had already used this epoch (only when
            bad samples left the rank short of videos, so every rank still runs the same steps).
        unused: readable videos received but not put in a batch (the epoch's remainder).
        wait_seconds: time spent waiting for the tables; decode_seconds: time decoding samples.
        bytes: sample bytes of the readable videos.
    """

    videos: int = 0
    bad_samples: int = 0
    bad_by_shard: dict[str, int] = field(default_factory=dict)
    reused: int = 0
    unused: int = 0
    wait_seconds: float = 0.0
    decode_seconds: float = 0.0
    bytes: int = 0

    def add_bad(self, shard: str) -> None:
        self.bad_samples += 1
        self.bad_by_shard[shard] = self.bad_by_shard.get(shard, 0) + 1

    def as_metrics(self) -> dict[str, float]:
        return {"bad_samples": float(self.bad_samples), "reused_videos": float(self.reused),
                "data_wait_s": float(self.wait_seconds)}


def records_from_tables(tables: Iterable[pa.Table], stats: EpochStats | None = None, *,
                        log: Callable[[str], None] | None = log_stderr,
                        epoch: int | None = None) -> Iterator[VideoRecord]:
    """Readable videos from the read tasks' tables (:data:`SCHEMA`), in order; ``tables`` is closed at the end.

    Records are zero-copy views into the tables' buffers (read-only arrays). Bad samples are
    skipped, counted in ``stats`` and logged with their shard name (the first few, then a summary).

    Raises:
        DataEpochError: ``epoch`` is given and a table was planned for another epoch (its shard
            order announced late, or not at all for this epoch).
    """
    stats = stats if stats is not None else EpochStats()
    logged = 0
    t_wait = time.perf_counter()
    try:
        for table in tables:
            stats.wait_seconds += time.perf_counter() - t_wait
            if epoch is not None and len(table):
                planned = pa.compute.min_max(table.column("epoch")).as_py()
                if planned != {"min": epoch, "max": epoch}:
                    raise DataEpochError(f"epoch {epoch} received shards ordered for epoch {planned['min']} "
                                         "(the epoch was announced after Ray Data had planned it)")
            keys = table.column("key").to_pylist()
            shard_names = table.column("shard").to_pylist()
            errors = table.column("error").to_pylist()
            layout = table.column("layout")
            row = 0
            for chunk, lay in zip(table.column("sample").chunks, _rechunk(layout, table.column("sample"))):
                bufs = chunk.buffers()
                offs = np.frombuffer(bufs[1], np.int64)[chunk.offset:chunk.offset + len(chunk) + 1]
                mv = memoryview(bufs[2]) if bufs[2] is not None else memoryview(b"")
                lay = lay.flatten().to_numpy().reshape(-1, LAYOUT_WIDTH)
                for k in range(len(chunk)):
                    key, shard, err = keys[row], shard_names[row], errors[row]
                    row += 1
                    rec = None
                    if err is None:
                        t0 = time.perf_counter()
                        try:
                            rec = decode_layout(mv[offs[k]:offs[k + 1]], key, lay[k])
                        except SampleError as e:
                            err = str(e)
                        stats.decode_seconds += time.perf_counter() - t0
                    if rec is None:
                        stats.add_bad(shard)
                        if log is not None and logged < _LOG_LIMIT:
                            log(f"warning: skipped bad sample {key} in shard {shard}: {err}")
                        logged += 1
                        continue
                    stats.videos += 1
                    stats.bytes += int(offs[k + 1] - offs[k])
                    yield rec
            t_wait = time.perf_counter()
    finally:
        if log is not None and logged > _LOG_LIMIT:
            log(f"warning: ... {logged - _LOG_LIMIT} more bad samples not shown "
                f"(by shard: {dict(sorted(stats.bad_by_shard.items()))})")
        close = getattr(tables, "close", None)
        if close is not None:
            close()


def _rechunk(column: pa.ChunkedArray, like: pa.ChunkedArray) -> list[pa.Array]:
    """``column`` cut into the same chunk lengths as ``like`` (both columns of one table)."""
    if [len(c) for c in column.chunks] == [len(c) for c in like.chunks]:
        return list(column.chunks)
    out, start = [], 0
    for c in like.chunks:
        out.append(column.slice(start, len(c)).combine_chunks())
        start += len(c)
    return out


# =====================================================================================================
# Records -> per-rank batches
# =====================================================================================================
def batches_from_records(records: Iterator[VideoRecord], cfg: Config, epoch: int, rank: int,
                         videos: int | Callable[[int], int], steps: int, vocab: Vocab | np.ndarray, *,
                         stats: EpochStats | None = None, shuffle_buffer: int | None = None, drain: bool = True,
                         on_drained: Callable[[], None] | None = None) -> Iterator[dict]:
    """Exactly ``steps`` batches from one epoch's ``records``, of ``videos`` videos each: this rank's
    share of a step from the run plan, a number or a function of the step's index in the epoch
    (shares rotate between ranks when the batch does not divide evenly).

    Each batch is ``{video (B, 4096) f32, audio (B, 40, audio_frames) f16, nframes (B,) i32,
    text (B, max_words, D) f32, key: B strings "<id>#<clip>"}`` (torch tensors) with
    B = videos · clips_per_video, video-major. Clips are drawn with
    ``np.random.default_rng([seed, epoch, rank])``; videos pass through a shuffle buffer
    (``default_rng([seed, epoch, rank, 1])``, ``shuffle_buffer`` videos, default 2 batches' worth;
    1 keeps the stream's order) so that a batch mixes shards. If bad samples leave the rank short,
    the missing slots are filled with videos it already used this epoch (``stats.reused``) so every
    rank runs ``steps`` steps. Before the last batch is yielded, the rest of the epoch's stream is
    read and dropped (``drain``; ``stats.unused``), so ``stats`` covers the whole epoch when the
    loop ends, and ``on_drained`` is called (the stream is finished: the next epoch may be requested).

    Args:
        records: this rank's readable videos of the epoch; closed at the end if it is a generator.
        vocab: the Vocab (its memory-mapped matrix) or the (V+1, D) matrix itself.
        stats: the epoch's counters (the ones ``records`` fills); ``reused`` and ``unused`` are added here.

    Raises:
        RuntimeError: if the rank receives no readable video at all.
    """
    d = cfg.data
    per_step = videos if callable(videos) else (lambda k: videos)
    if min(per_step(k) for k in range(steps)) < 1:
        raise ValueError(f"rank {rank} was given no video for a step of epoch {epoch}")
    matrix = vocab.matrix if isinstance(vocab, Vocab) else vocab
    stats = stats if stats is not None else EpochStats()
    rng = np.random.default_rng([cfg.run.seed, epoch, rank])
    pick = np.random.default_rng([cfg.run.seed, epoch, rank, 1])
    capacity = max(1, shuffle_buffer if shuffle_buffer is not None else 2 * per_step(0))
    buffer: list[VideoRecord] = []
    exhausted = False
    used: list[VideoRecord] = []

    def next_record() -> VideoRecord | None:
        nonlocal exhausted
        while not exhausted and len(buffer) < capacity:
            try:
                buffer.append(next(records))
            except StopIteration:
                exhausted = True
        if not buffer:
            return None
        i = int(pick.integers(len(buffer)))
        buffer[i], buffer[-1] = buffer[-1], buffer[i]
        return buffer.pop()

    def finish() -> None:
        # Reading the rest of the epoch (at most a batch's worth of videos plus what the read-ahead
        # holds, unless schedule.steps_per_epoch cuts the epoch short) lets Ray Data finish the
        # execution; stopping early leaves read tasks to cancel, and the next epoch then started
        # ~2 s late (measured). It also counts the bad samples of the whole epoch.
        nonlocal exhausted
        stats.unused += len(buffer)
        buffer.clear()
        if drain and not exhausted:
            for _ in records:
                stats.unused += 1
            exhausted = True
        if exhausted and on_drained is not None:
            on_drained()

    try:
        for step in range(steps):
            chosen: list[VideoRecord] = []
            while len(chosen) < per_step(step):
                rec = next_record()
                if rec is None:
                    pool = used or chosen
                    if not pool:
                        raise RuntimeError(f"rank {rank} received no readable video in epoch {epoch} "
                                           f"({stats.bad_samples} bad samples)")
                    rec = pool[int(pick.integers(len(pool)))]
                    stats.reused += 1
                chosen.append(rec)
            clips = [sample_clips(r, d.clips_per_video, d.min_time, d.audio_frames, d.max_words, rng, matrix)
                     for r in chosen]
            batch = to_tensors(collate(clips, [r.video_id for r in chosen]))
            used = chosen
            if step == steps - 1:
                finish()  # before the last yield: the stats are complete when the loop ends
            yield batch
    finally:
        buffer.clear()
        close = getattr(records, "close", None)
        if close is not None:
            close()


def to_tensors(batch: dict) -> dict:
    """numpy batch -> torch tensors (zero-copy) for the model's keys; ``key`` stays a list."""
    import torch  # here, not at the top: the read tasks import this module and must not load torch

    out = {k: torch.from_numpy(np.ascontiguousarray(batch[k])) for k in TENSOR_KEYS}
    out["key"] = batch["key"]
    return out


# =====================================================================================================
# The in-memory path
# =====================================================================================================
@dataclass
class TrainVideos:
    """The training corpus held in memory, read from the original per-video layout (no shards, no Ray).

    For the benchmarks that need the same data without Ray. Each epoch the video order is reshuffled
    with (seed, epoch); rank r takes every world_size-th video of that order, so ranks never share a
    video within an epoch and together cover ``steps × batch_size`` of them. The batches come from
    :func:`batches_from_records` in that order (shuffle buffer 1), so clips, shapes and keys follow
    the shard path's contract, and a resumed run draws exactly the clips of the uninterrupted one.
    """

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
        from raymcn.data.synthetic import CorpusPaths, ensure_corpus  # the writer: not on the read tasks' path

        return cls.from_layout(CorpusPaths(ensure_corpus(cfg)), cfg.data.max_words)

    def batches(self, cfg: Config, epoch: int, rank: int, world_size: int, videos: int | Callable[[int], int],
                steps: int) -> Iterator[dict]:
        """This rank's ``steps`` batches of epoch ``epoch``, ``videos`` per step (:func:`batches_from_records`)."""
        order = np.random.default_rng([cfg.run.seed, epoch]).permutation(len(self.records))
        mine = (self.records[i] for i in order[rank::world_size])
        return batches_from_records(mine, cfg, epoch, rank, videos, steps, self.vocab_matrix, shuffle_buffer=1)
