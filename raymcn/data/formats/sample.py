"""The per-video sample of a shard: its members, encoding, checks (members present, CRC-32) and decoding.

A sample is the run of consecutive tar members sharing the video id as key (``tarfmt.py``)::

    <id>.2d.npy       (T2, 2048) float32   2D features, 1 row/s (float16 in shards written with --dtype float16)
    <id>.3d.npy       (T3, 2048) float32   3D features, 1.5 rows/s (the same dtype as 2d.npy)
    <id>.spec.npy     (40, Ta)   float16   log-mel spectrogram, 100 frames/s
    <id>.tokens.npy   (K,)       int32     vocabulary ids of all captions, concatenated (0 never occurs)
    <id>.offsets.npy  (n+1,)     int64     caption i is tokens[offsets[i]:offsets[i+1]]
    <id>.starts.npy   (n,)       float64   caption start times (s)
    <id>.ends.npy     (n,)       float64   caption end times (s)
    <id>.json         {"id": ..., "crc32": {"2d.npy": c, ...}}   last member: CRC-32 of every other member

Tokens are stored untruncated (any ``data.max_words`` can be used later). Every member is a
standard ``.npy``/``.json`` file, so ``ray.data.read_webdataset`` or ``webdataset`` read the shards
too; raymcn's own decoder maps ``.npy`` members with ``np.frombuffer`` (no copy) and uses the
CRC-32 list to catch flipped bytes, which a tar file alone cannot detect.

Imports: numpy, ``features`` (VideoRecord and the feature shapes), ``tarfmt`` (no Ray, no torch).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from isal.isal_zlib import crc32  # the same values as zlib.crc32, via ISA-L: 58 vs 4.2 GB/s on this machine

from raymcn.config import NodeInputError
from raymcn.data.formats.features import FEATURE_DIM, MEL_BINS, VideoRecord
from raymcn.data.formats.tarfmt import NAME_MAX, NpyError, SampleSpan, npy_bytes, npy_view, scan_tar

ARRAY_MEMBERS = ("2d.npy", "3d.npy", "spec.npy", "tokens.npy", "offsets.npy", "starts.npy", "ends.npy")
META_MEMBER = "json"
MEMBERS = ARRAY_MEMBERS + (META_MEMBER,)
# The 2d/3d features' storage dtypes (``raymcn shards --dtype``): float16 halves the bytes of a
# shard; the values are max-pooled and L2-normalised in float32 when clips are drawn.
FEATURE_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16)}
_DTYPE_OF = {"spec.npy": np.dtype(np.float16), "tokens.npy": np.dtype(np.int32), "offsets.npy": np.dtype(np.int64),
             "starts.npy": np.dtype(np.float64), "ends.npy": np.dtype(np.float64)}
_LONGEST_SUFFIX = max(MEMBERS, key=len)


class SampleError(ValueError, NodeInputError):
    """One sample of a shard cannot be decoded (missing member, bad CRC, wrong shape ...)."""


# =====================================================================================================
# Encoding
# =====================================================================================================
def key_problem(key: str) -> str | None:
    """Why ``key`` cannot name a sample's members (None if it can): no dot, and every member name
    must fit the ustar name field."""
    if "." in key or len(f"{key}.{_LONGEST_SUFFIX}".encode()) > NAME_MAX:
        return "video id contains '.' or is too long for a tar member name"
    return None


def encode_record(record: VideoRecord, feature_dtype: str = "float32") -> list[tuple[str, bytes]]:
    """The members of one sample as (suffix, bytes), in tar order, the CRC list last; the 2d/3d
    features stored as ``feature_dtype`` (a key of :data:`FEATURE_DTYPES`; float16 rounds to nearest)."""
    dtype = FEATURE_DTYPES[feature_dtype]
    arrays = {
        "2d.npy": np.asarray(record.feat_2d, dtype),
        "3d.npy": np.asarray(record.feat_3d, dtype),
        "spec.npy": np.asarray(record.spec, np.float16),
        "tokens.npy": np.asarray(record.token_ids, np.int32),
        "offsets.npy": np.asarray(record.token_offsets, np.int64),
        "starts.npy": np.asarray(record.starts, np.float64),
        "ends.npy": np.asarray(record.ends, np.float64),
    }
    members = [(name, npy_bytes(arrays[name])) for name in ARRAY_MEMBERS]
    meta = {"id": record.video_id, "crc32": {name: crc32(data) for name, data in members}}
    members.append((META_MEMBER, json.dumps(meta, sort_keys=True).encode()))
    return members


# =====================================================================================================
# Checking and decoding
# =====================================================================================================
def _member(buf, span: SampleSpan, suffix: str) -> memoryview:
    off, size = span.members[suffix]
    return memoryview(buf)[off:off + size]


def _missing(span: SampleSpan, names: Sequence[str]) -> None:
    missing = [m for m in names if m not in span.members]
    if missing:
        raise SampleError(f"missing member(s) {', '.join(missing)}")


def check_crc(buf, span: SampleSpan) -> None:
    """Raise SampleError unless every member exists and matches the CRC-32 list of the json member."""
    _missing(span, MEMBERS)
    try:
        meta = json.loads(bytes(_member(buf, span, META_MEMBER)))
        crcs = meta["crc32"]
    except (ValueError, KeyError, TypeError):
        raise SampleError("member json is unreadable (damaged bytes)") from None
    for name in ARRAY_MEMBERS:
        if crc32(_member(buf, span, name)) != crcs.get(name):
            raise SampleError(f"member {name} fails its CRC-32 check (damaged bytes)")


def check_span(buf, span: SampleSpan, verify: bool = True) -> None:
    """The read tasks' check of one sample (no array is decoded): no scan error, every member
    present and, with ``verify``, every CRC-32 matching. Raises SampleError."""
    if span.error:
        raise SampleError(span.error)
    if verify:
        check_crc(buf, span)
    else:
        _missing(span, ARRAY_MEMBERS)


def decode_span(buf, span: SampleSpan, verify: bool = True) -> VideoRecord:
    """One sample -> VideoRecord whose arrays are zero-copy views into ``buf``.

    Args:
        verify: also check the CRC-32 list (catches flipped data bytes); the structural checks
            (members present, .npy headers, dtypes, shapes, caption offsets) always run.

    Raises:
        SampleError: naming the member and the problem.
    """
    check_span(buf, span, verify)
    try:
        arrays = {name: npy_view(_member(buf, span, name), name) for name in ARRAY_MEMBERS}
    except NpyError as e:
        raise SampleError(str(e)) from None
    return build_record(span.key, arrays)


def build_record(key: str, a: dict[str, np.ndarray]) -> VideoRecord:
    """Check dtypes, shapes and caption offsets of the decoded members; VideoRecord of views."""
    f2, f3, spec = a["2d.npy"], a["3d.npy"], a["spec.npy"]
    tokens, offsets, starts, ends = a["tokens.npy"], a["offsets.npy"], a["starts.npy"], a["ends.npy"]
    for name, dtype in _DTYPE_OF.items():
        if a[name].dtype != dtype:
            raise SampleError(f"member {name}: dtype {a[name].dtype}, expected {dtype}")
    if f2.dtype not in FEATURE_DTYPES.values() or f3.dtype != f2.dtype:
        raise SampleError(f"members 2d.npy, 3d.npy: dtypes {f2.dtype}, {f3.dtype}, expected one of "
                          f"{', '.join(FEATURE_DTYPES)} for both")
    if f2.ndim != 2 or f2.shape[1] != FEATURE_DIM or f3.ndim != 2 or f3.shape[1] != FEATURE_DIM:
        raise SampleError(f"2d/3d shapes {f2.shape}, {f3.shape}: expected (T, {FEATURE_DIM})")
    if spec.ndim != 2 or spec.shape[0] != MEL_BINS:
        raise SampleError(f"spec shape {spec.shape}: expected ({MEL_BINS}, T)")
    n = starts.shape[0] if starts.ndim == 1 else -1
    if n < 1 or ends.shape != (n,) or offsets.shape != (n + 1,) or tokens.ndim != 1:
        raise SampleError(f"caption arrays disagree: starts {starts.shape}, ends {ends.shape}, "
                          f"offsets {offsets.shape}, tokens {tokens.shape}")
    if offsets[0] != 0 or offsets[-1] != tokens.shape[0] or (n > 1 and np.any(np.diff(offsets) < 0)):
        raise SampleError("caption offsets are not a monotone partition of the tokens")
    return VideoRecord(key, f2, f3, spec, starts, ends, tokens, offsets)


def decode_sample_bytes(blob, key: str | None = None, verify: bool = False) -> VideoRecord:
    """Decode one sample from the bytes of its own tar region (``buf[span.start:span.end]``)."""
    spans = list(scan_tar(blob))
    if len(spans) != 1:
        raise SampleError(f"expected one sample in the region, found {len(spans)}")
    span = spans[0]
    if key is not None and span.key != key:
        raise SampleError(f"region holds sample {span.key!r}, expected {key!r}")
    return decode_span(blob, span, verify=verify)


# =====================================================================================================
# Checking the samples of one shard
# =====================================================================================================
@dataclass
class ShardScan:
    """Result of checking (part of) one shard: good spans, and (key, reason) for every bad sample."""

    good: list[SampleSpan]
    bad: list[tuple[str, str]]
    records: list[VideoRecord] = field(default_factory=list)  # decoded good samples (views), parallel to good


class ShardChecker:
    """Checks the samples of one shard as they arrive (possibly piece by piece): each key once, each
    listed in the manifest, each sample intact; at the end, the listed samples never seen.

    Args:
        expected: the shard's video ids from the manifest (None: accept any key, report none missing).
        verify: check each sample's CRC-32 list.
        decode: also decode each good sample (checks .npy headers, dtypes and shapes too).
    """

    MISSING = "missing from the shard (truncated or damaged tar)"

    def __init__(self, expected: Sequence[str] | None, verify: bool, decode: bool = True):
        self.expected = None if expected is None else list(expected)
        self.wanted = None if expected is None else set(expected)
        self.verify, self.decode = verify, decode
        self.seen: set[str] = set()
        self.damage: list[str] = []  # filled by the scan (tarfmt): the first entry explains losses

    def feed(self, buf, spans: Iterable[SampleSpan]) -> ShardScan:
        good, bad, records = [], [], []
        for span in spans:
            if span.key in self.seen:
                bad.append((span.key, "sample appears twice in the shard"))
                continue
            self.seen.add(span.key)
            if self.wanted is not None and span.key not in self.wanted:
                bad.append((span.key, "sample not listed in the manifest for this shard"))
                continue
            try:
                if self.decode:
                    records.append(decode_span(buf, span, verify=self.verify))
                else:
                    check_span(buf, span, self.verify)
            except SampleError as e:
                bad.append((span.key, str(e)))
                continue
            good.append(span)
        return ShardScan(good, bad, records)

    def finish(self) -> list[tuple[str, str]]:
        """The expected samples never seen (lost to truncation or a damaged header)."""
        if self.expected is None:
            return []
        why = self.MISSING + (f"; {self.damage[0]}" if self.damage else "")
        return [(k, why) for k in self.expected if k not in self.seen]
