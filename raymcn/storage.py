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
import shutil
from collections.abc import Callable
from dataclasses import dataclass
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


COPY_CHUNK_BYTES = 64 * 2**20  # as Ray's own copy: large chunks for a checkpoint of gigabytes


def copy_folder(source: str | os.PathLike, fs: pafs.FileSystem, target: str, first: str = "") -> None:
    """The files of the local folder ``source`` into the folder ``target`` of ``fs``, the one named
    ``first`` before the others (on an object store, where each file appears once whole, the others
    then appear only beside it)."""
    local = pafs.LocalFileSystem()
    names = sorted((i.base_name for i in local.get_file_info(pafs.FileSelector(str(source)))),
                   key=lambda name: (name != first, name))
    fs.create_dir(target)
    for name in names:
        pafs.copy_files(posixpath.join(str(source), name), posixpath.join(target, name), source_filesystem=local,
                        destination_filesystem=fs, chunk_size=COPY_CHUNK_BYTES,
                        use_threads=is_local(fs))  # (S3 uploads in one thread, as Ray copies)


def is_local(fs: pafs.FileSystem) -> bool:
    """Whether ``fs`` is a filesystem of this machine's (a local folder or a mount: NFS), where a
    folder renamed appears at once and whole; not an object store."""
    return fs.type_name == "local"


def remove_folder(fs: pafs.FileSystem, path: str) -> None:
    """Delete the folder ``path`` of ``fs`` and what it holds, if it exists (OSError: it could not)."""
    if fs.get_file_info(path).type != pafs.FileType.NotFound:
        fs.delete_dir(path)


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


@dataclass(frozen=True)
class Space:
    """The filesystem a local path is (or will be) on: ``mount`` (its mount point) and ``kind``
    (its type, e.g. ext4, nfs4, tmpfs; "" where the mount table cannot be read), and its ``free``
    and ``total`` bytes (``free``: what this user may still write)."""

    path: str
    mount: str
    kind: str
    free: int
    total: int

    def named(self) -> str:
        """``/shared/results (nfs4 at /shared)``: the path and its filesystem, for a message."""
        kind = self.kind or "a filesystem"
        return f"{self.path} ({kind})" if self.path == self.mount else f"{self.path} ({kind} at {self.mount})"


def space_at(location: str | os.PathLike) -> Space | None:
    """The :class:`Space` of a local ``location`` (its nearest existing folder's); None for a
    bucket URI, whose free space an object store does not say."""
    if is_uri(location):
        return None
    path = Path(normalize(location))
    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    usage = shutil.disk_usage(where)
    mount, kind = _mount_of(where)
    return Space(str(path), mount, kind, usage.free, usage.total)


MOUNTS = Path("/proc/self/mounts")  # Linux's table of this process's mounts


def _mount_of(path: Path) -> tuple[str, str]:
    """(mount point, filesystem type) of the existing ``path``: the longest mount point that holds
    it in :data:`MOUNTS`; (its mount point as ``os.path.ismount`` finds it, "") without the table."""
    real = os.path.realpath(path)
    try:
        rows = [line.split()[1:3] for line in MOUNTS.read_text().splitlines() if len(line.split()) >= 3]
    except OSError:
        rows = []
    # spaces and tabs in a mount point are written as octal escapes (\040)
    holding = [(point.encode().decode("unicode_escape"), kind) for point, kind in rows]
    holding = [(point, kind) for point, kind in holding if real == point or real.startswith(point.rstrip("/") + "/")]
    if holding:
        return max(holding, key=lambda row: len(row[0]))
    while not os.path.ismount(real):
        real = os.path.dirname(real)
    return real, ""


def size_text(n: float) -> str:
    """Bytes for a person, in decimal units as ``df -H`` shows them: ``3.65 GB``, ``14.0 MB``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.{2 if abs(value) < 10 else 1 if abs(value) < 100 else 0}f} {unit}"
    return f"{int(n)} byte{'s' * (int(n) != 1)}"


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
