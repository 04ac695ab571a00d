"""The lab's own tar files as the input of ``raymcn shards``: per-video npz/npy files inside tars.

Nothing needs to be un-tarred first: the tars' member headers are scanned once (an index of
video id -> member offsets, no data read), and each video's members are then read by offset while
the shards are written. Accepted member names (the file name part; any folder before it is
ignored), each holding the original file's bytes:

=================================  ==========================================================
WebDataset style (key, first dot)  ``<id>.2d.npz``, ``<id>.3d.npz``, ``<id>.spec.npz``
the original file names            ``<id>_2d.npz``, ``<id>_3d.npz``, ``<id>_spec.npz``
=================================  ==========================================================

``.npy`` instead of ``.npz`` is accepted for each. An npz holds the original key (``features``
for 2d/3d, ``arr_0`` for the spectrogram), as the original files do. Captions still come from the
caption pickle. Imports: numpy, ``features`` (no Ray, no torch).
"""

from __future__ import annotations

import io
import os
import re
import sys
import tarfile
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from raymcn.data.formats.features import (
    FeatureFileError,
    VideoRecord,
    spec_array,
    video_id_of,
    video_record,
    visual_array,
)

KINDS = ("2d", "3d", "spec")
_NAME = (re.compile(r"^(?P<id>[^.]+)\.(?P<kind>2d|3d|spec)\.(?P<ext>npz|npy)$"),  # WebDataset: <key>.<suffix>
         re.compile(r"^(?P<id>.+)_(?P<kind>2d|3d|spec)\.(?P<ext>npz|npy)$"))  # the original file names
_NPZ_KEY = {"2d": "features", "3d": "features", "spec": "arr_0"}


def tar_files(inputs: Iterable[str | os.PathLike]) -> list[Path]:
    """The tar files named by ``inputs`` (files, or folders whose ``*.tar`` are taken in name order)."""
    out: list[Path] = []
    for item in inputs:
        p = Path(item)
        out.extend(sorted(p.glob("*.tar")) if p.is_dir() else [p])
    return out


def member_kind(name: str) -> tuple[str, str, str] | None:
    """(video id, kind, extension) of an accepted member name, None for any other member."""
    base = name.rsplit("/", 1)[-1]
    for pattern in _NAME:
        m = pattern.match(base)
        if m:
            return m["id"], m["kind"], m["ext"]
    return None


@dataclass
class TarFeatures:
    """The features of videos stored in tar files: an index of member offsets, and the reader.

    Attributes:
        tars: the tar files, in order; index: video id -> kind -> (tar number, data offset, size, ext).
    """

    tars: list[Path]
    index: dict[str, dict[str, tuple[int, int, int, str]]] = field(default_factory=dict)

    @classmethod
    def scan(cls, tars: Sequence[Path], progress: bool = True) -> TarFeatures:
        """Index every accepted member of ``tars`` (headers only). Raises FeatureFileError naming an
        unreadable tar."""
        found = cls(list(tars))
        for number, path in enumerate(tqdm(found.tars, unit="tar", desc="indexing tars", file=sys.stderr,
                                           disable=not progress)):
            try:
                with tarfile.open(path, mode="r:") as tf:
                    for member in tf:
                        kind = member_kind(member.name) if member.isfile() else None
                        if kind is not None:
                            vid, k, ext = kind
                            found.index.setdefault(vid, {})[k] = (number, member.offset_data, member.size, ext)
            except (OSError, tarfile.TarError) as e:
                raise FeatureFileError(f"--tars {path}: unreadable tar ({e})") from None
        return found

    def subset(self, paths) -> TarFeatures:
        """The reader of only these videos (video-list rows or ids): what one shard's writer needs."""
        wanted = (video_id_of(p) for p in paths)
        return TarFeatures(self.tars, {vid: self.index[vid] for vid in wanted if vid in self.index})

    def complete(self, path: str) -> bool:
        """Whether the video of ``path`` (a video-list row or an id) has all three members."""
        return all(k in self.index.get(video_id_of(path), {}) for k in KINDS)

    def video_ids(self) -> list[str]:
        """The ids with all three members, in the order the tars hold them."""
        return [vid for vid, kinds in self.index.items() if all(k in kinds for k in KINDS)]

    def member_bytes(self, vid: str, kind: str) -> tuple[bytes, str]:
        """The bytes of one member and a name for messages (``tar:member``)."""
        try:
            number, offset, size, ext = self.index[vid][kind]
        except KeyError:
            raise FeatureFileError(f"video {vid}: no {kind} member in the tars") from None
        where = f"{self.tars[number]}:{vid}.{kind}.{ext}"
        try:
            with open(self.tars[number], "rb") as f:
                f.seek(offset)
                data = f.read(size)
        except OSError as e:
            raise FeatureFileError(f"{where}: unreadable ({e})") from None
        if len(data) != size:
            raise FeatureFileError(f"{where}: truncated ({len(data)} of {size} bytes)")
        return data, where

    def array(self, vid: str, kind: str) -> np.ndarray:
        data, where = self.member_bytes(vid, kind)
        try:
            if self.index[vid][kind][3] == "npy":
                return np.load(io.BytesIO(data), allow_pickle=False)
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                if _NPZ_KEY[kind] not in z.files:
                    raise FeatureFileError(f"{where}: no key '{_NPZ_KEY[kind]}' (keys: {z.files})")
                return z[_NPZ_KEY[kind]]
        except FeatureFileError:
            raise
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise FeatureFileError(f"{where}: unreadable ({type(e).__name__}: {e})") from None

    def array_sizes(self, vid: str) -> dict[str, int] | None:
        """Uncompressed bytes of each member's array (from its npz directory or npy size), None if unreadable."""
        out = {}
        try:
            for kind in KINDS:
                data, _ = self.member_bytes(vid, kind)
                if self.index[vid][kind][3] == "npy":
                    out[kind] = len(data)
                else:
                    with zipfile.ZipFile(io.BytesIO(data)) as z:
                        out[kind] = sum(info.file_size for info in z.infolist())
        except (FeatureFileError, zipfile.BadZipFile):
            return None
        return out

    def read_video(self, path: str, captions: Mapping, word_to_id: Mapping[str, int], max_words: int | None = None,
                   caption_source: str = "<captions>") -> VideoRecord:
        """One video as :func:`features.read_video` reads it from the folder layout (the same checks)."""
        vid = video_id_of(path)
        feats = [visual_array(self.array(vid, kind), f"video {vid}, {kind} member") for kind in ("2d", "3d")]
        spec = spec_array(self.array(vid, "spec"), f"video {vid}, spec member")
        return video_record(vid, feats[0], feats[1], spec, captions, word_to_id, max_words, caption_source)
