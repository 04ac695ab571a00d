"""Where ``raymcn shards`` reads the original layout from: the feature folders, or the lab's tars.

A video is read through ``FolderFeatures`` (the per-video npz files under two roots) or
``tarinput.TarFeatures`` (the same files inside tars); both give the same ``VideoRecord``.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

from raymcn.data.formats.features import VideoRecord, read_video, read_video_paths, video_id_of
from raymcn.data.formats.manifest import ShardError
from raymcn.data.write.tarinput import TarFeatures, tar_files


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

    def subset(self, paths) -> FolderFeatures:
        """The reader of these videos: the folders serve any video, so this one."""
        return self

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


def video_paths(src: LayoutSources, feats) -> list[str]:
    """The video-list rows, or without a list (tar input) the tars' complete videos in their order."""
    if src.video_list is not None:
        return read_video_paths(src.video_list)
    return feats.video_ids()


def check_inputs(src: LayoutSources) -> None:
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


def layout_sources(features, audio_features, captions, video_list, word_vectors, tars=()) -> LayoutSources:
    """:class:`LayoutSources` of the command's arguments (``tars``: files or folders of ``*.tar``)."""
    return LayoutSources(Path(features or ""), Path(audio_features or ""), Path(captions),
                         Path(video_list) if video_list else None, Path(word_vectors), tuple(tar_files(tars)))
