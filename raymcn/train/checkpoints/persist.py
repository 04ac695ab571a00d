"""A checkpoint's copy into the run's storage, whole or not at all: the Ray worker's upload
(``on_ray/worker.py`` hands :func:`persist` to ``ray.train.report`` as its ``checkpoint_upload_fn``).

On a filesystem (a local folder, NFS) the files are copied into ``.partial-<name>`` beside the run's
checkpoints, and the folder is renamed ``<name>`` once every file is there: a resume, Ray Train's
bookkeeping and a person only ever see whole checkpoints under a checkpoint's name. Ray's own copy
writes into ``<name>`` directly, so a full disk left folders there holding part of a ``state.pt``.
On an object store (``s3://``, ``gs://``) an object appears only once its upload completes and a
folder cannot be renamed, so the files go to ``<name>`` directly, ``state.pt`` first and its small
sidecars (``loop.json``, ``metrics.json``) last. A copy that fails removes what it wrote. One that
fails because the storage cannot take it (full, over quota, read-only) raises the
:class:`~raymcn.config.StorageError` of ``space.py``, which ends the run at once; Ray Train registers
only a checkpoint whose upload returned. No Ray here.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from typing import Any

from raymcn import storage
from raymcn.config import Config, is_storage_error
from raymcn.train.checkpoints import space
from raymcn.train.checkpoints.payload import STATE_FILE

PARTIAL_PREFIX = ".partial-"  # never Ray's "checkpoint_": no reader takes a folder being written for a checkpoint

Copy = Callable[[str, Any, str], None]  # (local folder, the storage's pyarrow filesystem, folder there)


def copy_files(source: str, fs, target: str) -> None:
    """The files of the local checkpoint folder ``source`` into the folder ``target`` of ``fs``,
    ``state.pt`` first (on an object store its sidecars then appear only beside a whole one)."""
    storage.copy_folder(source, fs, target, first=STATE_FILE)


def persist(source: str, fs, run_path: str, name: str, cfg: Config, *, shown: str, copy: Copy = copy_files) -> str:
    """Copy the local checkpoint folder ``source`` into ``run_path/name`` on ``fs`` (module doc) and
    return that path. ``shown``: the run's folder as messages name it (a path or URI); ``copy``: how
    the files go (fault injection stands in a full disk: ``train/faults.py``).

    Raises:
        StorageError: the storage cannot take the checkpoint (its figures named); nothing of it is left.
        Exception: any other error of the copy, unchanged (Ray Train retries an object store's
            transient ones), nothing of it left.
    """
    final = posixpath.join(run_path, name)
    renamed = storage.is_local(fs)
    target = posixpath.join(run_path, PARTIAL_PREFIX + name) if renamed else final
    try:
        copy(source, fs, target)
        if renamed:
            fs.move(target, final)  # a rename on one filesystem: the folder appears whole
    except Exception as e:
        _remove(fs, target)
        if is_storage_error(e):
            size = space.folder_bytes(source)
            raise space.storage_error(e, shown, cfg, size=size, what=f"copying checkpoint {name} "
                                      f"({storage.size_text(size)}) into the run's storage") from e
        raise
    return final


def remove_partials(fs, run_path: str) -> list[str]:
    """Remove the folders of copies that never finished (their process was killed mid-copy) from the
    run's folder; their names."""
    found = storage.subfolders(fs, run_path, prefix=PARTIAL_PREFIX)
    for path in found:
        _remove(fs, path)
    return [posixpath.basename(p) for p in found if p not in storage.subfolders(fs, run_path, prefix=PARTIAL_PREFIX)]


def unregistered_after(fs, latest: str) -> list[str]:
    """The checkpoint folders beside ``latest`` (the checkpoint Ray Train resumes from, the newest it
    registered) that are newer than it: Ray Train never registered them (their run ended before it
    did), so a resume skips them. Their names, oldest first."""
    name = posixpath.basename(latest.rstrip("/"))
    return [posixpath.basename(p) for p in storage.subfolders(fs, posixpath.dirname(latest.rstrip("/")), "checkpoint_")
            if posixpath.basename(p) > name]


def _remove(fs, path: str) -> None:
    """Delete the folder ``path`` of ``fs`` and what it holds, if it exists."""
    try:
        storage.remove_folder(fs, path)
    except OSError:  # a cleanup after a failed copy: the copy's own error is the one raised and named
        pass
