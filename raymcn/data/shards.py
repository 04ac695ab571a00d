"""The shard writer (original feature layout -> tar shards, resumable, parallel) and the manifest.

Why: the original loader did one ``np.load`` per video file, in random order, over millions of files.
Shards turn that into large sequential reads; shuffling happens once when writing (videos are
permuted across shards with a seed) and again when reading (shard order per epoch, a buffer in the
worker). A shard is a POSIX ustar tar of one sample per video (members: ``sample.py``), written
with the standard library's ``tarfile`` in ``USTAR_FORMAT`` with fixed metadata (mtime 0, uid/gid
0, mode 0644, no user names), so the same inputs give the same bytes and the same sha256; ustar
refuses what raymcn's scanner (``tarfmt.py``) does not read (pax records, GNU long names). The
bytes are those of the first, hand-written writer up to its end-of-archive, which ``tarfile``
pads to a whole 10240-byte record (``tests/test_shards.py`` against ``tests/data/shards-v1``).

Output directory::

    shard-000000.tar ...     the shards
    vocab.npy, vocab.txt     (V+1, D) float32 matrix (row 0 = padding), memory-mapped by readers; V words
    manifest.json            per shard: name, videos, their byte spans, bytes, sha256; counts; skipped videos
    plan.json                the video -> shard assignment (deterministic from the seed)
    .done/<shard>.json       one marker per finished shard (what makes a rerun resumable)

Imports: numpy, tqdm, ``config`` (PermanentError), ``features``, ``words``, ``files``, ``sample`` (no Ray,
no torch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import multiprocessing
import os
import shutil
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from raymcn.config import PermanentError
from raymcn.data.features import FeatureFileError, load_captions, read_video, read_video_paths, video_id_of
from raymcn.data.files import write_text_atomic
from raymcn.data.sample import MEMBERS, encode_record, key_problem
from raymcn.data.words import Vocab, build_vocab, load_vocab, read_word2vec_bin, save_vocab, tokenize

FORMAT = "raymcn-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PLAN = "plan.json"
DONE_DIR = ".done"
VOCAB_MARKER = "vocab.json"  # inside DONE_DIR
SHARD_PATTERN = "shard-{:06d}.tar"
DEFAULT_SHARD_SIZE_MB = 256.0
_SIZE_SAMPLE = 32  # videos whose npz headers are read to estimate the mean sample size


class ShardError(ValueError, PermanentError):
    """A problem with the inputs or the output directory of the shard writer (names the file)."""


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


def _write_one_shard(job: tuple[int, str, list[str]]) -> dict:
    """Write one shard (temp name, then rename) and its done marker; returns the marker dict."""
    index, name, paths = job
    w = _WORK
    out: Path = w["out"]
    t0 = time.perf_counter()
    videos, spans, skipped = [], [], []
    final = out / name
    tmp = out / f".{name}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        hf = _HashingFile(f)
        # USTAR_FORMAT: a name that does not fit is an error, never a pax or GNU extension header.
        # Leaving the block on an exception writes no end-of-archive: the temp file stays incomplete.
        with tarfile.open(fileobj=hf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for path in paths:
                vid = video_id_of(path)
                problem = key_problem(vid)
                if problem is not None:
                    skipped.append([vid, problem])
                    continue
                try:
                    rec = read_video(path, w["features"], w["audio"], w["captions"], w["word_to_id"], None,
                                     w["captions_source"])
                except FeatureFileError as e:
                    skipped.append([vid, str(e)])
                    continue
                spans.append(list(write_sample(tar, vid, encode_record(rec))))  # JSON: a list
                videos.append(vid)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    marker = {"name": name, "index": index, "plan": w["plan"], "videos": videos, "spans": spans, "skipped": skipped,
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
    # "spans": each video's byte range in its shard, so a rank reads its videos alone (order.py);
    # markers of an earlier writer have none, and the reader then finds them from the tar headers.
    shards = [{"name": m["name"], "videos": m["videos"], **({"spans": m["spans"]} if "spans" in m else {}),
               "bytes": m["bytes"], "sha256": m["sha256"]} for m in sorted(markers, key=lambda m: m["index"])]
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
            with _progress_bar(len(todo), progress) as bar:
                for job in todo:
                    marker = _write_one_shard(job)
                    done[marker["name"]] = marker
                    bar.update(1)
        else:
            methods = multiprocessing.get_all_start_methods()
            ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
            init_state = state if ctx.get_start_method() == "fork" else \
                {k: v for k, v in state.items() if k not in ("captions", "word_to_id")}
            # the pool forks before the progress bar starts its monitor thread
            with ctx.Pool(min(workers, len(todo)), initializer=_init_worker, initargs=(init_state,)) as pool, \
                    _progress_bar(len(todo), progress) as bar:
                for marker in pool.imap_unordered(_write_one_shard, todo):
                    done[marker["name"]] = marker
                    bar.update(1)
    finally:
        _WORK.clear()
    manifest = _build_manifest(out, plan, list(done.values()), src, settings)
    write_text_atomic(out / MANIFEST, json.dumps(manifest, indent=1))
    c = manifest["counts"]
    log(f"shards: {c['videos']} videos in {c['shards']} shards ({c['bytes'] / 2**20:.1f} MiB), "
        f"{c['skipped']} skipped, {time.perf_counter() - t0:.1f} s -> {out / MANIFEST}")
    return manifest


def _progress_bar(total: int, enabled: bool) -> tqdm:
    return tqdm(total=total, unit="shard", desc="shards", file=sys.stderr, disable=not enabled)


# =====================================================================================================
# Reading the manifest
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

