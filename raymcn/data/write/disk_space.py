"""Will the shards fit? The bytes a conversion writes, estimated before anything is written.

``raymcn shards --dry-run`` prints :class:`SpacePlan`; the conversion itself refuses to start
(``space_refusal``) when the shards still to write exceed the free space where they go.
"""

from __future__ import annotations

import os
import shutil
import sys
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from raymcn.data.formats.features import FeatureFileError, load_captions, video_id_of
from raymcn.data.formats.manifest import ShardError
from raymcn.data.formats.sample import FEATURE_DTYPES, encode_record
from raymcn.data.write import captions as caption_store
from raymcn.data.write.sources import LayoutSources, check_inputs, open_features, video_paths

SIZE_SAMPLE = 32  # videos whose npz headers are read to estimate the mean sample size


def estimate_sample_bytes(paths: Sequence[str], feats, rng: np.random.Generator,
                           feature_dtype: str = "float32") -> float:
    """Mean sample size from the array sizes of a few videos (npz directories, no array decoded),
    for the shard size target; the 2d/3d ones scaled to ``feature_dtype`` (the original files hold fp32)."""
    scale = FEATURE_DTYPES[feature_dtype].itemsize / 4
    sizes = []
    for i in rng.permutation(len(paths))[:SIZE_SAMPLE]:
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
                 count: int = SIZE_SAMPLE) -> dict[str, float]:
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


def free_bytes(out: Path) -> int:
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
    memory_needed: int = 0  # bytes to unpickle the caption table once (0: an earlier run's caption store)
    memory_available: int = 0  # bytes this machine has available

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
                 f"{SIZE_SAMPLE} videos)"]
        lines += [f"{d:<9}{self.total(d) / 2**20:>12.1f}{self.per_video[d] / 2**20:>15.2f}" for d in self.per_video]
        lines.append(f"free at {self.out}: {_gb(self.free)}")
        lines.append(f"caption table: ~{_gb(self.memory_needed)} of memory to load it once, {_gb(self.memory_available)} "
                     "available" if self.memory_needed else "caption table: the caption store of an earlier run is "
                     "reused (no unpickling)")
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


def plan_space(src: LayoutSources, out: str | os.PathLike, *, seed: int = 0, progress: bool = True,
               feats=None) -> SpacePlan:
    """Count the videos of a layout whose files exist, estimate the shards' bytes per dtype, and
    read the free space at ``out``; nothing is written. ``feats``: the features' reader, if opened.

    Raises:
        ShardError / FeatureFileError: a missing input or an unreadable video list / caption pickle.
    """
    check_inputs(src)
    feats = feats if feats is not None else open_features(src, progress)
    paths = list(dict.fromkeys(video_paths(src, feats)))
    found, missing = [], []
    for path in tqdm(paths, unit="video", desc="checking files", file=sys.stderr, disable=not progress):
        (found if feats.complete(path) else missing).append(path)
    store = caption_store.existing_store(Path(out), src.captions)
    needed = 0 if store is not None else caption_store.unpickle_bytes(src.captions)
    available = caption_store.available_memory()
    if needed > available:  # said before it is spent: the dry run would load the table too
        raise ShardError(caption_store.memory_refusal(src.captions, needed, available))
    caps = store if store is not None else load_captions(src.captions)
    per_video = sample_bytes(found, feats, caps, np.random.default_rng([seed, 0x5EED]))
    if not per_video:
        raise ShardError(f"{src.video_list or 'the tars'}: none of the sampled videos could be read")
    free = free_bytes(Path(out))
    return SpacePlan(len(paths), len(found), tuple(video_id_of(p) for p in missing[:3]), per_video, Path(out), free,
                     needed, available)
