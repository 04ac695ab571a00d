"""Tar shards: one sample per video, written from the original feature layout, plus the tar-level decoder.

Why: the original loader did one ``np.load`` per video file, in random order, over millions of files.
Shards turn that into large sequential reads; shuffling happens once when writing (videos are
permuted across shards with a seed) and again when reading (shard order per epoch, a buffer in the
worker). This module has no Ray dependency: the writer, the tar scanner and the sequential reader
used by tests and by ``bench/loader.py`` live here; ``reader.py`` puts Ray Data on top.

A shard is a plain POSIX (ustar) tar following the WebDataset convention: the members of one sample
are contiguous and share the *key* (the video id, the name up to the first dot)::

    <id>.2d.npy       (T2, 2048) float32   2D features, 1 row/s
    <id>.3d.npy       (T3, 2048) float32   3D features, 1.5 rows/s
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

Output directory::

    shard-000000.tar ...     the shards
    vocab.npy, vocab.txt     (V+1, D) float32 matrix (row 0 = padding), memory-mapped by readers; V words
    manifest.json            per shard: name, videos, bytes, sha256; counts; skipped videos with reasons
    plan.json                the video -> shard assignment (deterministic from the seed)
    .done/<shard>.json       one marker per finished shard (what makes a rerun resumable)
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import io
import json
import math
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from raymcn.config import PermanentError
from raymcn.data.features import (
    FEATURE_DIM,
    MEL_BINS,
    FeatureFileError,
    VideoRecord,
    load_captions,
    read_video,
    read_video_paths,
    video_id_of,
)
from raymcn.data.files import build_once, write_text_atomic
from raymcn.data.words import Vocab, build_vocab, load_vocab, read_word2vec_bin, save_vocab, tokenize

FORMAT = "raymcn-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PLAN = "plan.json"
DONE_DIR = ".done"
VOCAB_MARKER = "vocab.json"  # inside DONE_DIR
SHARD_PATTERN = "shard-{:06d}.tar"
ARRAY_MEMBERS = ("2d.npy", "3d.npy", "spec.npy", "tokens.npy", "offsets.npy", "starts.npy", "ends.npy")
META_MEMBER = "json"
MEMBERS = ARRAY_MEMBERS + (META_MEMBER,)
DEFAULT_SHARD_SIZE_MB = 256.0
_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_NAME_MAX = 100  # ustar name field; our names have no "/" so the prefix field cannot help
_SIZE_SAMPLE = 32  # videos whose npz headers are read to estimate the mean sample size


class ShardError(ValueError, PermanentError):
    """A problem with the inputs or the output directory of the shard writer (names the file)."""


class SampleError(ValueError):
    """One sample of a shard cannot be decoded (missing member, bad CRC, wrong shape ...)."""


# =====================================================================================================
# Encoding one sample
# =====================================================================================================
def npy_bytes(array: np.ndarray) -> bytes:
    """``np.save`` of ``array`` into bytes (format 1.0: data starts 64-byte aligned in the member)."""
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def encode_record(record: VideoRecord) -> list[tuple[str, bytes]]:
    """The members of one sample as (suffix, bytes), in tar order, the CRC list last."""
    arrays = {
        "2d.npy": np.asarray(record.feat_2d, np.float32),
        "3d.npy": np.asarray(record.feat_3d, np.float32),
        "spec.npy": np.asarray(record.spec, np.float16),
        "tokens.npy": np.asarray(record.token_ids, np.int32),
        "offsets.npy": np.asarray(record.token_offsets, np.int64),
        "starts.npy": np.asarray(record.starts, np.float64),
        "ends.npy": np.asarray(record.ends, np.float64),
    }
    members = [(name, npy_bytes(arrays[name])) for name in ARRAY_MEMBERS]
    meta = {"id": record.video_id, "crc32": {name: zlib.crc32(data) for name, data in members}}
    members.append((META_MEMBER, json.dumps(meta, sort_keys=True).encode()))
    return members


def _octal(value: int, width: int) -> bytes:
    return (b"%0*o" % (width - 1, value)) + b"\0"


def tar_header(name: str, size: int) -> bytes:
    """A deterministic ustar header for a regular file (mtime 0, root-owned, mode 0644)."""
    raw = name.encode("utf-8")
    if len(raw) > _NAME_MAX:
        raise ValueError(f"tar member name {name!r} is longer than {_NAME_MAX} bytes")
    hdr = bytearray(_BLOCK)
    hdr[0:len(raw)] = raw
    hdr[100:108] = _octal(0o644, 8)
    hdr[108:116] = _octal(0, 8)
    hdr[116:124] = _octal(0, 8)
    hdr[124:136] = _octal(size, 12)
    hdr[136:148] = _octal(0, 12)
    hdr[148:156] = b" " * 8
    hdr[156:157] = b"0"
    hdr[257:263] = b"ustar\0"
    hdr[263:265] = b"00"
    hdr[148:156] = b"%06o\0 " % sum(hdr)
    return bytes(hdr)


def _padding(size: int) -> bytes:
    return bytes(-size % _BLOCK)


class _HashingFile:
    """Write-through wrapper that keeps the sha256 and the byte count of everything written."""

    def __init__(self, f):
        self.f, self.sha, self.bytes = f, hashlib.sha256(), 0

    def write(self, data) -> None:
        self.f.write(data)
        self.sha.update(data)
        self.bytes += len(data)


def write_sample(out: _HashingFile, key: str, members: list[tuple[str, bytes]]) -> None:
    for suffix, data in members:
        out.write(tar_header(f"{key}.{suffix}", len(data)))
        out.write(data)
        out.write(_padding(len(data)))


def end_archive(out: _HashingFile) -> None:
    out.write(_ZERO_BLOCK * 2)


# =====================================================================================================
# Scanning a tar buffer (tolerant of damage) and decoding samples
# =====================================================================================================
@dataclass
class SampleSpan:
    """One sample found in a tar buffer.

    Attributes:
        key: the sample key (video id).
        start, end: byte range in the buffer from its first header to the end of its last member's
            data (padding excluded); a sample is re-scannable from ``buf[start:end]``.
        members: suffix -> (data offset, data size) in the buffer.
        error: why the sample is unusable, as found by the scan (truncation, duplicate member), or None.
    """

    key: str
    start: int
    end: int
    members: dict[str, tuple[int, int]] = field(default_factory=dict)
    error: str | None = None


def _parse_octal(field_: bytes) -> int:
    if field_ and field_[0] & 0x80:  # GNU base-256 for large sizes
        return int.from_bytes(bytes([field_[0] & 0x7F]) + field_[1:], "big")
    text = field_.split(b"\0", 1)[0].strip()
    return int(text, 8) if text else 0


def _checksum_ok(hdr: bytes) -> bool:
    try:
        stored = _parse_octal(hdr[148:156])
    except ValueError:
        return False
    unsigned = sum(hdr) - sum(hdr[148:156]) + 8 * 32
    return stored == unsigned


def _is_header(buf, pos: int) -> bool:
    hdr = bytes(buf[pos:pos + _BLOCK])
    return len(hdr) == _BLOCK and hdr[257:262] == b"ustar" and _checksum_ok(hdr)


def _resync(buf, pos: int, end: int, base: int) -> int:
    """The next offset >= pos, block-aligned relative to ``base``, holding a valid ustar header; else ``end``.

    Only runs on damage or at the end of an archive; buffers without ``find`` (memoryview) are
    searched through a bytes copy of the remaining range.
    """
    if hasattr(buf, "find"):
        hay, shift = buf, 0
    else:
        hay, shift = bytes(buf[pos:end]), pos
    i = hay.find(b"ustar", pos - shift + 257, end - shift)
    while i != -1:
        h = i + shift - 257
        if (h - base) % _BLOCK == 0 and h + _BLOCK <= end and _is_header(buf, h):
            return h
        i = hay.find(b"ustar", i + 1, end - shift)
    return end


def _split_name(name: str) -> tuple[str | None, str | None]:
    """WebDataset key/suffix split: key = path up to the first dot of the basename."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot <= slash + 1:
        return None, None
    return name[:dot], name[dot + 1:]


def scan_tar(buf, start: int = 0, end: int | None = None,
             damage: list[str] | None = None) -> Iterator[SampleSpan]:
    """Group the regular-file members of a tar buffer into samples (consecutive members, same key).

    Tolerates damage: a header whose checksum fails is skipped and the scan resynchronises at the
    next valid header (the members it described are then missing from their sample); a member
    running past ``end`` (truncated shard) ends the scan and marks its sample.
    Understands ustar name+prefix, GNU long names (``L``) and pax ``path``/``size`` records, so
    shards written by other tools (tarfile, webdataset's TarWriter) scan too.

    Args:
        buf: bytes, bytearray or memoryview holding the tar (or one sample's region of it).
        start, end: the byte range to scan; ``start`` must be a header boundary.
        damage: if given, a description of every damaged spot is appended.

    Yields:
        SampleSpan per sample, in archive order. A sample split by a foreign key in between is
        yielded twice (the consumer treats the second as a duplicate).
    """
    spans, _ = scan_spans(buf, start, end, damage)
    yield from spans


def scan_spans(buf, start: int = 0, end: int | None = None,
               damage: list[str] | None = None) -> tuple[list[SampleSpan], int]:
    """:func:`scan_tar` as a list, plus the offset where the scan stopped: ``end``, or the header
    of a member that runs past ``end`` (where a chunked reader resumes once it has more bytes)."""
    end = len(buf) if end is None else end
    pos, base = start, start
    spans: list[SampleSpan] = []
    current: SampleSpan | None = None
    long_name: str | None = None
    pax: dict[str, str] = {}
    ext_start: int | None = None  # first pax / GNU long-name header belonging to the next member
    stop = end
    while pos + _BLOCK <= end:
        hdr = bytes(buf[pos:pos + _BLOCK])
        if hdr == _ZERO_BLOCK:
            pos = _resync(buf, pos + _BLOCK, end, base)  # end of archive, or zeroed damage
            continue
        if not _checksum_ok(hdr):
            if damage is not None:
                damage.append(f"damaged tar header at byte {pos}")
            pos = _resync(buf, pos + _BLOCK, end, base)
            continue
        try:
            size = _parse_octal(hdr[124:136])
        except ValueError:
            size = -1
        if "size" in pax:
            with contextlib.suppress(ValueError):
                size = int(pax["size"])
        if size < 0:
            if damage is not None:
                damage.append(f"unreadable size field at byte {pos}")
            pos = _resync(buf, pos + _BLOCK, end, base)
            continue
        data = pos + _BLOCK
        typeflag = hdr[156:157]
        if data + size > end:  # truncated: this member (and everything after it) is cut off
            stop = pos if ext_start is None else ext_start
            name = long_name or pax.get("path") or _ustar_name(hdr)
            key, _ = _split_name(name)
            msg = f"member {name} truncated ({end - data} of {size} bytes present)"
            if current is not None and key == current.key:
                current.error = current.error or msg
            elif key is not None:
                if current is not None:
                    spans.append(current)
                current = SampleSpan(key, stop, end, error=msg)
            break
        nxt = data + size + (-size % _BLOCK)
        if typeflag == b"L":  # GNU long name for the next member
            long_name = bytes(buf[data:data + size]).split(b"\0", 1)[0].decode("utf-8", "replace")
            ext_start = pos if ext_start is None else ext_start
            pos = nxt
            continue
        if typeflag == b"x":  # pax extended header for the next member
            pax = _parse_pax(bytes(buf[data:data + size]))
            ext_start = pos if ext_start is None else ext_start
            pos = nxt
            continue
        if typeflag == b"g":  # pax global header: nothing we use
            pos = nxt
            continue
        name = long_name or pax.get("path") or _ustar_name(hdr)
        first = pos if ext_start is None else ext_start
        long_name, pax, ext_start = None, {}, None
        if typeflag not in (b"0", b"\0", b"7"):  # directories, links ...: not sample members
            pos = nxt
            continue
        key, suffix = _split_name(name)
        if key is None:
            pos = nxt
            continue
        if current is None or key != current.key:
            if current is not None:
                spans.append(current)
            current = SampleSpan(key, first, data + size)
        if suffix in current.members:
            current.error = current.error or f"member {suffix} appears twice"
        current.members[suffix] = (data, size)
        current.end = data + size
        pos = nxt
    if current is not None:
        spans.append(current)
    return spans, stop


def _ustar_name(hdr: bytes) -> str:
    name = hdr[0:100].split(b"\0", 1)[0]
    if hdr[257:263] == b"ustar\0":
        prefix = hdr[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "replace")


def _parse_pax(data: bytes) -> dict[str, str]:
    out, i = {}, 0
    while i < len(data):
        sp = data.find(b" ", i)
        if sp < 0:
            break
        try:
            length = int(data[i:sp])
        except ValueError:
            break
        record = data[sp + 1:i + length - 1]
        k, _, v = record.partition(b"=")
        out[k.decode("utf-8", "replace")] = v.decode("utf-8", "replace")
        i += max(length, 1)
    return out


_NPY_RE = re.compile(rb"\{'descr': '([<>|=]?[a-zA-Z]\d*)', 'fortran_order': (True|False), 'shape': \(([\d, ]*)\), \}")
_DTYPES: dict[bytes, np.dtype] = {}


def npy_view(mv: memoryview, what: str = "member") -> np.ndarray:
    """The array of an ``.npy`` member as a zero-copy (read-only if the buffer is) view.

    Raises:
        SampleError: bad magic, unparsable header, object dtype or a data size that does not match.
    """
    if len(mv) < 10 or bytes(mv[:6]) != b"\x93NUMPY":
        raise SampleError(f"{what}: not an .npy member (bad magic)")
    major = mv[6]
    if major == 1:
        hlen, hstart = int.from_bytes(mv[8:10], "little"), 10
    elif major in (2, 3):
        hlen, hstart = int.from_bytes(mv[8:12], "little"), 12
    else:
        raise SampleError(f"{what}: unsupported .npy version {major}")
    header = bytes(mv[hstart:hstart + hlen])
    m = _NPY_RE.match(header)
    if m:
        descr, fortran = m.group(1), m.group(2) == b"True"
        shape = tuple(int(s) for s in m.group(3).split(b",") if s.strip())
        dtype = _DTYPES.get(descr)
        if dtype is None:
            try:
                dtype = _DTYPES[descr] = np.dtype(descr.decode())
            except TypeError:
                raise SampleError(f"{what}: bad dtype {descr!r}") from None
    else:  # unusual but valid headers (structured dtypes ...): the slow, general parser
        try:
            d = ast.literal_eval(header.decode("latin1"))
            dtype, fortran, shape = np.dtype(d["descr"]), bool(d["fortran_order"]), tuple(d["shape"])
        except Exception as e:  # noqa: BLE001 - any failure means a damaged header
            raise SampleError(f"{what}: unreadable .npy header ({type(e).__name__})") from None
    if dtype.hasobject:
        raise SampleError(f"{what}: object arrays are not allowed")
    count = math.prod(shape)
    offset = hstart + hlen
    if len(mv) - offset != count * dtype.itemsize:
        raise SampleError(f"{what}: {len(mv) - offset} data bytes for shape {shape} {dtype} "
                          f"(expected {count * dtype.itemsize})")
    arr = np.frombuffer(mv, dtype=dtype, count=count, offset=offset)
    return arr.reshape(shape, order="F" if fortran else "C")


def _member(buf, span: SampleSpan, suffix: str) -> memoryview:
    off, size = span.members[suffix]
    return memoryview(buf)[off:off + size]


def check_crc(buf, span: SampleSpan) -> None:
    """Raise SampleError unless every member exists and matches the CRC-32 list of the json member."""
    missing = [m for m in MEMBERS if m not in span.members]
    if missing:
        raise SampleError(f"missing member(s) {', '.join(missing)}")
    try:
        meta = json.loads(bytes(_member(buf, span, META_MEMBER)))
        crcs = meta["crc32"]
    except (ValueError, KeyError, TypeError):
        raise SampleError("member json is unreadable (damaged bytes)") from None
    for name in ARRAY_MEMBERS:
        if zlib.crc32(_member(buf, span, name)) != crcs.get(name):
            raise SampleError(f"member {name} fails its CRC-32 check (damaged bytes)")


def decode_span(buf, span: SampleSpan, verify: bool = True) -> VideoRecord:
    """One sample -> VideoRecord whose arrays are zero-copy views into ``buf``.

    Args:
        verify: also check the CRC-32 list (catches flipped data bytes); the structural checks
            (members present, .npy headers, dtypes, shapes, caption offsets) always run.

    Raises:
        SampleError: naming the member and the problem.
    """
    if span.error:
        raise SampleError(span.error)
    if verify:
        check_crc(buf, span)
    else:
        missing = [m for m in ARRAY_MEMBERS if m not in span.members]
        if missing:
            raise SampleError(f"missing member(s) {', '.join(missing)}")
    return build_record(span.key, {name: npy_view(_member(buf, span, name), name) for name in ARRAY_MEMBERS})


def span_layout(span: SampleSpan) -> list[int]:
    """(offset from the sample's start, size) of each array member, flattened: 2 x len(ARRAY_MEMBERS) ints."""
    out = []
    for name in ARRAY_MEMBERS:
        off, size = span.members[name]
        out += [off - span.start, size]
    return out


def decode_layout(blob, key: str, layout: Sequence[int]) -> VideoRecord:
    """VideoRecord from one sample's bytes and its :func:`span_layout` (no tar header is re-read)."""
    mv = memoryview(blob)
    arrays = {}
    for i, name in enumerate(ARRAY_MEMBERS):
        off, size = int(layout[2 * i]), int(layout[2 * i + 1])
        if off < 0 or off + size > len(mv):
            raise SampleError(f"member {name} lies outside the sample's bytes")
        arrays[name] = npy_view(mv[off:off + size], name)
    return build_record(key, arrays)


def build_record(key: str, a: dict[str, np.ndarray]) -> VideoRecord:
    """Check dtypes, shapes and caption offsets of the decoded members; VideoRecord of views."""
    f2, f3, spec = a["2d.npy"], a["3d.npy"], a["spec.npy"]
    tokens, offsets, starts, ends = a["tokens.npy"], a["offsets.npy"], a["starts.npy"], a["ends.npy"]
    for name, dtype in _DTYPE_OF.items():
        if a[name].dtype != dtype:
            raise SampleError(f"member {name}: dtype {a[name].dtype}, expected {dtype}")
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


_DTYPE_OF = {"2d.npy": np.dtype(np.float32), "3d.npy": np.dtype(np.float32), "spec.npy": np.dtype(np.float16),
             "tokens.npy": np.dtype(np.int32), "offsets.npy": np.dtype(np.int64),
             "starts.npy": np.dtype(np.float64), "ends.npy": np.dtype(np.float64)}


def decode_sample_bytes(blob, key: str | None = None, verify: bool = False) -> VideoRecord:
    """Decode one sample from the bytes of its own tar region (as the Ray reader ships it)."""
    spans = list(scan_tar(blob))
    if len(spans) != 1:
        raise SampleError(f"expected one sample in the region, found {len(spans)}")
    span = spans[0]
    if key is not None and span.key != key:
        raise SampleError(f"region holds sample {span.key!r}, expected {key!r}")
    return decode_span(blob, span, verify=verify)


@dataclass
class ShardScan:
    """Result of scanning one whole shard: good spans, and (key, reason) for every bad sample."""

    good: list[SampleSpan]
    bad: list[tuple[str, str]]
    records: list[VideoRecord] = field(default_factory=list)  # decoded good samples (views), parallel to good


class _Checker:
    """Validates the spans of one shard as they arrive (possibly chunk by chunk)."""

    MISSING = "missing from the shard (truncated or damaged tar)"

    def __init__(self, expected: Sequence[str] | None, verify: bool, decode: bool = True):
        self.expected = None if expected is None else list(expected)
        self.wanted = None if expected is None else set(expected)
        self.verify, self.decode = verify, decode
        self.seen: set[str] = set()
        self.damage: list[str] = []

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
                elif span.error:
                    raise SampleError(span.error)
                elif self.verify:
                    check_crc(buf, span)
                elif any(m not in span.members for m in ARRAY_MEMBERS):
                    raise SampleError("missing member(s) " + ", ".join(m for m in ARRAY_MEMBERS
                                                                      if m not in span.members))
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


def check_shard(buf, expected: Sequence[str] | None = None, verify: bool = True) -> ShardScan:
    """Scan + validate a whole shard buffer; with ``expected`` (the manifest's ids), also reports the
    samples that never appear (lost to truncation or a damaged header) and refuses unlisted keys."""
    checker = _Checker(expected, verify)
    spans, stop = scan_spans(buf, 0, len(buf), checker.damage)
    if stop < len(buf):
        checker.damage.append(f"shard truncated at byte {len(buf)}")
    scan = checker.feed(buf, spans)
    scan.bad.extend(checker.finish())
    return scan


DEFAULT_CHUNK_BYTES = 64 << 20  # the same pieces as the Ray read tasks (reader.DEFAULT_BLOCK_MB)


def iter_shard_chunks(path: str | os.PathLike, expected: Sequence[str] | None = None, *,
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES, verify: bool = True,
                      decode: bool = True) -> Iterator[tuple[np.ndarray, ShardScan]]:
    """Read a shard sequentially in ~chunk_bytes pieces; yields ``(buffer, ShardScan)`` per piece.

    The good spans of each piece index into that piece's buffer (a fresh uint8 array per piece:
    records may keep views into it). Only complete samples are reported: a sample cut by the
    piece boundary is read again at the start of the next piece, so memory stays at about one
    piece (or one sample, if a sample is larger). Bad samples are reported where found; the
    expected samples that never appeared come last, with an empty buffer.

    Args:
        verify: check each sample's CRC-32 list.
        decode: also decode each good sample (``ShardScan.records``) — which checks the ``.npy``
            headers, dtypes and shapes; without it only members and CRCs are checked.

    Raises:
        OSError: if the shard cannot be opened or read.
    """
    chunk_bytes = max(_BLOCK, chunk_bytes - chunk_bytes % _BLOCK)  # keeps every piece header-aligned
    checker = _Checker(expected, verify, decode)
    with open(path, "rb", buffering=0) as f:
        base = 0
        _advise(f, 0, 0, "SEQUENTIAL")  # larger kernel read-ahead (WILLNEED per piece measured no better)
        # np.empty, not bytearray: no memset, and numpy asks for huge pages on large buffers
        # (page faults otherwise cost more than the read itself).
        buf = np.empty(chunk_bytes, np.uint8)
        got = _fill(f, buf, 0)
        while True:
            eof = got < len(buf)
            spans, stop = scan_spans(buf, 0, got, checker.damage)
            if eof and stop < got:
                checker.damage.append(f"shard truncated at byte {base + got}")
            hold = got
            if not eof:  # the last sample may continue in the next piece: read it again there
                hold = min(stop, spans[-1].start) if spans else stop
                if hold == 0:  # one sample larger than the piece: grow the piece, keep what was read
                    bigger = np.empty(2 * len(buf), np.uint8)
                    bigger[:got] = buf[:got]
                    buf, got = bigger, _fill(f, bigger, got)
                    continue
                spans = [sp for sp in spans if sp.start < hold]
            if spans:
                yield buf, checker.feed(buf, spans)
            if eof:
                break
            base += hold
            f.seek(base)
            buf = np.empty(chunk_bytes, np.uint8)
            got = _fill(f, buf, 0)
    lost = checker.finish()
    if lost:
        yield np.empty(0, np.uint8), ShardScan([], lost)


def _advise(f, offset: int, length: int, what: str) -> None:
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        with contextlib.suppress(OSError):
            advise(f.fileno(), offset, length, getattr(os, f"POSIX_FADV_{what}"))


def _fill(f, buf: np.ndarray, got: int) -> int:
    """Read into ``buf[got:]`` until it is full or the file ends; returns the bytes now in ``buf``."""
    view = memoryview(buf)
    while got < len(buf):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    view.release()
    return got


def iter_shard_records(path: str | os.PathLike, expected: Sequence[str] | None = None, verify: bool = True,
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES
                       ) -> Iterator[tuple[str, VideoRecord | None, str | None]]:
    """Sequential single-process reader (no Ray): ``(video_id, record, None)`` or ``(video_id, None, reason)``.

    Records are zero-copy views into the chunk buffers. An unreadable shard file yields every
    ``expected`` id as bad (or raises if none is given).
    """
    done: set[str] = set()
    try:
        for buf, scan in iter_shard_chunks(path, expected, chunk_bytes=chunk_bytes, verify=verify):
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
# The writer
# =====================================================================================================
@dataclass(frozen=True)
class LayoutSources:
    """Where the original layout lives (the arguments of ``raymcn shards``)."""

    features: Path
    audio_features: Path
    captions: Path
    video_list: Path
    word_vectors: Path


def _file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise ShardError(f"{path}: unreadable JSON ({e})") from None


def _check_inputs(src: LayoutSources) -> None:
    problems = []
    for label, p, want_dir in (("--features", src.features, True), ("--audio-features", src.audio_features, True),
                               ("--captions", src.captions, False), ("--video-list", src.video_list, False),
                               ("--word-vectors", src.word_vectors, False)):
        if want_dir and not p.is_dir():
            problems.append(f"{label} {p}: no such directory")
        elif not want_dir and not p.is_file():
            problems.append(f"{label} {p}: no such file")
    if problems:
        raise ShardError("; ".join(problems))


def _estimate_sample_bytes(paths: Sequence[str], src: LayoutSources, rng: np.random.Generator) -> float:
    """Mean uncompressed sample size from the zip directories of a few videos (no array is read)."""
    sizes = []
    for i in rng.permutation(len(paths))[:_SIZE_SAMPLE]:
        path = paths[int(i)]
        vid = video_id_of(path)
        total = 0
        try:
            for f in (src.features / path / f"{vid}_2d.npz", src.features / path / f"{vid}_3d.npz",
                      src.audio_features / path / f"{vid}_spec.npz"):
                with zipfile.ZipFile(f) as z:
                    total += sum(info.file_size for info in z.infolist())
        except (OSError, zipfile.BadZipFile):
            continue
        sizes.append(total + 8 * 1024)  # captions + tar/npy headers
    return float(np.mean(sizes)) if sizes else float(1 << 20)


def _plan_key(src: LayoutSources, list_sha: str, seed: int, shard_size_mb: float,
              videos_per_shard: int | None) -> str:
    ident = {"format": FORMAT, "version": FORMAT_VERSION, "seed": seed, "shard_size_mb": shard_size_mb,
             "videos_per_shard": videos_per_shard, "video_list_sha256": list_sha,
             "features": str(src.features.resolve()), "audio_features": str(src.audio_features.resolve()),
             "captions": [str(src.captions.resolve()), src.captions.stat().st_size],
             "word_vectors": [str(src.word_vectors.resolve()), src.word_vectors.stat().st_size]}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def _make_plan(paths: list[str], src: LayoutSources, seed: int, shard_size_mb: float,
               videos_per_shard: int | None, key: str) -> dict:
    """Videos permuted with ``seed`` and cut into shards of ~shard_size_mb (or videos_per_shard)."""
    kept, seen, duplicates = [], set(), []
    for p in paths:
        vid = video_id_of(p)
        if vid in seen:
            duplicates.append([vid, f"listed more than once in {src.video_list}; kept the first entry"])
            continue
        seen.add(vid)
        kept.append(p)
    rng = np.random.default_rng([seed, 0x5EED])
    order = rng.permutation(len(kept))
    if videos_per_shard is None:
        mean = _estimate_sample_bytes(kept, src, rng)
        videos_per_shard = max(1, int(round(shard_size_mb * (1 << 20) / mean)))
    shuffled = [kept[int(i)] for i in order]
    shards = [shuffled[i:i + videos_per_shard] for i in range(0, len(shuffled), videos_per_shard)]
    return {"plan": key, "seed": seed, "shard_size_mb": shard_size_mb, "videos_per_shard": videos_per_shard,
            "listed": len(paths), "duplicates": duplicates,
            "shards": [{"name": SHARD_PATTERN.format(i), "paths": chunk} for i, chunk in enumerate(shards)]}


# Worker state (set in the parent before forking, or by the initializer under "spawn").
_WORK: dict[str, Any] = {}


def _init_worker(state: dict) -> None:
    if "captions" not in state:  # spawn: load what the fork would have inherited
        state = dict(state, captions=load_captions(state["captions_path"]),
                     word_to_id=load_vocab(state["out"]).word_to_id)
    _WORK.clear()
    _WORK.update(state)


def _write_one_shard(job: tuple[int, str, list[str]]) -> dict:
    """Write one shard (temp name, then rename) and its done marker; returns the marker dict."""
    index, name, paths = job
    w = _WORK
    out: Path = w["out"]
    t0 = time.perf_counter()
    videos, skipped = [], []
    final = out / name
    tmp = out / f".{name}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        hf = _HashingFile(f)
        for path in paths:
            vid = video_id_of(path)
            if "." in vid or len(f"{vid}.offsets.npy".encode()) > _NAME_MAX:
                skipped.append([vid, "video id contains '.' or is too long for a tar member name"])
                continue
            try:
                rec = read_video(path, w["features"], w["audio"], w["captions"], w["word_to_id"], None,
                                 w["captions_source"])
            except FeatureFileError as e:
                skipped.append([vid, str(e)])
                continue
            write_sample(hf, vid, encode_record(rec))
            videos.append(vid)
        end_archive(hf)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    marker = {"name": name, "index": index, "plan": w["plan"], "videos": videos, "skipped": skipped,
              "bytes": hf.bytes, "sha256": hf.sha.hexdigest(), "seconds": round(time.perf_counter() - t0, 3)}
    write_text_atomic(out / DONE_DIR / f"{name}.json", json.dumps(marker))
    return marker


def _shard_is_done(out: Path, name: str, plan_key: str, verify: str) -> dict | None:
    marker_path = out / DONE_DIR / f"{name}.json"
    try:
        marker = json.loads(marker_path.read_text())
    except (OSError, ValueError):
        return None
    tar = out / name
    if marker.get("plan") != plan_key or not tar.is_file() or tar.stat().st_size != marker.get("bytes"):
        return None
    if verify == "sha256" and _file_sha256(tar) != marker.get("sha256"):
        return None
    return marker


def _caption_texts(paths: Iterable[str], captions) -> Iterator[str]:
    for p in paths:
        rec = captions.get(video_id_of(p))
        if rec is None:
            continue
        try:
            yield from (t if isinstance(t, str) else str(t) for t in rec["text"])
        except (KeyError, TypeError):
            continue


def _ensure_vocab(out: Path, plan: dict, src: LayoutSources, captions) -> Vocab:
    """Build (once) the vocabulary of the caption words that have a vector; reuse it on reruns."""
    marker = out / DONE_DIR / VOCAB_MARKER
    with contextlib.suppress(OSError, ValueError):
        m = json.loads(marker.read_text())
        if m.get("plan") == plan["plan"] and (out / "vocab.npy").is_file():
            vocab = load_vocab(out)
            if len(vocab.words) == m.get("words"):
                return vocab
    paths = [p for s in plan["shards"] for p in s["paths"]]
    # One tokenising pass (HowTo100M has ~10^8 captions): the words in order of first appearance;
    # the vocabulary is then what build_vocab gives: those words that have a vector, in that order.
    first_seen: dict[str, None] = {}
    for text in _caption_texts(paths, captions):
        for tok in tokenize(text):
            first_seen.setdefault(tok)
    try:
        wv = read_word2vec_bin(src.word_vectors, keep=first_seen)
    except ValueError as e:
        raise ShardError(str(e)) from None
    except OSError as e:
        raise ShardError(f"--word-vectors {src.word_vectors}: unreadable ({e})") from None
    if not wv.words:
        raise ShardError(f"--word-vectors {src.word_vectors}: none of the {len(first_seen)} caption words "
                         "has a vector")
    vocab = build_vocab([" ".join(first_seen)], wv)
    tmpdir = Path(tempfile.mkdtemp(prefix=".vocab-", dir=out))
    try:
        save_vocab(tmpdir, vocab)
        os.replace(tmpdir / "vocab.npy", out / "vocab.npy")
        os.replace(tmpdir / "vocab.txt", out / "vocab.txt")
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    write_text_atomic(marker, json.dumps({"plan": plan["plan"], "words": len(vocab.words),
                                           "dim": vocab.dim, "sha256": _file_sha256(out / "vocab.npy")}))
    return load_vocab(out)


def _build_manifest(out: Path, plan: dict, markers: list[dict], src: LayoutSources, settings: dict) -> dict:
    vocab_meta = json.loads((out / DONE_DIR / VOCAB_MARKER).read_text())
    shards = [{"name": m["name"], "videos": m["videos"], "bytes": m["bytes"], "sha256": m["sha256"]}
              for m in sorted(markers, key=lambda m: m["index"])]
    skipped = [{"video": v, "reason": r, "shard": None} for v, r in plan["duplicates"]]
    for m in sorted(markers, key=lambda m: m["index"]):
        skipped.extend({"video": v, "reason": r, "shard": m["name"]} for v, r in m["skipped"])
    n_videos = sum(len(s["videos"]) for s in shards)
    return {
        "format": FORMAT, "version": FORMAT_VERSION, "plan": plan["plan"],
        "settings": {**settings, "videos_per_shard": plan["videos_per_shard"], "members": list(MEMBERS)},
        "sources": {k: str(v) for k, v in dataclasses.asdict(src).items()},
        "counts": {"listed": plan["listed"], "videos": n_videos, "skipped": len(skipped), "shards": len(shards),
                   "bytes": sum(s["bytes"] for s in shards), "vocab_words": vocab_meta["words"],
                   "word_dim": vocab_meta["dim"]},
        "vocab": {"matrix": "vocab.npy", "words": "vocab.txt", "sha256": vocab_meta["sha256"]},
        "shards": shards,
        "skipped": skipped,
    }


def shards_from_layout(features: str | os.PathLike, audio_features: str | os.PathLike,
                       captions: str | os.PathLike, video_list: str | os.PathLike,
                       word_vectors: str | os.PathLike, out: str | os.PathLike, *,
                       shard_size_mb: float = DEFAULT_SHARD_SIZE_MB, seed: int = 0, workers: int = 1,
                       videos_per_shard: int | None = None, verify: str = "sha256",
                       progress: bool = True, log=None) -> dict:
    """Write the videos of the original layout into shuffled tar shards in ``out``; returns the manifest.

    Resumable: a shard whose done marker matches the plan (and, with ``verify="sha256"``, whose
    bytes still hash to the recorded sha256) is not rewritten; when every shard is complete and the
    manifest is current, nothing is written at all.

    Args:
        features, audio_features: roots of the 2d/3d and spectrogram npz files.
        captions: the caption pickle; video_list: the CSV with header ``path``;
        word_vectors: a binary word2vec file (GoogleNews or the synthetic one).
        shard_size_mb: target shard size (from the mean size of a few videos' npz contents).
        seed: permutation of the videos across shards (same seed, same assignment).
        workers: processes writing shards in parallel (0 or 1 = in this process).
        videos_per_shard: fixed number of videos per shard instead of the size target.
        verify: "sha256" (rehash finished shards on a rerun) or "size" (trust marker + size).
        log: callable for progress lines (default: print to stderr).

    Raises:
        ShardError: a missing input, or ``out`` holding shards of a different plan.
        FeatureFileError: unreadable video list or caption pickle (the message names the file).
    """
    if verify not in ("sha256", "size"):
        raise ValueError(f"verify={verify!r}: allowed values are sha256, size")
    if shard_size_mb <= 0 or (videos_per_shard is not None and videos_per_shard < 1):
        raise ShardError("shard size must be positive (--shard-size-mb > 0, videos per shard >= 1)")
    log = log or (lambda msg: print(msg, file=sys.stderr))
    src = LayoutSources(Path(features), Path(audio_features), Path(captions), Path(video_list), Path(word_vectors))
    _check_inputs(src)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / DONE_DIR).mkdir(exist_ok=True)

    list_bytes = src.video_list.read_bytes()
    key = _plan_key(src, hashlib.sha256(list_bytes).hexdigest(), seed, shard_size_mb, videos_per_shard)
    plan_path = out / PLAN
    if plan_path.exists():
        plan = _read_json(plan_path)
        if plan.get("plan") != key:
            raise ShardError(f"{plan_path}: {out} already holds shards written from other inputs or settings "
                             f"(plan {plan.get('plan')}, now {key}); use a new --out directory or delete it")
    else:
        paths = read_video_paths(src.video_list)
        if not paths:
            raise ShardError(f"--video-list {src.video_list}: lists no videos")
        plan = _make_plan(paths, src, seed, shard_size_mb, videos_per_shard, key)
        write_text_atomic(plan_path, json.dumps(plan))

    settings = {"seed": seed, "shard_size_mb": shard_size_mb}
    jobs = [(i, s["name"], s["paths"]) for i, s in enumerate(plan["shards"])]
    done: dict[str, dict] = {}
    todo = []
    for job in jobs:
        marker = _shard_is_done(out, job[1], key, verify)
        if marker is None:
            todo.append(job)
        else:
            done[job[1]] = marker

    vocab_ok = (out / DONE_DIR / VOCAB_MARKER).is_file() and (out / "vocab.npy").is_file() \
        and (out / "vocab.txt").is_file()
    if not todo and vocab_ok:
        manifest = _build_manifest(out, plan, list(done.values()), src, settings)
        text = json.dumps(manifest, indent=1)
        if not (out / MANIFEST).is_file() or (out / MANIFEST).read_text() != text:
            write_text_atomic(out / MANIFEST, text)
        log(f"shards: all {len(jobs)} shards in {out} are complete; nothing to do")
        return manifest

    t0 = time.perf_counter()
    caps = load_captions(src.captions)
    vocab = _ensure_vocab(out, plan, src, caps)
    log(f"shards: {len(todo)} of {len(jobs)} shards to write ({plan['videos_per_shard']} videos each, "
        f"vocabulary of {len(vocab.words)} words), {max(1, workers)} worker(s)")
    state = {"out": out, "features": src.features, "audio": src.audio_features, "captions": caps,
             "word_to_id": vocab.word_to_id, "captions_source": str(src.captions), "plan": key,
             "captions_path": src.captions}
    try:
        if workers <= 1 or len(todo) <= 1:
            _init_worker(state)
            bar = _progress(len(todo), progress)
            try:
                for job in todo:
                    marker = _write_one_shard(job)
                    done[marker["name"]] = marker
                    bar.update(1)
            finally:
                bar.close()
        else:
            methods = multiprocessing.get_all_start_methods()
            ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
            init_state = state if ctx.get_start_method() == "fork" else \
                {k: v for k, v in state.items() if k not in ("captions", "word_to_id")}
            # the pool forks before the progress bar starts its monitor thread
            with ctx.Pool(min(workers, len(todo)), initializer=_init_worker, initargs=(init_state,)) as pool:
                bar = _progress(len(todo), progress)
                try:
                    for marker in pool.imap_unordered(_write_one_shard, todo):
                        done[marker["name"]] = marker
                        bar.update(1)
                finally:
                    bar.close()
    finally:
        _WORK.clear()
    manifest = _build_manifest(out, plan, list(done.values()), src, settings)
    write_text_atomic(out / MANIFEST, json.dumps(manifest, indent=1))
    c = manifest["counts"]
    log(f"shards: {c['videos']} videos in {c['shards']} shards ({c['bytes'] / 2**20:.1f} MiB), "
        f"{c['skipped']} skipped, {time.perf_counter() - t0:.1f} s -> {out / MANIFEST}")
    return manifest


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency, but a progress bar is never worth a crash
        return _NoBar()
    return tqdm(total=total, unit="shard", desc="shards", file=sys.stderr)


# =====================================================================================================
# Reading the manifest; the embedded default (synthetic corpus -> shards in the cache)
# =====================================================================================================
def manifest_path(directory: str | os.PathLike) -> Path:
    """``directory/manifest.json``; FileNotFoundError naming it when it is missing."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no shard manifest (is {directory} a directory written by "
                                "`raymcn shards`?)")
    return path


def load_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a shard directory.

    Raises:
        FileNotFoundError / ShardError: naming ``<directory>/manifest.json`` (missing, unreadable,
            not a raymcn shard manifest, or listing no videos).
    """
    path = manifest_path(directory)
    manifest = _read_json(path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ShardError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise ShardError(f"{path}: manifest version {manifest.get('version')}, this raymcn reads {FORMAT_VERSION}")
    if not manifest.get("shards") or not manifest.get("counts", {}).get("videos"):
        raise ShardError(f"{path}: lists no videos")
    return manifest


def shard_digest(corpus_digest: str, videos_per_shard: int, seed: int) -> str:
    ident = {"corpus": corpus_digest, "videos_per_shard": videos_per_shard, "seed": seed, "version": FORMAT_VERSION}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]


SYNTHETIC_SHARDS = 16  # the embedded corpus is cut into this many shards (shard order can vary per epoch)


def ensure_synthetic_shards(cfg) -> Path:
    """Shards of the synthetic corpus of ``cfg`` in the cache; generated once (atomic), then reused.

    The corpus comes from ``synthetic.ensure_corpus(cfg)``; the shards go to
    ``<cache>/shards-<digest>`` (written into a private temporary directory, then renamed, so a
    reader never sees a half-written directory; a lost race keeps the winner's copy).
    Written in this process (no pool): the caller may be a process that already runs Ray.
    """
    from raymcn.config import default_cache_dir
    from raymcn.data.synthetic import CorpusPaths, ensure_corpus, settings_from_config

    corpus = CorpusPaths(ensure_corpus(cfg))
    settings = settings_from_config(cfg)
    per_shard = max(1, math.ceil(settings.videos / SYNTHETIC_SHARDS))
    final = Path(default_cache_dir(cfg)) / f"shards-{shard_digest(settings.digest(), per_shard, 0)}"

    def write(tmp: Path) -> None:
        shards_from_layout(corpus.features_root, corpus.audio_root, corpus.captions, corpus.video_csv,
                           corpus.word_vectors, tmp, seed=0, workers=1, videos_per_shard=per_shard,
                           progress=False, log=lambda msg: None)

    return build_once(final, MANIFEST, write, "shard directory")


def shards_dir_for(cfg) -> Path:
    """The shard directory a run reads: ``data.shards``, or (when it is "") the cached synthetic shards.

    Raises:
        FileNotFoundError: ``data.shards`` holds no manifest (the message names it); the caller
            reads and checks the manifest itself, once.
    """
    if cfg.data.shards:
        directory = Path(cfg.data.shards).expanduser().resolve()
        manifest_path(directory)
        return directory
    return ensure_synthetic_shards(cfg)
