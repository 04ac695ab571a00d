"""Ray-free data stream: the bytes of one rank's videos of a step -> that rank's batch, with bad-sample accounting.

What a global step reads is fixed by ``order.py`` (a function of seed, epoch and step). The stages
here, each a plain function (``datasource.py`` only runs :func:`read_steps` as Ray Data read tasks)::

    read_step_records(shards_dir, job)   the step's videos of one rank, read by byte range and checked
    assemble_step(records, job, ...)     clips drawn per video position -> the batch (numpy), bad slots refilled
    read_steps(shards_dir, jobs, ...)    -> one Arrow row per step: the batch's arrays as bytes (a read task)
    step_rows(tables)                    -> (batch, StepInfo) per step, zero-copy     (each rank)

Without Ray: :func:`iter_shard_records` reads whole shards in one process (the writer's tests,
``bench/loader.py``'s reference row); the benchmarks' in-memory corpus and in-process stream
(``bench/readers.py``) build their batches with the same :func:`assemble_step` in the same order. Bad samples are never dropped silently: each is
counted (:class:`EpochStats`), logged with its shard, and its slot refilled by a good video of
the same step.

Imports: numpy, pyarrow, ``config``, ``features``, ``words``, ``order``, ``sample``, ``tarfmt``;
torch only inside :func:`to_tensors` (worker side), so the read tasks importing this module never
load it.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from raymcn.config import Config
from raymcn.data.formats.features import (
    FEATURE_DIM,
    MEL_BINS,
    VideoRecord,
    sample_batch,
)
from raymcn.data.formats.sample import SampleError, ShardChecker, ShardScan, decode_sample_bytes
from raymcn.data.formats.tarfmt import advise_ranges, read_pieces, read_ranges
from raymcn.data.formats.words import load_vocab
from raymcn.data.read.order import StepSlice, VideoIndex, clip_rng

DEFAULT_CHUNK_BYTES = 64 << 20  # pieces of the sequential whole-shard reader
TENSOR_KEYS = ("video", "audio", "nframes", "text", "nwords")
_DTYPES = {"video": np.float32, "audio": np.float16, "nframes": np.int32, "text": np.float32, "nwords": np.int32}
BF16 = np.dtype(np.uint16)  # bfloat16 bit patterns: numpy has no bfloat16, torch views them as one
STEP_SCHEMA = pa.schema([
    ("step", pa.int64()),  # global step
    ("in_epoch", pa.int64()),
    *((k, pa.large_binary()) for k in TENSOR_KEYS),  # the batch's arrays, C order, dtypes _DTYPES
    ("dims", pa.list_(pa.int64())),  # [clips b, audio frames, words, word dim]: the arrays' shapes
    ("text_bf16", pa.bool_()),  # text holds bfloat16 bit patterns instead of float32 (GPU runs)
    ("key", pa.list_(pa.string())),  # b keys "<video id>#<clip>"
    ("bad", pa.list_(pa.string())),  # "<video> in <shard>: <reason>" per bad sample of this step
    ("bad_shards", pa.list_(pa.string())),
    ("videos", pa.int64()),  # readable videos read for this step
    ("bytes", pa.int64()),  # their sample bytes
    ("read_s", pa.float64()),  # the read task's seconds reading / building this step
    ("build_s", pa.float64()),
])
_LOG_LIMIT = 20  # bad samples logged one by one per epoch and rank; the rest are summarised


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


@dataclass
class EpochStats:
    """What one rank read in one epoch; ``as_metrics()`` gives the numbers to report.

    Attributes:
        videos: readable videos read (bad slots refilled from their step are not counted).
        bad_samples: samples skipped (undecodable or missing member, bad CRC, wrong shape, missing
            from a truncated shard, an unreadable shard file); ``bad_by_shard`` splits them by shard.
        bytes: sample bytes of the readable videos.
        read_seconds, build_seconds: the read tasks' time reading and checking the bytes, and
            drawing the clips (spent in the read tasks' processes, not on the training path).
    """

    videos: int = 0
    bad_samples: int = 0
    bad_by_shard: dict[str, int] = field(default_factory=dict)
    bytes: int = 0
    read_seconds: float = 0.0
    build_seconds: float = 0.0

    def add_step(self, info: StepInfo, log: Callable[[str], None] | None = log_stderr) -> None:
        """Count one step row; its bad samples are logged (the first few per epoch, then summarised)."""
        self.videos += info.videos
        self.bytes += info.bytes
        self.read_seconds += info.read_s
        self.build_seconds += info.build_s
        for message, shard in zip(info.bad, info.bad_shards):
            if log is not None and self.bad_samples < _LOG_LIMIT:
                log(f"warning: skipped bad sample {message}")
            self.bad_samples += 1
            self.bad_by_shard[shard] = self.bad_by_shard.get(shard, 0) + 1

    def summarise(self, log: Callable[[str], None] | None = log_stderr) -> None:
        """Log the bad samples beyond the first few (call at the end of the epoch)."""
        if log is not None and self.bad_samples > _LOG_LIMIT:
            log(f"warning: ... {self.bad_samples - _LOG_LIMIT} more bad samples not shown "
                f"(by shard: {dict(sorted(self.bad_by_shard.items()))})")

    def as_metrics(self) -> dict[str, float]:
        return {"bad_samples": float(self.bad_samples), "videos_read": float(self.videos)}



# =====================================================================================================
# One rank's part of a step: read by byte range, checked, turned into its batch
# =====================================================================================================
@dataclass(frozen=True)
class StepJob:
    """What a read task needs for one rank's part of one step (:class:`order.StepSlice` located).

    Attributes:
        step, in_epoch, first: as :class:`order.StepSlice`.
        videos: (video id, shard file name, start, end) per slot, in slot order.
    """

    step: int
    in_epoch: int
    first: int
    videos: tuple[tuple[str, str, int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(end - start for _, _, start, end in self.videos)


def step_jobs(index: VideoIndex, slices: Sequence[StepSlice]) -> list[StepJob]:
    """Locate each slice's videos in the shards."""
    return [StepJob(s.step, s.in_epoch, s.first, tuple(
        (str(index.ids[v]), index.shard_names[int(index.shard[v])], int(index.start[v]), int(index.end[v]))
        for v in s.videos)) for s in slices]


@dataclass
class SlotRecord:
    """One slot of a step as read: its record, or the reason it is unusable."""

    video_id: str
    shard: str
    record: VideoRecord | None
    error: str | None = None


def slots_by_shard(job: StepJob) -> dict[str, list[int]]:
    """``job``'s slot indices grouped by the shard file holding their video, in slot order."""
    by_shard: dict[str, list[int]] = {}
    for slot, (_, shard, _, _) in enumerate(job.videos):
        by_shard.setdefault(shard, []).append(slot)
    return by_shard


def advise_step(shards_dir: str | os.PathLike, job: StepJob) -> None:
    """Have the kernel start reading ``job``'s videos (:func:`tarfmt.advise_ranges`): a read task
    asks for step k+1 once step k is read, so the disk works while the CPU draws step k's clips."""
    for shard, slots in slots_by_shard(job).items():
        advise_ranges(Path(shards_dir) / shard, [job.videos[i][2:] for i in slots])


def read_step_records(shards_dir: str | os.PathLike, job: StepJob, verify: bool = True) -> list[SlotRecord]:
    """The videos of ``job`` read from their shards (each shard opened once, its ranges read front
    to back), each checked (members, with ``verify`` the CRC-32 of every member, .npy headers,
    shapes) and decoded to zero-copy views. Unreadable ones carry the reason, never raise."""
    out: list[SlotRecord | None] = [None] * len(job.videos)
    for shard, slots in slots_by_shard(job).items():
        ranges = [(job.videos[i][2], job.videos[i][3]) for i in slots]
        try:
            blobs = read_ranges(Path(shards_dir) / shard, ranges)
        except OSError as e:
            for i in slots:
                out[i] = SlotRecord(job.videos[i][0], shard, None, f"shard unreadable: {e}")
            continue
        for i, blob in zip(slots, blobs):
            vid, _, start, end = job.videos[i]
            if end <= start:
                out[i] = SlotRecord(vid, shard, None, ShardChecker.MISSING)
                continue
            if len(blob) < end - start:
                out[i] = SlotRecord(vid, shard, None, f"shard truncated: {len(blob)} of {end - start} bytes present")
                continue
            try:
                out[i] = SlotRecord(vid, shard, decode_sample_bytes(blob, vid, verify=verify))
            except SampleError as e:
                out[i] = SlotRecord(vid, shard, None, str(e))
    return out  # type: ignore[return-value]


def assemble_step(slots: Sequence[SlotRecord], first: int, cfg: Config, epoch: int, vocab_matrix: np.ndarray,
                  fallback: Sequence[VideoRecord] = ()) -> tuple[dict, list[VideoRecord]]:
    """The batch of one rank's part of a step (numpy arrays of the batch contract, video-major).

    Slot j's clips are drawn with :func:`order.clip_rng` of its epoch position ``first + j``,
    whoever reads it. A bad slot is refilled with the next good video of the same slots (cyclic),
    its clips still drawn with the bad slot's generator; with no good video at all, with the
    ``fallback`` videos (the rank's previous step).

    Returns:
        (batch, the records used per slot).

    Raises:
        RuntimeError: no slot is readable and there is no fallback.
    """
    good = [i for i, s in enumerate(slots) if s.record is not None]
    used: list[VideoRecord] = []
    for j, s in enumerate(slots):
        if s.record is not None:
            used.append(s.record)
        elif good:
            used.append(slots[next((i for i in good if i > j), good[0])].record)  # type: ignore[arg-type]
        elif fallback:
            used.append(fallback[j % len(fallback)])
        else:
            raise RuntimeError(f"no readable video in a step of epoch {epoch} (positions {first}.."
                               f"{first + len(slots) - 1}): " + "; ".join(f"{s.video_id} in {s.shard}: {s.error}"
                                                                          for s in slots))
    d = cfg.data
    rngs = [clip_rng(cfg.run.seed, epoch, first + j) for j in range(len(used))]
    return sample_batch(used, rngs, d.clips_per_video, d.min_time, d.audio_frames, d.max_words, vocab_matrix), used


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16 bit patterns (uint16, same shape), rounded to nearest, ties to
    even, as torch's ``.to(torch.bfloat16)`` rounds (overflow -> inf; a NaN stays a NaN)."""
    x = np.ascontiguousarray(x, np.float32)
    bits = x.view(np.uint32)
    out = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    out[np.isnan(x)] = 0x7FC0
    return out


def model_vocab(matrix: np.ndarray, bf16: bool) -> np.ndarray:
    """The word vectors as the batches carry them: bf16 bits or float32 (a float32 matrix, e.g. the
    shards' memory map, is not copied). bfloat16 is the text encoder's choice, which the caller
    passes (``model/parts.text_in_bf16``: a GPU run whose encoder rounds the text to bf16 anyway
    halves its bytes on the host, in the object store and over PCIe, 0.77 -> 0.38 MB per video at
    the paper's 32 clips). ``video`` stays fp32: it is also the reconstruction target, compared in
    fp32."""
    return bf16_bits(matrix) if bf16 else np.asarray(matrix, dtype=np.float32)


@functools.lru_cache(maxsize=4)
def _shard_vocab(shards_dir: str, mtime_ns: int, bf16: bool) -> np.ndarray:
    """The shards' vocabulary matrix as the batches carry it, once per process (read tasks reuse
    their workers)."""
    return model_vocab(load_vocab(shards_dir).matrix, bf16)


def step_row_nbytes(cfg: Config, videos: int, text_bf16: bool = False) -> int:
    """Bytes of the arrays of a step row holding ``videos`` videos' clips (:func:`step_row`), the
    text in bfloat16 when ``text_bf16``."""
    clips, d = videos * cfg.data.clips_per_video, cfg.data
    text = d.max_words * cfg.model.word_dim * (2 if text_bf16 else 4)
    return clips * (2 * FEATURE_DIM * 4 + MEL_BINS * d.audio_frames * 2 + 4 + text + 4)  # + nframes, nwords


def step_row(job: StepJob, batch: dict, slots: Sequence[SlotRecord], read_s: float, build_s: float) -> pa.Table:
    """One Arrow row holding one step's batch (zero-copy: the arrays' memory is the row's)."""
    bf16 = batch["text"].dtype == BF16
    arrays = {k: np.ascontiguousarray(batch[k], dtype=BF16 if k == "text" and bf16 else _DTYPES[k])
              for k in TENSOR_KEYS}
    b, _, frames = arrays["audio"].shape
    _, words, dim = arrays["text"].shape
    bad = [s for s in slots if s.record is None]
    cols = {"step": [job.step], "in_epoch": [job.in_epoch],
            **{k: pa.LargeBinaryArray.from_buffers(pa.large_binary(), 1, [
                None, pa.py_buffer(np.array([0, a.nbytes], np.int64)), pa.py_buffer(a)]) for k, a in arrays.items()},
            "dims": [[b, frames, words, dim]], "text_bf16": [bf16], "key": [list(batch["key"])],
            "bad": [[f"{s.video_id} in shard {s.shard}: {s.error}" for s in bad]], "bad_shards": [[s.shard for s in bad]],
            "videos": [len(slots) - len(bad)],
            "bytes": [sum(end - start for (_, _, start, end), s in zip(job.videos, slots) if s.record is not None)],
            "read_s": [read_s], "build_s": [build_s]}
    return pa.Table.from_pydict(cols, schema=STEP_SCHEMA)


def read_steps(shards_dir: str, jobs: Sequence[StepJob], cfg: Config, epoch: int, verify: bool = True,
               text_bf16: bool = False) -> Iterator[pa.Table]:
    """A read task: one row (:func:`step_row`) per job, in order, each leaving as soon as it is built;
    the word vectors in bfloat16 when ``text_bf16`` (:func:`model_vocab`)."""
    vocab_file = Path(shards_dir) / "vocab.npy"  # missing: load_vocab names it
    vocab = _shard_vocab(shards_dir, vocab_file.stat().st_mtime_ns if vocab_file.exists() else 0, text_bf16)
    previous: list[VideoRecord] = []
    for k, job in enumerate(jobs):
        t0 = time.perf_counter()
        slots = read_step_records(shards_dir, job, verify)
        if k + 1 < len(jobs):  # the disk reads the next step while this one is checked and drawn
            advise_step(shards_dir, jobs[k + 1])
        t1 = time.perf_counter()
        batch, previous = assemble_step(slots, job.first, cfg, epoch, vocab, previous)
        yield step_row(job, batch, slots, t1 - t0, time.perf_counter() - t1)


@dataclass(frozen=True)
class StepInfo:
    """What a step row says besides its batch."""

    step: int
    in_epoch: int
    bad: list[str]
    bad_shards: list[str]
    videos: int
    bytes: int
    read_s: float
    build_s: float


def _blob(column: pa.ChunkedArray, row: int, dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Row ``row``'s bytes of a large_binary column as an array (a read-only view, no copy)."""
    for chunk in column.chunks:
        if row < len(chunk):
            bufs = chunk.buffers()
            offsets = np.frombuffer(bufs[1], np.int64)[chunk.offset:chunk.offset + len(chunk) + 1]
            count = int(np.prod(shape))
            return np.frombuffer(bufs[2], dtype, count, int(offsets[row])).reshape(shape)
        row -= len(chunk)
    raise IndexError(row)


def step_rows(tables: Iterable[pa.Table]) -> Iterator[tuple[dict, StepInfo]]:
    """(numpy batch, :class:`StepInfo`) of every row of ``tables`` (:data:`STEP_SCHEMA`), in order;
    the arrays are read-only views of the tables' memory. ``tables`` is closed at the end."""
    try:
        for table in tables:
            meta = table.drop_columns(list(TENSOR_KEYS)).to_pylist()
            for row, m in enumerate(meta):
                b, frames, words, dim = m["dims"]
                shapes = {"video": (b, 2 * FEATURE_DIM), "audio": (b, MEL_BINS, frames), "nframes": (b,),
                          "text": (b, words, dim), "nwords": (b,)}
                dtypes = {**_DTYPES, "text": BF16 if m["text_bf16"] else _DTYPES["text"]}
                batch = {k: _blob(table.column(k), row, dtypes[k], shapes[k]) for k in TENSOR_KEYS}
                batch["key"] = m["key"]
                yield batch, StepInfo(m["step"], m["in_epoch"], m["bad"], m["bad_shards"], m["videos"], m["bytes"],
                                      m["read_s"], m["build_s"])
    finally:
        close = getattr(tables, "close", None)
        if close is not None:
            close()


def to_tensors(batch: dict) -> dict:
    """numpy batch -> torch tensors for the model's keys (no copy; ``key`` stays a list)."""
    import warnings

    import torch  # here, not at the top: the read tasks import this module and must not load torch

    with warnings.catch_warnings():  # read-only views of Ray's object store: the model never writes its input
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        out = {k: torch.from_numpy(np.ascontiguousarray(batch[k])) for k in TENSOR_KEYS}
    if batch["text"].dtype == BF16:  # bfloat16 bit patterns: the same bits seen as bfloat16, no copy
        out["text"] = out["text"].view(torch.int16).view(torch.bfloat16)
    out["key"] = batch["key"]
    return out
