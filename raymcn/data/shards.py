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
from typing import Any, Callable

import numpy as np
from tqdm import tqdm

from raymcn.config import PermanentError
from raymcn.data.features import (FeatureFileError, VideoRecord, load_captions, read_video, read_video_paths,
                                  video_id_of)
from raymcn.data.files import write_text_atomic
from raymcn.data.sample import FEATURE_DTYPES, MEMBERS, encode_record, key_problem
from raymcn.data.tarinput import TarFeatures, tar_files
from raymcn.data.words import Vocab, build_vocab, load_vocab, read_word2vec_bin, save_vocab, tokenize

FORMAT = "raymcn-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PLAN = "plan.json"
DONE_DIR = ".done"
VOCAB_MARKER = "vocab.json"  # inside DONE_DIR
SHARD_PATTERN = "shard-{:06d}.tar"
DEFAULT_SHARD_SIZE_MB = 256.0
# The 2d/3d features' dtype in the shards (``--dtype``). float16: the shards of HowTo100M-sized videos
# take 0.64x the bytes (the spectrogram is fp16 already), and learning did not change measurably
# (bench/shard_dtype.py: fp32 vs fp16 shards of full-precision features, 4 seeds, paired: R@10
# +0.8 points [-0.4, 1.9], loss -0.002 [-0.08, 0.08]); fp16 keeps 11 significant bits, and the
# features are max-pooled and L2-normalised in fp32 afterwards.
DEFAULT_FEATURE_DTYPE = "float16"
_SIZE_SAMPLE = 32  # videos whose npz headers are read to estimate the mean sample size


class ShardError(ValueError, PermanentError):
    """A problem with the inputs or the output directory of the shard writer (names the file)."""


# =====================================================================================================
# The writer
# =====================================================================================================
@dataclass(frozen=True)
class LayoutSources:
    """Where the original layout lives (the arguments of ``raymcn shards``): the feature folders,
    or ``tars`` holding the same files (``tarinput.py``; then ``features`` and ``audio_features``
    are unused, and without a video list the tars' videos are taken in their order)."""

    features: Path
    audio_features: Path
    captions: Path
    video_list: Path | None
    word_vectors: Path
    tars: tuple[Path, ...] = ()


class FolderFeatures:
    """The original per-video files under two roots (the reader :class:`tarinput.TarFeatures` mirrors)."""

    def __init__(self, src: LayoutSources):
        self.features, self.audio = src.features, src.audio_features

    def _files(self, path: str) -> tuple[Path, Path, Path]:
        vid = video_id_of(path)
        return (self.features / path / f"{vid}_2d.npz", self.features / path / f"{vid}_3d.npz",
                self.audio / path / f"{vid}_spec.npz")

    def complete(self, path: str) -> bool:
        return all(f.is_file() for f in self._files(path))

    def array_sizes(self, path: str) -> dict[str, int] | None:
        sizes = {}
        try:
            for kind, f in zip(("2d", "3d", "spec"), self._files(path)):
                with zipfile.ZipFile(f) as z:
                    sizes[kind] = sum(info.file_size for info in z.infolist())
        except (OSError, zipfile.BadZipFile):
            return None
        return sizes

    def read_video(self, path: str, captions, word_to_id, max_words=None, caption_source="<captions>") -> VideoRecord:
        return read_video(path, self.features, self.audio, captions, word_to_id, max_words, caption_source)


def open_features(src: LayoutSources, progress: bool = True) -> FolderFeatures | TarFeatures:
    """The reader of ``src``'s features (the tars are indexed here, once)."""
    return TarFeatures.scan(src.tars, progress) if src.tars else FolderFeatures(src)


def _video_paths(src: LayoutSources, feats) -> list[str]:
    """The video-list rows, or without a list (tar input) the tars' complete videos in their order."""
    if src.video_list is not None:
        return read_video_paths(src.video_list)
    return feats.video_ids()


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
    named = [("--captions", src.captions, False), ("--word-vectors", src.word_vectors, False)]
    named += [("--tars", t, False) for t in src.tars] if src.tars else [
        ("--features", src.features, True), ("--audio-features", src.audio_features, True)]
    if src.video_list is not None:
        named.append(("--video-list", src.video_list, False))
    elif not src.tars:
        problems.append("--video-list is needed with --features (only --tars can do without one)")
    for label, p, want_dir in named:
        if want_dir and not p.is_dir():
            problems.append(f"{label} {p}: no such directory")
        elif not want_dir and not p.is_file():
            problems.append(f"{label} {p}: no such file")
    if problems:
        raise ShardError("; ".join(problems))


def _estimate_sample_bytes(paths: Sequence[str], feats, rng: np.random.Generator,
                           feature_dtype: str = "float32") -> float:
    """Mean sample size from the array sizes of a few videos (npz directories, no array decoded),
    for the shard size target; the 2d/3d ones scaled to ``feature_dtype`` (the original files hold fp32)."""
    scale = FEATURE_DTYPES[feature_dtype].itemsize / 4
    sizes = []
    for i in rng.permutation(len(paths))[:_SIZE_SAMPLE]:
        arrays = feats.array_sizes(paths[int(i)])
        if arrays is not None:
            sizes.append(scale * (arrays["2d"] + arrays["3d"]) + arrays["spec"] + 8 * 1024)  # + captions, headers
    return float(np.mean(sizes)) if sizes else float(1 << 20)


class _EveryWord(dict):
    """A vocabulary that knows every word (id 1): a sample's token bytes as if no word were dropped,
    an upper bound, before the vocabulary exists."""

    def get(self, key, default=None):
        return 1

    def __contains__(self, key) -> bool:
        return True

    def __getitem__(self, key):
        return 1


def _tar_bytes(members: list[tuple[str, bytes]]) -> int:
    """Bytes a sample takes in a tar: a 512-byte header per member, data padded to 512."""
    return sum(tarfile.BLOCKSIZE + -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE for _, data in members)


def sample_bytes(paths: Sequence[str], feats, captions, rng: np.random.Generator,
                 count: int = _SIZE_SAMPLE) -> dict[str, float]:
    """Mean bytes of a shard sample per feature dtype, from up to ``count`` random videos of
    ``paths`` encoded as the writer encodes them (their features are read; every caption word is
    counted as kept, an upper bound of a few bytes per word). Empty when no sampled video reads."""
    sizes: dict[str, list[int]] = {d: [] for d in FEATURE_DTYPES}
    for i in rng.permutation(len(paths))[:count]:
        try:
            rec = feats.read_video(paths[int(i)], captions, _EveryWord())
        except FeatureFileError:
            continue
        for dtype in FEATURE_DTYPES:
            sizes[dtype].append(_tar_bytes(encode_record(rec, dtype)))
    return {d: float(np.mean(v)) for d, v in sizes.items() if v}


def _free_bytes(out: Path) -> int:
    """Free bytes of the filesystem that ``out`` is (or will be) on (its nearest existing folder's)."""
    where = out.resolve()
    while not where.exists():
        where = where.parent
    return shutil.disk_usage(where).free


@dataclass(frozen=True)
class SpacePlan:
    """What a conversion will write and whether it fits (``raymcn shards --dry-run``)."""

    listed: int  # distinct videos in the video list
    found: int  # of them, those whose 2d, 3d and spectrogram files all exist
    missing: tuple[str, ...]  # the first few video ids with a file missing
    per_video: dict[str, float]  # feature dtype -> mean bytes of one shard sample
    out: Path
    free: int  # bytes free where the shards go

    def total(self, dtype: str) -> int:
        return int(self.found * self.per_video[dtype])

    def fits(self, dtype: str) -> bool:
        return self.total(dtype) <= self.free

    def refusal(self, dtype: str) -> str:
        return space_refusal(self.total(dtype), self.free, self.out, dtype,
                             self.total("float16") if dtype != "float16" and self.fits("float16") else None)

    def report(self, dtype: str) -> str:
        lines = [f"{self.found} videos found of {self.listed} listed"
                 + (f" (missing files, e.g. {', '.join(self.missing)})" if self.found < self.listed else ""),
                 f"{'--dtype':<9}{'shards MiB':>12}{'MiB per video':>15}   (estimated by encoding up to "
                 f"{_SIZE_SAMPLE} videos)"]
        lines += [f"{d:<9}{self.total(d) / 2**20:>12.1f}{self.per_video[d] / 2**20:>15.2f}" for d in self.per_video]
        lines.append(f"free at {self.out}: {_gb(self.free)}")
        lines.append(f"--dtype {dtype} fits ({100 * self.total(dtype) / max(1, self.free):.0f} % of the free space)"
                     if self.fits(dtype) else f"--dtype {dtype} does not fit: short by "
                     f"{_gb(self.total(dtype) - self.free)}")
        return "\n".join(lines)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if abs(n) >= 1e8 else f"{n / 1e6:.1f} MB"


def space_refusal(needed: int, free: int, out: Path, dtype: str, half: int | None = None) -> str:
    """The message of a conversion that does not fit (``half``: what float16 would take, if it fits)."""
    return (f"the shards do not fit: --dtype {dtype} needs ~{_gb(needed)} at {out}, {_gb(free)} are free: "
            f"short by {_gb(needed - free)}" + (f" (--dtype float16 would take ~{_gb(half)})" if half else ""))


def plan_space(src: LayoutSources, out: str | os.PathLike, *, seed: int = 0, progress: bool = True) -> SpacePlan:
    """Count the videos of a layout whose files exist, estimate the shards' bytes per dtype, and
    read the free space at ``out``; nothing is written.

    Raises:
        ShardError / FeatureFileError: a missing input or an unreadable video list / caption pickle.
    """
    _check_inputs(src)
    feats = open_features(src, progress)
    paths = list(dict.fromkeys(_video_paths(src, feats)))
    found, missing = [], []
    for path in tqdm(paths, unit="video", desc="checking files", file=sys.stderr, disable=not progress):
        (found if feats.complete(path) else missing).append(path)
    caps = load_captions(src.captions)
    per_video = sample_bytes(found, feats, caps, np.random.default_rng([seed, 0x5EED]))
    if not per_video:
        raise ShardError(f"{src.video_list or 'the tars'}: none of the sampled videos could be read")
    free = _free_bytes(Path(out))
    return SpacePlan(len(paths), len(found), tuple(video_id_of(p) for p in missing[:3]), per_video, Path(out), free)


def _plan_key(src: LayoutSources, list_sha: str, seed: int, shard_size_mb: float,
              videos_per_shard: int | None, feature_dtype: str = "float32") -> str:
    ident = {"format": FORMAT, "version": FORMAT_VERSION, "seed": seed, "shard_size_mb": shard_size_mb,
             "videos_per_shard": videos_per_shard, "video_list_sha256": list_sha,
             **({"tars": [[str(t.resolve()), t.stat().st_size] for t in src.tars]} if src.tars else
                {"features": str(src.features.resolve()), "audio_features": str(src.audio_features.resolve())}),
             "captions": [str(src.captions.resolve()), src.captions.stat().st_size],
             "word_vectors": [str(src.word_vectors.resolve()), src.word_vectors.stat().st_size]}
    if feature_dtype != "float32":  # fp32 folders written before the setting existed keep their key
        ident["feature_dtype"] = feature_dtype
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def _make_plan(paths: list[str], src: LayoutSources, feats, seed: int, shard_size_mb: float,
               videos_per_shard: int | None, key: str, feature_dtype: str = "float32") -> dict:
    """Videos permuted with ``seed`` and cut into shards of ~shard_size_mb (or videos_per_shard)."""
    kept, seen, duplicates = [], set(), []
    for p in paths:
        vid = video_id_of(p)
        if vid in seen:
            duplicates.append([vid, f"listed more than once in {src.video_list or 'the tars'}; kept the first entry"])
            continue
        seen.add(vid)
        kept.append(p)
    rng = np.random.default_rng([seed, 0x5EED])
    order = rng.permutation(len(kept))
    if videos_per_shard is None:
        mean = _estimate_sample_bytes(kept, feats, rng, feature_dtype)
        videos_per_shard = max(1, int(round(shard_size_mb * (1 << 20) / mean)))
    shuffled = [kept[int(i)] for i in order]
    shards = [shuffled[i:i + videos_per_shard] for i in range(0, len(shuffled), videos_per_shard)]
    return {"plan": key, "seed": seed, "shard_size_mb": shard_size_mb, "videos_per_shard": videos_per_shard,
            "listed": len(paths), "duplicates": duplicates,
            "shards": [{"name": SHARD_PATTERN.format(i), "paths": chunk} for i, chunk in enumerate(shards)]}


# Worker state (set in the parent before forking, or by the initializer under "spawn" and in a
# Ray actor).
_WORK: dict[str, Any] = {}
# A writer of shards elsewhere (``shards_from_layout``'s ``writer``): (state, jobs, on_done) -> None.
ShardWriters = Callable[[dict, list, Callable[[dict], None]], None]


def init_writer(state: dict) -> None:
    """Make this process a shard writer (before :func:`write_shard`)."""
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


def write_shard(job: tuple[int, str, list[str]]) -> dict:
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
                    rec = w["reader"].read_video(path, w["captions"], w["word_to_id"], None,
                                     w["captions_source"])
                except FeatureFileError as e:
                    skipped.append([vid, str(e)])
                    continue
                spans.append(list(write_sample(tar, vid, encode_record(rec, w["feature_dtype"]))))  # JSON: a list
                videos.append(vid)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    marker = {"name": name, "index": index, "plan": w["plan"], "videos": videos, "spans": spans, "skipped": skipped,
              "feature_dtype": w["feature_dtype"], "bytes": hf.bytes, "sha256": hf.sha.hexdigest(),
              "seconds": round(time.perf_counter() - t0, 3)}
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


def _sources_record(src: LayoutSources) -> dict:
    """The manifest's record of where the videos came from (the folders, or the tars)."""
    where = {"tars": [str(t) for t in src.tars]} if src.tars else {
        "features": str(src.features), "audio_features": str(src.audio_features)}
    return {**where, "captions": str(src.captions), "video_list": str(src.video_list) if src.video_list else None,
            "word_vectors": str(src.word_vectors)}


def _build_manifest(out: Path, plan: dict, markers: list[dict], src: LayoutSources, settings: dict) -> dict:
    vocab_meta = json.loads((out / DONE_DIR / VOCAB_MARKER).read_text())
    # "spans": each video's byte range in its shard, so a rank reads its videos alone (order.py);
    # markers of an earlier writer have none, and the reader then finds them from the tar headers.
    shards = [{"name": m["name"], "videos": m["videos"], **({"spans": m["spans"]} if "spans" in m else {}),
               "feature_dtype": m.get("feature_dtype", "float32"), "bytes": m["bytes"], "sha256": m["sha256"]}
              for m in sorted(markers, key=lambda m: m["index"])]
    skipped = [{"video": v, "reason": r, "shard": None} for v, r in plan["duplicates"]]
    for m in sorted(markers, key=lambda m: m["index"]):
        skipped.extend({"video": v, "reason": r, "shard": m["name"]} for v, r in m["skipped"])
    n_videos = sum(len(s["videos"]) for s in shards)
    return {
        "format": FORMAT, "version": FORMAT_VERSION, "plan": plan["plan"],
        "settings": {**settings, "videos_per_shard": plan["videos_per_shard"], "members": list(MEMBERS)},
        "sources": _sources_record(src),
        "counts": {"listed": plan["listed"], "videos": n_videos, "skipped": len(skipped), "shards": len(shards),
                   "bytes": sum(s["bytes"] for s in shards), "vocab_words": vocab_meta["words"],
                   "word_dim": vocab_meta["dim"]},
        "vocab": {"matrix": "vocab.npy", "words": "vocab.txt", "sha256": vocab_meta["sha256"]},
        "shards": shards,
        "skipped": skipped,
    }


def layout_sources(features, audio_features, captions, video_list, word_vectors, tars=()) -> LayoutSources:
    """:class:`LayoutSources` of the command's arguments (``tars``: files or folders of ``*.tar``)."""
    return LayoutSources(Path(features or ""), Path(audio_features or ""), Path(captions),
                         Path(video_list) if video_list else None, Path(word_vectors), tuple(tar_files(tars)))


def shards_from_layout(features: str | os.PathLike | None, audio_features: str | os.PathLike | None,
                       captions: str | os.PathLike, video_list: str | os.PathLike | None,
                       word_vectors: str | os.PathLike, out: str | os.PathLike, *,
                       shard_size_mb: float = DEFAULT_SHARD_SIZE_MB, seed: int = 0, workers: int = 1,
                       videos_per_shard: int | None = None, verify: str = "sha256",
                       feature_dtype: str = DEFAULT_FEATURE_DTYPE, tars: Sequence[str | os.PathLike] = (),
                       progress: bool = True, log=None, writer: ShardWriters | None = None) -> dict:
    """Write the videos of the original layout into shuffled tar shards in ``out``; returns the manifest.

    Resumable: a shard whose done marker matches the plan (and, with ``verify="sha256"``, whose
    bytes still hash to the recorded sha256) is not rewritten; when every shard is complete and the
    manifest is current, nothing is written at all.

    Args:
        features, audio_features: roots of the 2d/3d and spectrogram npz files (None with ``tars``).
        captions: the caption pickle; video_list: the CSV with header ``path`` (optional with
            ``tars``: without it, the tars' complete videos in their order);
        word_vectors: a binary word2vec file (GoogleNews or the synthetic one).
        shard_size_mb: target shard size (from the mean size of a few videos' npz contents).
        seed: permutation of the videos across shards (same seed, same assignment).
        workers: processes writing shards in parallel (0 or 1 = in this process).
        videos_per_shard: fixed number of videos per shard instead of the size target.
        verify: "sha256" (rehash finished shards on a rerun) or "size" (trust marker + size).
        feature_dtype: storage of the 2d/3d features, "float32" or "float16" (half the bytes;
            each value rounded to the nearest fp16; the manifest records it).
        tars: tar files (or folders of them) holding the per-video files instead of the folders
            (``tarinput.py`` lists the accepted member names); the same videos give the same shards.
        log: callable for progress lines (default: print to stderr).
        writer: who writes the shards still to do, instead of this machine's ``workers`` processes:
            called as ``writer(state, jobs, on_done)`` with the writer state (without the
            caption table, which each writer loads from ``state["captions_path"]``), the jobs, and
            a callback for each shard's done marker (``data.ray_shards``: Ray actors on every
            node of a cluster). Same plan, same bytes, same markers, same manifest.

    Raises:
        ShardError: a missing input, or ``out`` holding shards of a different plan.
        FeatureFileError: unreadable video list or caption pickle (the message names the file).
    """
    if verify not in ("sha256", "size"):
        raise ValueError(f"verify={verify!r}: allowed values are sha256, size")
    if feature_dtype not in FEATURE_DTYPES:
        raise ShardError(f"--dtype {feature_dtype}: allowed values are {', '.join(FEATURE_DTYPES)}")
    if shard_size_mb <= 0 or (videos_per_shard is not None and videos_per_shard < 1):
        raise ShardError("shard size must be positive (--shard-size-mb > 0, videos per shard >= 1)")
    log = log or (lambda msg: print(msg, file=sys.stderr))
    src = layout_sources(features, audio_features, captions, video_list, word_vectors, tars)
    _check_inputs(src)
    feats = open_features(src, progress)
    out = Path(out)
    list_bytes = src.video_list.read_bytes() if src.video_list else "\n".join(feats.video_ids()).encode()
    key = _plan_key(src, hashlib.sha256(list_bytes).hexdigest(), seed, shard_size_mb, videos_per_shard, feature_dtype)
    plan_path = out / PLAN
    new_plan = not plan_path.exists()
    if not new_plan:
        plan = _read_json(plan_path)
        if plan.get("plan") != key:
            raise ShardError(f"{plan_path}: {out} already holds shards written from other inputs or settings "
                             f"(plan {plan.get('plan')}, now {key}); use a new --out directory or delete it")
    else:
        paths = _video_paths(src, feats)
        if not paths:
            raise ShardError(f"{f'--video-list {src.video_list}' if src.video_list else '--tars'}: lists no videos")
        plan = _make_plan(paths, src, feats, seed, shard_size_mb, videos_per_shard, key, feature_dtype)

    settings = {"seed": seed, "shard_size_mb": shard_size_mb, "feature_dtype": feature_dtype}
    jobs = [(i, s["name"], s["paths"]) for i, s in enumerate(plan["shards"])]
    done: dict[str, dict] = {}
    todo = []
    for job in jobs:
        marker = _shard_is_done(out, job[1], key, verify) if not new_plan else None
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

    caps = load_captions(src.captions)
    # Before anything is written: the shards still to write must fit where they go.
    left = [p for _, _, paths in todo for p in paths]
    per_video = sample_bytes(left, feats, caps, np.random.default_rng([seed, 0x5EED]))
    free = _free_bytes(out)
    if feature_dtype in per_video and len(left) * per_video[feature_dtype] > free:
        half = len(left) * per_video.get("float16", 0)
        raise ShardError(space_refusal(int(len(left) * per_video[feature_dtype]), free, out, feature_dtype,
                                       int(half) if feature_dtype != "float16" and half <= free else None))
    out.mkdir(parents=True, exist_ok=True)
    (out / DONE_DIR).mkdir(exist_ok=True)
    if new_plan:
        write_text_atomic(plan_path, json.dumps(plan))

    t0 = time.perf_counter()
    vocab = _ensure_vocab(out, plan, src, caps)
    log(f"shards: {len(todo)} of {len(jobs)} shards to write ({plan['videos_per_shard']} videos each, "
        f"vocabulary of {len(vocab.words)} words), "
        + (getattr(writer, "description", "other writers") if writer else f"{max(1, workers)} worker(s)"))
    state = {"out": out, "reader": feats, "captions": caps,
             "word_to_id": vocab.word_to_id, "captions_source": str(src.captions), "plan": key,
             "captions_path": src.captions, "feature_dtype": feature_dtype}
    shipped = {k: v for k, v in state.items() if k not in ("captions", "word_to_id")}  # reloaded where it runs
    try:
        if writer is not None:
            with _progress_bar(len(todo), progress) as bar:
                def finished(marker: dict) -> None:
                    done[marker["name"]] = marker
                    bar.update(1)

                writer(shipped, todo, finished)
        elif workers <= 1 or len(todo) <= 1:
            init_writer(state)
            with _progress_bar(len(todo), progress) as bar:
                for job in todo:
                    marker = write_shard(job)
                    done[marker["name"]] = marker
                    bar.update(1)
        else:
            methods = multiprocessing.get_all_start_methods()
            ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
            init_state = state if ctx.get_start_method() == "fork" else shipped
            # the pool forks before the progress bar starts its monitor thread
            with ctx.Pool(min(workers, len(todo)), initializer=init_writer, initargs=(init_state,)) as pool, \
                    _progress_bar(len(todo), progress) as bar:
                for marker in pool.imap_unordered(write_shard, todo):
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



def feature_dtype(manifest: dict, where: str | os.PathLike) -> str:
    """The one dtype of the 2d/3d features in every shard of ``manifest`` (of the folder ``where``).

    Shards written before the dtype was recorded are float32. Raises ShardError naming the shards
    of each dtype when they differ (e.g. shards copied in from a folder written with another
    ``--dtype``): one run reads one dtype, and a mixed folder would train on two precisions.
    """
    by_dtype: dict[str, list[str]] = {}
    for shard in manifest["shards"]:
        by_dtype.setdefault(shard.get("feature_dtype", "float32"), []).append(shard["name"])
    unknown = sorted(set(by_dtype) - set(FEATURE_DTYPES))
    if unknown:
        raise ShardError(f"{Path(where) / MANIFEST}: feature dtype {', '.join(unknown)} of shard(s) "
                         f"{', '.join(n for d in unknown for n in by_dtype[d])} is not one of {', '.join(FEATURE_DTYPES)}")
    if len(by_dtype) > 1:
        listing = "; ".join(f"{d}: {', '.join(names)}" for d, names in sorted(by_dtype.items()))
        raise ShardError(f"{Path(where) / MANIFEST}: mixed feature dtypes in one shard folder ({listing}); "
                         "rewrite the folder with one `raymcn shards --dtype`")
    return next(iter(by_dtype))
