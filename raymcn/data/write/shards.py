"""The conversion: the original feature layout -> tar shards, resumable, in parallel, and its manifest.

Why: the original loader did one ``np.load`` per video file, in random order, over millions of files.
Shards turn that into large sequential reads; shuffling happens once when writing (videos are
permuted across shards with a seed) and again when reading (shard order per epoch, a buffer in the
worker). A shard is a POSIX ustar tar of one sample per video (members: ``formats/sample.py``), written
with the standard library's ``tarfile`` in ``USTAR_FORMAT`` with fixed metadata (mtime 0, uid/gid
0, mode 0644, no user names), so the same inputs give the same bytes and the same sha256; ustar
refuses what raymcn's scanner (``formats/tarfmt.py``) does not read (pax records, GNU long names). The
bytes are those of the first, hand-written writer up to its end-of-archive, which ``tarfile``
pads to a whole 10240-byte record (``tests/test_shards.py`` against ``tests/data/shards-v1``).

Output directory::

    shard-000000.tar ...     the shards
    vocab.npy, vocab.txt     (V+1, D) float32 matrix (row 0 = padding), memory-mapped by readers; V words
    manifest.json            per shard: name, videos, their byte spans, bytes, sha256; counts; skipped videos
    plan.json                the video -> shard assignment (deterministic from the seed)
    .done/<shard>.json       one marker per finished shard (what makes a rerun resumable)
    .captions/               the caption store of the listed videos (``captions.py``), while unfinished

Imports: numpy, tqdm, ``config`` (PermanentError), ``features``, ``words``, ``files``, ``sample`` (no Ray,
no torch).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from raymcn.data.formats.features import load_captions, video_id_of
from raymcn.data.formats.files import write_text_atomic
from raymcn.data.formats.manifest import FORMAT, FORMAT_VERSION, MANIFEST, ShardError, read_json
from raymcn.data.formats.sample import FEATURE_DTYPES, MEMBERS
from raymcn.data.formats.words import Vocab
from raymcn.data.write import captions as caption_store
from raymcn.data.write.disk_space import free_bytes, sample_bytes, space_refusal
from raymcn.data.write.shard_plan import PLAN, make_shard_plan, plan_key
from raymcn.data.write.sources import LayoutSources, check_inputs, layout_sources, open_features, video_paths
from raymcn.data.write.vocab import VOCAB_MARKER, build_vocab_files, existing_vocab
from raymcn.data.write.writer import DONE_DIR, LocalProcesses, ShardJob, ShardWriters, WriterState, finished_marker

DEFAULT_SHARD_SIZE_MB = 256.0
# The 2d/3d features' dtype in the shards (``--dtype``). float16: the shards of HowTo100M-sized videos
# take 0.64x the bytes (the spectrogram is fp16 already), and learning did not change measurably
# (bench/shard_dtype.py: fp32 vs fp16 shards of full-precision features, 4 seeds, paired: R@10
# +0.8 points [-0.4, 1.9], loss -0.002 [-0.08, 0.08]); fp16 keeps 11 significant bits, and the
# features are max-pooled and L2-normalised in fp32 afterwards.
DEFAULT_FEATURE_DTYPE = "float16"


@dataclass(frozen=True)
class ConversionSettings:
    """How ``raymcn shards`` cuts and stores the videos (all part of the plan's key but ``verify``).

    Attributes:
        shard_size_mb: target shard size (from the mean size of a few videos' npz contents).
        seed: permutation of the videos across shards (same seed, same assignment).
        videos_per_shard: fixed number of videos per shard instead of the size target.
        verify: "sha256" (rehash finished shards on a rerun) or "size" (trust marker + size).
        feature_dtype: storage of the 2d/3d features, "float32" or "float16" (each value rounded
            to the nearest fp16; the manifest records it).
    """

    shard_size_mb: float = DEFAULT_SHARD_SIZE_MB
    seed: int = 0
    videos_per_shard: int | None = None
    verify: str = "sha256"
    feature_dtype: str = DEFAULT_FEATURE_DTYPE

    def check(self) -> None:
        if self.verify not in ("sha256", "size"):
            raise ValueError(f"verify={self.verify!r}: allowed values are sha256, size")
        if self.feature_dtype not in FEATURE_DTYPES:
            raise ShardError(f"--dtype {self.feature_dtype}: allowed values are {', '.join(FEATURE_DTYPES)}")
        if self.shard_size_mb <= 0 or (self.videos_per_shard is not None and self.videos_per_shard < 1):
            raise ShardError("shard size must be positive (--shard-size-mb > 0, videos per shard >= 1)")

    def record(self) -> dict:
        """What the manifest's ``settings`` records."""
        return {"seed": self.seed, "shard_size_mb": self.shard_size_mb, "feature_dtype": self.feature_dtype}


def shards_from_layout(features: str | os.PathLike | None, audio_features: str | os.PathLike | None,
                       captions: str | os.PathLike, video_list: str | os.PathLike | None,
                       word_vectors: str | os.PathLike, out: str | os.PathLike, *, workers: int = 1,
                       tars: Sequence[str | os.PathLike] = (), progress: bool = True, log=None,
                       writer: ShardWriters | None = None, **settings) -> dict:
    """Write the videos of the original layout into shuffled tar shards in ``out``; returns the
    manifest. The command line's arguments as :func:`convert` takes them: the inputs
    (``features``/``audio_features`` or ``tars``, ``captions``, ``video_list``, ``word_vectors``:
    :class:`sources.LayoutSources`), ``workers`` local processes unless ``writer`` is given, and
    ``settings``: the fields of :class:`ConversionSettings`."""
    src = layout_sources(features, audio_features, captions, video_list, word_vectors, tars)
    return convert(src, Path(out), ConversionSettings(**settings), writer or LocalProcesses(workers),
                   progress=progress, log=log)


def convert(src: LayoutSources, out: Path, settings: ConversionSettings, writers: ShardWriters, *,
            progress: bool = True, log=None) -> dict:
    """Write the shards of ``src`` into ``out`` with ``writers``; returns the manifest.

    Resumable: a shard whose done marker matches the plan (and, with ``verify="sha256"``, whose
    bytes still hash to the recorded sha256) is not rewritten; when every shard is complete and the
    manifest is current, nothing is written at all. Steps: the plan (new, or the one in ``out``),
    the shards still to do, the space check, the captions and vocabulary (the caption pickle
    unpickled at most once, into the caption store every writer maps), the writers, the manifest.

    Raises:
        ShardError: a missing input, ``out`` holding shards of a different plan, shards or the
            caption table that would not fit, a caption pickle changed since the conversion began.
        FeatureFileError: unreadable video list or caption pickle (the message names the file).
    """
    settings.check()
    log = log or (lambda msg: print(msg, file=sys.stderr))
    check_inputs(src)
    feats = open_features(src, progress)
    plan, new_plan = _the_plan(src, out, settings, feats)
    jobs = [ShardJob(i, s["name"], tuple(s["paths"]), None) for i, s in enumerate(plan["shards"])]
    done = {} if new_plan else _finished(out, plan["plan"], jobs, settings.verify)
    todo = [j for j in jobs if j.name not in done]
    if not todo and existing_vocab(out, plan["plan"]) is not None:
        manifest = _write_manifest(out, plan, done, src, settings, only_if_changed=True)
        log(f"shards: all {len(jobs)} shards in {out} are complete; nothing to do")
        caption_store.remove_store(out)
        return manifest
    store = caption_store.existing_store(out, src.captions)
    table = _caption_table(src) if store is None else None  # the pickle, unpickled at most once
    for stale in (t for j in todo for t in out.glob(f".{j.name}.tmp-*")):
        stale.unlink(missing_ok=True)  # a writer ended mid-shard (e.g. its pool stopped by another's error)
    _check_space(out, settings, feats, todo, store if store is not None else table)
    out.mkdir(parents=True, exist_ok=True)
    (out / DONE_DIR).mkdir(exist_ok=True)
    if new_plan:
        write_text_atomic(out / PLAN, json.dumps(plan))
    t0 = time.perf_counter()
    store, vocab = _captions_and_vocab(src, out, plan, store, table)
    del table  # dropped before any writer starts (forked ones would copy its pages as they touch them)
    gc.collect()
    log(f"shards: {len(todo)} of {len(jobs)} shard{'s' * (len(jobs) != 1)} to write ({_videos_in(todo)}, "
        f"vocabulary of {len(vocab.words)} words), {getattr(writers, 'description', 'other writers')}")
    state = WriterState(out=out, plan=plan["plan"], captions=store, captions_source=str(src.captions),
                        feature_dtype=settings.feature_dtype)
    with tqdm(total=len(todo), unit="shard", desc="shards", file=sys.stderr, disable=not progress) as bar:
        def finished(marker: dict) -> None:
            done[marker["name"]] = marker
            bar.update(1)

        writers(state, [ShardJob(j.index, j.name, j.paths, feats.subset(j.paths)) for j in todo], finished)
    manifest = _write_manifest(out, plan, done, src, settings)
    caption_store.remove_store(out)
    c = manifest["counts"]
    log(f"shards: {c['videos']} videos in {c['shards']} shard{'s' * (c['shards'] != 1)} ({c['bytes'] / 2**20:.1f} MiB), "
        f"{c['skipped']} skipped, {time.perf_counter() - t0:.1f} s -> {out / MANIFEST}")
    return manifest


def _videos_in(jobs: list[ShardJob]) -> str:
    """What the shards to write hold, as they hold it: ``3 videos`` (one shard), ``529 videos each``,
    ``529 videos each, the last 471`` (the plan cuts the list in equal shards but the last)."""
    sizes = [len(j.paths) for j in jobs]
    if len(sizes) == 1:
        return f"{sizes[0]} video{'s' * (sizes[0] != 1)}"
    if len(set(sizes)) == 1:
        return f"{sizes[0]} videos each"
    if len(set(sizes[:-1])) == 1:
        return f"{sizes[0]} videos each, the last {sizes[-1]}"
    return f"{min(sizes)} to {max(sizes)} videos each"


def _the_plan(src: LayoutSources, out: Path, settings: ConversionSettings, feats) -> tuple[dict, bool]:
    """(the conversion's plan, whether it is new): the one in ``out`` when its key matches the
    inputs and settings, a new one when ``out`` holds none.

    Raises:
        ShardError: ``out`` holds the plan of other inputs or settings; the list names no video.
    """
    list_bytes = src.video_list.read_bytes() if src.video_list else "\n".join(feats.video_ids()).encode()
    key = plan_key(src, hashlib.sha256(list_bytes).hexdigest(), settings.seed, settings.shard_size_mb,
                   settings.videos_per_shard, settings.feature_dtype)
    plan_path = out / PLAN
    if plan_path.exists():
        plan = read_json(plan_path)
        if plan.get("plan") != key:
            raise ShardError(f"{plan_path}: {out} already holds shards written from other inputs or settings "
                             f"(plan {plan.get('plan')}, now {key}); use a new --out directory or delete it")
        return plan, False
    paths = video_paths(src, feats)
    if not paths:
        raise ShardError(f"{f'--video-list {src.video_list}' if src.video_list else '--tars'}: lists no videos")
    return make_shard_plan(paths, src, feats, settings.seed, settings.shard_size_mb, settings.videos_per_shard,
                           key, settings.feature_dtype), True


def _finished(out: Path, key: str, jobs: list[ShardJob], verify: str) -> dict[str, dict]:
    """Shard name -> done marker of the shards an earlier run finished (and that are intact)."""
    markers = {j.name: finished_marker(out, j.name, key, verify) for j in jobs}
    return {name: m for name, m in markers.items() if m is not None}


def _caption_table(src: LayoutSources) -> dict:
    """The caption pickle unpickled, once its size in memory was checked against what this machine has.

    Raises:
        ShardError: it would not fit (naming both figures).
    """
    _check_caption_memory(src)
    return load_captions(src.captions)


def _check_caption_memory(src: LayoutSources) -> None:
    """Raises ShardError when unpickling the caption table would not fit this machine's memory."""
    needed, available = caption_store.unpickle_bytes(src.captions), caption_store.available_memory()
    if needed > available:
        raise ShardError(caption_store.memory_refusal(src.captions, needed, available))


def check_conversion(src: LayoutSources, out: Path, settings: ConversionSettings, *, progress: bool = True):
    """Every refusal :func:`convert` makes before it writes, made the same way and writing nothing
    (``raymcn shards --dry-run`` makes them first): its settings, the inputs, ``out`` holding shards
    of other inputs or settings, a caption store there built from another pickle, and the caption
    table's memory where it must be unpickled. The space the shards take is the dry run's report.
    Returns the features' reader (the tars indexed once, for the report too).

    Raises:
        ShardError, FeatureFileError: what the conversion would refuse, with its message.
    """
    settings.check()
    check_inputs(src)
    feats = open_features(src, progress)
    _the_plan(src, out, settings, feats)
    if caption_store.existing_store(out, src.captions) is None:
        _check_caption_memory(src)
    return feats


def _check_space(out: Path, settings: ConversionSettings, feats, todo: list[ShardJob], captions) -> None:
    """Before anything is written: the shards still to write must fit where they go."""
    left = [p for j in todo for p in j.paths]
    per_video = sample_bytes(left, feats, captions, np.random.default_rng([settings.seed, 0x5EED]))
    free, dtype = free_bytes(out), settings.feature_dtype
    if dtype in per_video and len(left) * per_video[dtype] > free:
        half = len(left) * per_video.get("float16", 0)
        raise ShardError(space_refusal(int(len(left) * per_video[dtype]), free, out, dtype,
                                       int(half) if dtype != "float16" and half <= free else None))


def _captions_and_vocab(src: LayoutSources, out: Path, plan: dict, store, table) -> tuple[caption_store.CaptionStore,
                                                                                         Vocab]:
    """The caption store and the vocabulary of the conversion: those an earlier run wrote, else
    written from ``table`` (the unpickled caption pickle; loaded here if the caller has not)."""
    vocab = existing_vocab(out, plan["plan"])
    if store is not None and vocab is not None:
        return store, vocab
    table = table if table is not None else _caption_table(src)
    if vocab is None:
        vocab = build_vocab_files(out, plan, src, table)
    if store is None:
        listed = (video_id_of(p) for s in plan["shards"] for p in s["paths"])
        store = caption_store.build_store(out, src.captions, table, listed, str(src.captions))
    return store, vocab


def _sources_record(src: LayoutSources) -> dict:
    """The manifest's record of where the videos came from (the folders, or the tars)."""
    where = {"tars": [str(t) for t in src.tars]} if src.tars else {
        "features": str(src.features), "audio_features": str(src.audio_features)}
    return {**where, "captions": str(src.captions), "video_list": str(src.video_list) if src.video_list else None,
            "word_vectors": str(src.word_vectors)}


def _write_manifest(out: Path, plan: dict, done: dict[str, dict], src: LayoutSources, settings: ConversionSettings,
                    only_if_changed: bool = False) -> dict:
    """The manifest of the finished shards, written to ``out/manifest.json`` (``only_if_changed``:
    left alone when it already says the same)."""
    markers = sorted(done.values(), key=lambda m: m["index"])
    vocab_meta = json.loads((out / DONE_DIR / VOCAB_MARKER).read_text())
    # "spans": each video's byte range in its shard, so a rank reads its videos alone (order.py);
    # markers of an earlier writer have none, and the reader then finds them from the tar headers.
    shards = [{"name": m["name"], "videos": m["videos"], **({"spans": m["spans"]} if "spans" in m else {}),
               "feature_dtype": m.get("feature_dtype", "float32"), "bytes": m["bytes"], "sha256": m["sha256"]}
              for m in markers]
    skipped = [{"video": v, "reason": r, "shard": None} for v, r in plan["duplicates"]]
    for m in markers:
        skipped.extend({"video": v, "reason": r, "shard": m["name"]} for v, r in m["skipped"])
    manifest = {
        "format": FORMAT, "version": FORMAT_VERSION, "plan": plan["plan"],
        "settings": {**settings.record(), "videos_per_shard": plan["videos_per_shard"], "members": list(MEMBERS)},
        "sources": _sources_record(src),
        "counts": {"listed": plan["listed"], "videos": sum(len(s["videos"]) for s in shards), "skipped": len(skipped),
                   "shards": len(shards), "bytes": sum(s["bytes"] for s in shards),
                   "vocab_words": vocab_meta["words"], "word_dim": vocab_meta["dim"]},
        "vocab": {"matrix": "vocab.npy", "words": "vocab.txt", "sha256": vocab_meta["sha256"]},
        "shards": shards,
        "skipped": skipped,
    }
    text = json.dumps(manifest, indent=1)
    path = out / MANIFEST
    if not (only_if_changed and path.is_file() and path.read_text() == text):
        write_text_atomic(path, text)
    return manifest
