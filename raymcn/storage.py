"""Where runs and sweeps keep their files: a local (or NFS) folder, or a bucket URI.

``run.storage_path`` may be a path (``~`` expanded) or a URI that ``pyarrow.fs`` understands
(``s3://bucket/prefix``, ``gs://bucket/prefix``), as Ray Train and Tune accept it. Everything raymcn
itself writes or reads there (the resolved config beside a run, checkpoints on resume, the
experiment folder for the results table) goes through these few functions, so the rest of the
code never assumes one filesystem view. An S3-compatible server is reached with the usual
``AWS_*`` variables (``AWS_ENDPOINT_URL`` for a non-AWS endpoint). No Ray, no torch here.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable
from pathlib import Path

import pyarrow.fs as pafs

from raymcn.config import ConfigError


def is_uri(location: str | os.PathLike) -> bool:
    return "://" in str(location)


def normalize(location: str | os.PathLike) -> str:
    """A URI unchanged (without a trailing slash); a local path absolute, ``~`` expanded."""
    text = str(location)
    if is_uri(text):
        return text.rstrip("/")
    return str(Path(text).expanduser().resolve())


def join(base: str | os.PathLike, *parts: str) -> str:
    base = normalize(base)
    return posixpath.join(base, *parts) if is_uri(base) else os.path.join(base, *parts)


def parent(location: str) -> str:
    return posixpath.dirname(location) if is_uri(location) else os.path.dirname(location)


def basename(location: str) -> str:
    return posixpath.basename(location.rstrip("/"))


def local_filesystem() -> pafs.FileSystem:
    return pafs.LocalFileSystem()


def filesystem(location: str | os.PathLike) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path inside it) of ``location``."""
    location = normalize(location)
    if is_uri(location):
        return pafs.FileSystem.from_uri(location)
    return pafs.LocalFileSystem(), location


def write_text(location: str, text: str) -> None:
    fs, path = filesystem(location)
    fs.create_dir(posixpath.dirname(path), recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(text.encode())


def replace_text(location: str, text: str) -> None:
    """``location`` holds ``text``, and a reader never sees part of it: a local file is written under a
    temporary name beside it, then renamed over it; a bucket's object is replaced whole by one upload."""
    location = normalize(location)
    if is_uri(location):
        write_text(location, text)
        return
    folder, name = os.path.split(location)
    os.makedirs(folder, exist_ok=True)
    temporary = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w") as f:
            f.write(text)
        os.replace(temporary, location)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def read_text(location: str) -> str:
    fs, path = filesystem(location)
    try:
        with fs.open_input_stream(path) as f:
            return f.read().decode()
    except FileNotFoundError:
        raise FileNotFoundError(f"{location} does not exist") from None


def files(location: str) -> list[str]:
    """Names of the files directly inside ``location``, sorted ([] if it does not exist)."""
    fs, path = filesystem(location)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return []
    return sorted(posixpath.basename(i.path) for i in fs.get_file_info(pafs.FileSelector(path))
                  if i.type == pafs.FileType.File)


def subfolders(fs: pafs.FileSystem, path: str, prefix: str = "") -> list[str]:
    """Paths of the folders directly in ``path`` on ``fs`` whose names start with ``prefix``, sorted."""
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return []
    return sorted(i.path for i in fs.get_file_info(pafs.FileSelector(path, recursive=False))
                  if i.type == pafs.FileType.Directory and posixpath.basename(i.path).startswith(prefix))


def fetch(fs: pafs.FileSystem, path: str, local_dir: str | os.PathLike) -> Path:
    """The folder ``path`` of ``fs`` as a local folder: itself on the local filesystem, else a copy
    of it in ``local_dir``."""
    if isinstance(fs, pafs.LocalFileSystem):
        return Path(path)
    pafs.copy_files(path, str(local_dir), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    return Path(local_dir)


def local_copy(location: str, cache_dir: str | os.PathLike, skip: tuple[str, ...] = ()) -> Path:
    """A local folder holding ``location``'s files: the folder itself when it is local, else a copy
    of the remote tree in ``cache_dir`` (refreshed on every call: a running sweep keeps writing).
    ``skip``: prefixes of folder names not copied at any depth (``CHECKPOINTS``: every trial's
    checkpoints, gigabytes each at paper size, which no table reads)."""
    location = normalize(location)
    if not is_uri(location):
        return Path(location)
    fs, path = filesystem(location)
    target = Path(cache_dir).expanduser() / basename(location)
    local = pafs.LocalFileSystem()
    for info in fs.get_file_info(pafs.FileSelector(path, recursive=True)):
        relative = posixpath.relpath(info.path, path)
        if info.type != pafs.FileType.File or any(part.startswith(skip) for part in relative.split("/")[:-1] if skip):
            continue
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        pafs.copy_files(info.path, str(target / relative), source_filesystem=fs, destination_filesystem=local)
    target.mkdir(parents=True, exist_ok=True)
    return target


CHECKPOINTS = ("checkpoint_",)  # the folders Ray Train names each checkpoint: local_copy(skip=CHECKPOINTS)


def newest_first(location: str, marker: str) -> list[str]:
    """Every folder directly in ``location`` holding ``marker`` (a file every run or sweep writes
    first), the one whose marker was written last first; [] when ``location`` does not exist. The
    marker's time, not the folder's: object stores keep no times for prefixes, and a folder's time
    changes whenever anything inside it does."""
    location = normalize(location)
    fs, path = filesystem(location)
    marks = [i for i in fs.get_file_info([posixpath.join(f, marker) for f in subfolders(fs, path)])
             if i.type == pafs.FileType.File]
    marks.sort(key=lambda i: (i.mtime.timestamp() if i.mtime else 0.0, i.path), reverse=True)
    return [join(location, posixpath.basename(posixpath.dirname(i.path))) for i in marks]


SKIPPED_SHOWN = 5  # newer folders ``latest`` names as skipped, at most (the rest counted)


def latest(location: str, marker: str, what: str, skipped_because: Callable[[str], str | None],
           rule: str) -> tuple[str, str]:
    """``--resume latest``: the newest folder in ``location`` holding ``marker`` for which
    ``skipped_because`` (folder -> why it is not continued, or None) gives no reason, and the line
    that says which it picked by what ``rule`` and which newer ones it skipped, and why.

    Raises:
        ConfigError: no folder there holds ``marker``, or every one is skipped (each named, with why).
    """
    location = normalize(location)
    skipped: list[str] = []
    for folder in newest_first(location, marker):
        why = skipped_because(folder)
        if why is None:
            return folder, f"{folder} (the newest {what} under {location} that is {rule})" + _skipped(skipped)
        skipped.append(f"{basename(folder)} ({why})")
    if not skipped:
        raise ConfigError([f"--resume latest: no {what} (a folder with {marker}) under {location}"])
    raise ConfigError([f"--resume latest: no {what} under {location} is {rule}; each was skipped: "
                       + _listed(skipped) + f". Name one with --resume {location}/NAME"])


def _skipped(skipped: list[str]) -> str:
    return "; skipped, newer: " + _listed(skipped) if skipped else ""


def _listed(skipped: list[str]) -> str:
    more = len(skipped) - SKIPPED_SHOWN
    return ", ".join(skipped[:SKIPPED_SHOWN]) + (f" and {more} more" if more > 0 else "")
