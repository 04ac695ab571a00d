"""One shard written: its videos read, encoded and appended to a tar, then its done marker.

The same :func:`write_shard` runs in this process, in local worker processes and in Ray actors
(``ray_writers.py``), so every path writes the same bytes and markers. A writer process is given
what its shards need (:func:`init_writer`): the output folder, the feature reader, the caption
store (``captions.py``, memory-mapped: never the whole caption table) and the vocabulary.
"""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import os
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raymcn.data.formats.features import FeatureFileError, video_id_of
from raymcn.data.formats.files import write_text_atomic
from raymcn.data.formats.sample import encode_record, key_problem
from raymcn.data.formats.words import load_vocab
from raymcn.data.write.captions import CaptionStore

DONE_DIR = ".done"


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class WriterState:
    """What every writer of a conversion shares (small, picklable: it travels to Ray actors).

    Attributes:
        out: the output folder; plan: the conversion's plan key (done markers carry it).
        captions: the conversion's caption store (memory-mapped where it is used, ``captions.py``).
        captions_source: the caption pickle's path, for messages; feature_dtype: ``--dtype``.
    """

    out: Path
    plan: str
    captions: CaptionStore
    captions_source: str
    feature_dtype: str


@dataclass(frozen=True)
class ShardJob:
    """One shard to write: its number and name, its videos (video-list rows) and the reader of
    their features (for tar input, an index of only these videos' members)."""

    index: int
    name: str
    paths: tuple[str, ...]
    reader: Any


# This process's writer (init_writer): the shared state and the vocabulary's word -> id.
_WRITER: dict[str, Any] = {}
# Who writes the jobs still to do: called as writers(state, jobs, on_done), on_done(marker) per shard.
ShardWriters = Callable[[WriterState, list[ShardJob], Callable[[dict], None]], None]


def init_writer(state: WriterState) -> None:
    """Make this process a shard writer (before :func:`write_shard`): the vocabulary is read from
    the output folder; captions are read from the store as each video needs them."""
    _WRITER.clear()
    _WRITER.update(state=state, word_to_id=load_vocab(state.out).word_to_id)


def write_here(state: WriterState, jobs: list[ShardJob], on_done: Callable[[dict], None]) -> None:
    """The jobs written one after another in this process."""
    init_writer(state)
    try:
        for job in jobs:
            on_done(write_shard(job))
    finally:
        _WRITER.clear()


class LocalProcesses:
    """The jobs written by ``workers`` processes of this machine, each given the state once."""

    def __init__(self, workers: int):
        self.workers = workers
        self.description = f"{workers} worker process(es)"

    def __call__(self, state: WriterState, jobs: list[ShardJob], on_done: Callable[[dict], None]) -> None:
        if self.workers <= 1 or len(jobs) <= 1:
            write_here(state, jobs, on_done)
            return
        # Not forked from this process: after the caption table was unpickled and dropped, its
        # freed but still mapped heap would be every writer's too (measured, bench/scale.py: a
        # forked writer's PSS grew with the table's size). A fresh server forks the writers.
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        with ctx.Pool(min(self.workers, len(jobs)), initializer=init_writer, initargs=(state,)) as pool:
            for marker in pool.imap_unordered(write_shard, jobs):
                on_done(marker)


class _HashingFile:
    """Write-through file wrapper keeping the sha256 and the byte count of what is written (the
    manifest's per-shard sha256 without reading the shard again). ``tarfile`` needs ``tell``."""

    def __init__(self, f):
        self.f, self.sha, self.bytes = f, hashlib.sha256(), 0

    def write(self, data) -> None:
        self.f.write(data)
        self.sha.update(data)
        self.bytes += len(data)

    def tell(self) -> int:
        return self.bytes


def write_sample(tar: tarfile.TarFile, key: str, members: list[tuple[str, bytes]]) -> tuple[int, int]:
    """Append one sample's members (``sample.encode_record``) as ``<key>.<suffix>`` regular files;
    returns the sample's byte range in the tar (its first header up to the end of its last
    member's data), which the manifest records so a reader can read this video alone.

    TarInfo's defaults are the fixed metadata that make shards reproducible: mtime 0, uid/gid 0,
    mode 0644, no user or group name.
    """
    start = tar.offset
    for suffix, data in members:
        info = tarfile.TarInfo(f"{key}.{suffix}")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return start, tar.offset - (-len(members[-1][1]) % tarfile.BLOCKSIZE)


def write_shard(job: ShardJob) -> dict:
    """Write one shard (temp name, then rename) and its done marker; returns the marker dict."""
    state, word_to_id = _WRITER["state"], _WRITER["word_to_id"]
    t0 = time.perf_counter()
    videos, spans, skipped = [], [], []
    final = state.out / job.name
    tmp = state.out / f".{job.name}.tmp-{os.getpid()}"
    try:
        hf = _write_tar(job, tmp, state, word_to_id, videos, spans, skipped)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. a full disk: the part written goes, the space with it
        raise
    os.replace(tmp, final)
    marker = {"name": job.name, "index": job.index, "plan": state.plan, "videos": videos, "spans": spans,
              "skipped": skipped, "feature_dtype": state.feature_dtype, "bytes": hf.bytes,
              "sha256": hf.sha.hexdigest(), "seconds": round(time.perf_counter() - t0, 3)}
    write_text_atomic(state.out / DONE_DIR / f"{job.name}.json", json.dumps(marker))
    return marker


def _write_tar(job: ShardJob, tmp: Path, state: WriterState, word_to_id, videos: list, spans: list,
               skipped: list) -> _HashingFile:
    """The shard's tar into ``tmp``, flushed to disk; ``videos``, ``spans`` and ``skipped`` get what
    it holds and what it left out. Returns its hashing file (bytes and sha256)."""
    with open(tmp, "wb") as f:
        hf = _HashingFile(f)
        # USTAR_FORMAT: a name that does not fit is an error, never a pax or GNU extension header.
        # Leaving the block on an exception writes no end-of-archive: the temp file is incomplete (and removed).
        with tarfile.open(fileobj=hf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for path in job.paths:
                vid = video_id_of(path)
                problem = key_problem(vid)
                if problem is not None:
                    skipped.append([vid, problem])
                    continue
                try:
                    rec = job.reader.read_video(path, state.captions, word_to_id, None, state.captions_source)
                except FeatureFileError as e:
                    skipped.append([vid, str(e)])
                    continue
                spans.append(list(write_sample(tar, vid, encode_record(rec, state.feature_dtype))))  # JSON: a list
                videos.append(vid)
        f.flush()
        os.fsync(f.fileno())
    return hf


def finished_marker(out: Path, name: str, plan_key: str, verify: str) -> dict | None:
    marker_path = out / DONE_DIR / f"{name}.json"
    try:
        marker = json.loads(marker_path.read_text())
    except (OSError, ValueError):
        return None
    tar = out / name
    if marker.get("plan") != plan_key or not tar.is_file() or tar.stat().st_size != marker.get("bytes"):
        return None
    if verify == "sha256" and file_sha256(tar) != marker.get("sha256"):
        return None
    return marker
