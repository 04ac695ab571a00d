"""The bytes of a shard: tar headers scanned in place, ``.npy`` members viewed without a copy.

This module knows the tar and ``.npy`` formats and nothing about videos: it groups the members of
a tar buffer into samples by the WebDataset convention (consecutive members sharing a key, the name
up to the first dot) and maps ``.npy`` members onto numpy arrays. ``sample.py`` gives the members a
meaning; ``shards.py`` writes the tars (with the standard library's ``tarfile``).

Why a hand-written scanner rather than ``tarfile`` on the read path: ``bench/loader.py`` measured
Python's ``tarfile`` + ``np.load`` at a fraction of this reader's speed (tarfile parses every header
into objects, ``np.load`` copies every array and ``ast``-parses its header). Here a header is
512 bytes sliced from the read buffer, and an array is ``np.frombuffer`` over the buffer itself.

It understands exactly what raymcn's writer produces: POSIX ustar headers, the member name in the
100-byte name field (no prefix, no GNU long names, no pax records, no base-256 sizes), regular files
(type ``0``); other member types are skipped. It tolerates damage: a header whose checksum fails is
skipped and the scan resynchronises at the next valid header; a member running past the end of the
buffer (a truncated shard) ends the scan and marks its sample.

Imports: numpy and the standard library only (no Ray, no torch).
"""

from __future__ import annotations

import ast
import contextlib
import io
import math
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

BLOCK = 512  # tar block: headers and member data are padded to it
ZERO_BLOCK = bytes(BLOCK)
NAME_MAX = 100  # ustar name field; raymcn's names have no "/", so the prefix field cannot help


class NpyError(ValueError):
    """An ``.npy`` member that is not a valid, pickle-free array of the size its header claims."""


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


# =====================================================================================================
# Tar headers
# =====================================================================================================
def _parse_octal(field_: bytes) -> int:
    text = field_.split(b"\0", 1)[0].strip()
    return int(text, 8) if text else 0


def _checksum_ok(hdr: bytes) -> bool:
    try:
        stored = _parse_octal(hdr[148:156])
    except ValueError:
        return False
    return stored == sum(hdr) - sum(hdr[148:156]) + 8 * 32  # the checksum field counts as 8 spaces


def _is_header(buf, pos: int) -> bool:
    hdr = bytes(buf[pos:pos + BLOCK])
    return len(hdr) == BLOCK and hdr[257:262] == b"ustar" and _checksum_ok(hdr)


def _resync(buf, pos: int, end: int, base: int) -> int:
    """The next offset >= pos, block-aligned relative to ``base``, holding a valid ustar header; else ``end``.

    Runs only on damage and at the end of an archive (its zero blocks and record padding); buffers
    without ``find`` (memoryview, numpy) are searched through a bytes copy of the remaining range.
    """
    if hasattr(buf, "find"):
        hay, shift = buf, 0
    else:
        hay, shift = bytes(buf[pos:end]), pos
    i = hay.find(b"ustar", pos - shift + 257, end - shift)
    while i != -1:
        h = i + shift - 257
        if (h - base) % BLOCK == 0 and h + BLOCK <= end and _is_header(buf, h):
            return h
        i = hay.find(b"ustar", i + 1, end - shift)
    return end


def _member_name(hdr: bytes) -> str:
    return hdr[0:100].split(b"\0", 1)[0].decode("utf-8", "replace")


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

    Args:
        buf: bytes, bytearray, memoryview or uint8 array holding the tar (or one sample's region of it).
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
    stop = end
    while pos + BLOCK <= end:
        hdr = bytes(buf[pos:pos + BLOCK])
        if hdr == ZERO_BLOCK:
            pos = _resync(buf, pos + BLOCK, end, base)  # end of archive, or zeroed damage
            continue
        if not _checksum_ok(hdr):
            if damage is not None:
                damage.append(f"damaged tar header at byte {pos}")
            pos = _resync(buf, pos + BLOCK, end, base)
            continue
        try:
            size = _parse_octal(hdr[124:136])
        except ValueError:
            if damage is not None:
                damage.append(f"unreadable size field at byte {pos}")
            pos = _resync(buf, pos + BLOCK, end, base)
            continue
        data = pos + BLOCK
        if data + size > end:  # truncated: this member (and everything after it) is cut off
            stop = pos
            name = _member_name(hdr)
            key, _ = _split_name(name)
            msg = f"member {name} truncated ({end - data} of {size} bytes present)"
            if current is not None and key == current.key:
                current.error = current.error or msg
            elif key is not None:
                if current is not None:
                    spans.append(current)
                current = SampleSpan(key, pos, end, error=msg)
            break
        nxt = data + size + (-size % BLOCK)
        if hdr[156:157] != b"0":  # not a regular file (directories, links ...): not a sample member
            pos = nxt
            continue
        key, suffix = _split_name(_member_name(hdr))
        if key is None:
            pos = nxt
            continue
        if current is None or key != current.key:
            if current is not None:
                spans.append(current)
            current = SampleSpan(key, pos, data + size)
        if suffix in current.members:
            current.error = current.error or f"member {suffix} appears twice"
        current.members[suffix] = (data, size)
        current.end = data + size
        pos = nxt
    if current is not None:
        spans.append(current)
    return spans, stop


# =====================================================================================================
# Reading a tar file in pieces
# =====================================================================================================
def read_pieces(path: str | os.PathLike, chunk_bytes: int,
                damage: list[str]) -> Iterator[tuple[np.ndarray, list[SampleSpan]]]:
    """Read a tar file sequentially in ~chunk_bytes pieces; yields ``(buffer, spans)`` per piece.

    The spans index into that piece's buffer (a fresh uint8 array per piece: decoded arrays may
    keep views into it). Only complete samples are yielded: a sample cut by the piece boundary is
    read again at the start of the next piece, so memory stays at about one piece (or one sample,
    if a sample is larger). Damage (including a truncated file) is described in ``damage``.

    Raises:
        OSError: if the file cannot be opened or read.
    """
    chunk_bytes = max(BLOCK, chunk_bytes - chunk_bytes % BLOCK)  # keeps every piece header-aligned
    with open(path, "rb", buffering=0) as f:
        base = 0
        _advise(f, "SEQUENTIAL")  # larger kernel read-ahead (WILLNEED per piece measured no better)
        # np.empty, not bytearray: no memset, and numpy asks for huge pages on large buffers
        # (page faults otherwise cost more than the read itself).
        buf = np.empty(chunk_bytes, np.uint8)
        got = _fill(f, buf, 0)
        while True:
            eof = got < len(buf)
            spans, stop = scan_spans(buf, 0, got, damage)
            if eof and stop < got:
                damage.append(f"shard truncated at byte {base + got}")
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
                yield buf, spans
            if eof:
                break
            base += hold
            f.seek(base)
            buf = np.empty(chunk_bytes, np.uint8)
            got = _fill(f, buf, 0)


def scan_file_spans(path: str | os.PathLike) -> list[SampleSpan]:
    """The samples of a tar file found by reading its headers only (one 512-byte read per member,
    a seek over each member's data): where each sample's bytes lie, without reading them. Offsets
    are absolute in the file. The scan stops at the end of the archive or at the first damaged
    header; what lies beyond is not found (the reader reports such samples as missing).

    Raises:
        OSError: if the file cannot be opened or read.
    """
    spans: list[SampleSpan] = []
    current: SampleSpan | None = None
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        pos = 0
        while pos + BLOCK <= size:
            f.seek(pos)
            hdr = f.read(BLOCK)
            if len(hdr) < BLOCK or hdr == ZERO_BLOCK or not _checksum_ok(hdr):
                break
            try:
                length = _parse_octal(hdr[124:136])
            except ValueError:
                break
            data = pos + BLOCK
            if data + length > size:
                break
            key, suffix = _split_name(_member_name(hdr)) if hdr[156:157] == b"0" else (None, None)
            if key is not None:
                if current is None or key != current.key:
                    if current is not None:
                        spans.append(current)
                    current = SampleSpan(key, pos, data + length)
                current.members[suffix] = (data, length)
                current.end = data + length
            pos = data + length + (-length % BLOCK)
    if current is not None:
        spans.append(current)
    return spans


def advise_ranges(path: str | os.PathLike, ranges: Iterable[tuple[int, int]]) -> None:
    """Ask the kernel to start reading ``ranges`` of ``path`` into the page cache now, in the
    background (``posix_fadvise(WILLNEED)``), so that a later :func:`read_ranges` of them finds
    them there instead of waiting for the disk. A hint: errors and systems without it are ignored."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        for start, end in ranges:
            if end > start:
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_ranges(path: str | os.PathLike, ranges: list[tuple[int, int]], merge_gap: int = 1 << 16) -> list[np.ndarray]:
    """The bytes of each ``[start, end)`` of ``ranges`` in one file, in the order given.

    The file is opened once and read front to back: ranges are read in offset order, and ranges
    closer than ``merge_gap`` bytes are read with one call (the gap is read and dropped), so
    neighbouring samples cost one read. Each result is a view into its own read buffer; a range
    past the end of the file comes back short.

    Raises:
        OSError: if the file cannot be opened or read.
    """
    out: list[np.ndarray | None] = [None] * len(ranges)
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    with open(path, "rb", buffering=0) as f:
        i = 0
        while i < len(order):
            group = [order[i]]
            lo, hi = ranges[order[i]]
            while i + 1 < len(order) and ranges[order[i + 1]][0] - hi <= merge_gap:
                i += 1
                group.append(order[i])
                hi = max(hi, ranges[order[i]][1])
            f.seek(lo)
            buf = np.empty(max(0, hi - lo), np.uint8)
            got = _fill(f, buf, 0)
            for j in group:
                a, b = ranges[j]
                out[j] = buf[min(a - lo, got):min(b - lo, got)]
            i += 1
    return out  # type: ignore[return-value]


def _advise(f, what: str) -> None:
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        with contextlib.suppress(OSError):
            advise(f.fileno(), 0, 0, getattr(os, f"POSIX_FADV_{what}"))


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


# =====================================================================================================
# .npy members
# =====================================================================================================
def npy_bytes(array: np.ndarray) -> bytes:
    """``np.save`` of ``array`` into bytes (format 1.0: data starts 64-byte aligned in the member)."""
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


# The header np.save writes for plain dtypes; a regex match is ~10x cheaper than ast.literal_eval.
_NPY_RE = re.compile(rb"\{'descr': '([<>|=]?[a-zA-Z]\d*)', 'fortran_order': (True|False), 'shape': \(([\d, ]*)\), \}")
_DTYPES: dict[bytes, np.dtype] = {}


def npy_view(mv: memoryview, what: str = "member") -> np.ndarray:
    """The array of an ``.npy`` member as a zero-copy (read-only if the buffer is) view.

    Args:
        mv: the member's bytes.
        what: the member's name, for error messages.

    Raises:
        NpyError: bad magic, unparsable header, object dtype or a data size that does not match.
    """
    if len(mv) < 10 or bytes(mv[:6]) != b"\x93NUMPY":
        raise NpyError(f"{what}: not an .npy member (bad magic)")
    major = mv[6]
    if major == 1:
        hlen, hstart = int.from_bytes(mv[8:10], "little"), 10
    elif major in (2, 3):
        hlen, hstart = int.from_bytes(mv[8:12], "little"), 12
    else:
        raise NpyError(f"{what}: unsupported .npy version {major}")
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
                raise NpyError(f"{what}: bad dtype {descr!r}") from None
    else:  # unusual but valid headers (structured dtypes ...): the slow, general parser
        try:
            d = ast.literal_eval(header.decode("latin1"))
            dtype, fortran, shape = np.dtype(d["descr"]), bool(d["fortran_order"]), tuple(d["shape"])
        except Exception as e:  # noqa: BLE001 - any failure means a damaged header
            raise NpyError(f"{what}: unreadable .npy header ({type(e).__name__}: {e})") from None
    if dtype.hasobject:
        raise NpyError(f"{what}: object arrays are not allowed")
    count = math.prod(shape)
    offset = hstart + hlen
    if len(mv) - offset != count * dtype.itemsize:
        raise NpyError(f"{what}: {len(mv) - offset} data bytes for shape {shape} {dtype} "
                       f"(expected {count * dtype.itemsize})")
    arr = np.frombuffer(mv, dtype=dtype, count=count, offset=offset)
    return arr.reshape(shape, order="F" if fortran else "C")
