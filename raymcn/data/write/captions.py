"""The caption store: the captions of the videos being converted, read once, memory-mapped by every writer.

The lab's ``caption.pickle`` covers all of HowTo100M (about 136 M ASR segments of 1.17 M videos):
unpickled, it takes about 2.3 bytes of memory per byte of pickle (``bench/scale.py``), some 21 GB.
A pickle can only be loaded whole, so the conversion loads it once, in the driver, and writes the
captions of the listed videos here; every writer (a local process or a Ray actor on any node) then
maps these files and touches only its shards' videos, so a writer's memory does not grow with the
corpus, and the pages are shared by the writers of a node through the page cache.

Folder ``<out>/.captions/`` (removed when the conversion completes)::

    ids.bin        (V,) video ids, sorted, fixed-width bytes (``S<width>``)
    rows.bin       (V+1,) int64: video i's captions are rows[i]:rows[i+1]
    start.bin      (C,) float64 caption starts, seconds;  end.bin: (C,) float64 ends
    text_end.bin   (C,) int64: caption j's UTF-8 text is text.bin[text_end[j-1]:text_end[j]]
    text.bin       the texts
    problems.json  video id -> why its entry cannot be used (no entry, unequal lengths): the
                   writer skips it with this reason, as it would with the pickle
    store.json     the pickle it came from (path, size, mtime) and the counts; written last

A store is reused by a rerun when ``store.json`` matches the pickle's size and modification time;
otherwise the conversion stops and names the pickle (``CaptionsChanged``): shards already written
hold the earlier captions. The values are those the pickle gives (``features.caption_fields``,
the same checks and messages), so the shards' bytes do not depend on which one a writer read.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raymcn.data.formats.features import FeatureFileError, caption_fields
from raymcn.data.formats.files import write_text_atomic
from raymcn.data.formats.manifest import ShardError

STORE_DIR = ".captions"
STORE_FILE = "store.json"
# Memory to unpickle a caption table, per byte of the pickle file: 2.32 at both 1/40 and 1/20 of
# HowTo100M's count (bench/scale.py, HowTo100M-like tables: 117 segments of 5-11 words per video),
# rounded up so that a refusal errs on the safe side: about 22.6 GB for HowTo100M's 9 GB pickle.
UNPICKLE_BYTES_PER_FILE_BYTE = 2.5


class CaptionsChanged(ShardError):
    """The caption pickle differs from the one a conversion's caption store was built from."""


def pickle_identity(path: Path) -> dict:
    """What identifies a caption pickle for the store: its absolute path, size and modification time."""
    st = path.stat()
    return {"source": str(path.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def unpickle_bytes(path: Path) -> int:
    """Memory the driver needs to load the caption pickle at ``path`` whole (an estimate, module doc)."""
    return int(path.stat().st_size * UNPICKLE_BYTES_PER_FILE_BYTE)


def available_memory() -> int:
    """Bytes this machine can still give a process (``MemAvailable``; total RAM where that is unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_refusal(path: Path, needed: int, available: int) -> str:
    return (f"--captions {path}: loading the caption table once takes ~{needed / 1e9:.1f} GB "
            f"({UNPICKLE_BYTES_PER_FILE_BYTE:g}x its {path.stat().st_size / 1e9:.2f} GB on disk), and this "
            f"machine has {available / 1e9:.1f} GB available: run the conversion on a machine with more memory "
            "(once written, the caption store lets any machine resume it)")


def store_dir(out: Path) -> Path:
    return Path(out) / STORE_DIR


def existing_store(out: Path, pickle: Path) -> CaptionStore | None:
    """The complete caption store in ``out`` built from ``pickle``, or None when there is none.

    Raises:
        CaptionsChanged: the store was built from a pickle of another size or modification time.
    """
    meta_path = store_dir(out) / STORE_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None
    now = pickle_identity(pickle)
    if (meta.get("bytes"), meta.get("mtime_ns")) != (now["bytes"], now["mtime_ns"]):
        raise CaptionsChanged(
            f"--captions {pickle}: changed since this conversion began in {out} (then {meta.get('bytes')} bytes, "
            f"modified at {meta.get('mtime_ns')} ns; now {now['bytes']} bytes at {now['mtime_ns']} ns): the shards "
            "written so far hold the earlier captions; use a new --out, or restore the earlier pickle")
    return CaptionStore(store_dir(out))


def build_store(out: Path, pickle: Path, captions, video_ids: Iterable[str], source: str) -> CaptionStore:
    """Write the captions of ``video_ids`` (read from ``captions``, the unpickled table) into
    ``out/.captions`` and return the store. Streams one video at a time: beyond the table itself
    it holds one video's captions and (V+1) row offsets."""
    ids = sorted(set(video_ids))
    root = store_dir(out)
    shutil.rmtree(root, ignore_errors=True)  # an incomplete store of an interrupted build
    root.mkdir(parents=True)
    width = max((len(v.encode()) for v in ids), default=1)
    rows = np.zeros(len(ids) + 1, np.int64)
    problems: dict[str, str] = {}
    text_bytes = 0
    with open(root / "start.bin", "wb") as starts_f, open(root / "end.bin", "wb") as ends_f, \
            open(root / "text_end.bin", "wb") as text_end_f, open(root / "text.bin", "wb") as text_f:
        for i, vid in enumerate(ids):
            try:
                starts, ends, texts = caption_fields(vid, captions, source)
            except FeatureFileError as e:
                problems[vid] = str(e)
                starts, ends, texts = np.zeros(0), np.zeros(0), []
            encoded = [t.encode() for t in texts]
            starts_f.write(starts.tobytes())
            ends_f.write(ends.tobytes())
            lengths = np.fromiter((len(b) for b in encoded), np.int64, len(encoded))
            text_end_f.write((text_bytes + np.cumsum(lengths)).tobytes())
            text_f.write(b"".join(encoded))
            text_bytes += int(lengths.sum())
            rows[i + 1] = rows[i] + len(starts)
    np.asarray(ids, dtype=f"S{width}").tofile(root / "ids.bin")
    rows.tofile(root / "rows.bin")
    write_text_atomic(root / "problems.json", json.dumps(problems))
    meta = {**pickle_identity(pickle), "videos": len(ids), "captions": int(rows[-1]), "id_width": width,
            "text_bytes": text_bytes, "problem_videos": len(problems), "caption_source": source}
    write_text_atomic(root / STORE_FILE, json.dumps(meta))
    return CaptionStore(root)


def remove_store(out: Path) -> None:
    """Drop the store once every shard is written (a finished conversion reruns without captions)."""
    shutil.rmtree(store_dir(out), ignore_errors=True)


@dataclass
class _Maps:
    ids: np.ndarray
    rows: np.ndarray
    start: np.ndarray
    end: np.ndarray
    text_end: np.ndarray
    text: np.ndarray
    problems: dict[str, str]


class CaptionStore:
    """The captions of a conversion's videos, memory-mapped (module doc). Pickles as its folder's
    path: a writer process opens the maps itself, on first use."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._maps: _Maps | None = None

    def __getstate__(self) -> dict:
        return {"root": self.root}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["root"])

    def _open(self) -> _Maps:
        if self._maps is None:
            meta = json.loads((self.root / STORE_FILE).read_text())

            def load(name: str, dtype) -> np.ndarray:
                path = self.root / name
                return np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)

            self._maps = _Maps(load("ids.bin", f"S{meta['id_width']}"), load("rows.bin", np.int64),
                               load("start.bin", np.float64), load("end.bin", np.float64),
                               load("text_end.bin", np.int64), load("text.bin", np.uint8),
                               json.loads((self.root / "problems.json").read_text()))
        return self._maps

    def __len__(self) -> int:
        return len(self._open().ids)

    def fields(self, video_id: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """What ``features.caption_fields`` gave for ``video_id`` when the store was built.

        Raises:
            FeatureFileError: the pickle's entry was unusable (its message), or the video was not
                one of the store's (then the conversion asked for a video it did not list).
        """
        m = self._open()
        if video_id in m.problems:
            raise FeatureFileError(m.problems[video_id])
        key = video_id.encode()
        i = int(np.searchsorted(m.ids, key))
        if i >= len(m.ids) or m.ids[i] != key:
            raise FeatureFileError(f"caption store {self.root}: no entry for video {video_id} (not listed when "
                                   "the store was built)")
        a, b = int(m.rows[i]), int(m.rows[i + 1])
        ends = m.text_end[a:b]
        first = int(m.text_end[a - 1]) if a > 0 else 0
        cuts = np.concatenate(([first], ends)) - first
        blob = m.text[first:int(ends[-1])].tobytes() if b > a else b""
        texts = [blob[cuts[j]:cuts[j + 1]].decode() for j in range(b - a)]
        return np.array(m.start[a:b]), np.array(m.end[a:b]), texts
