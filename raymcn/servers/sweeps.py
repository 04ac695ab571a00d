"""Which sweep a boot continues: the newest one neither finished nor stopped on purpose.

A sweep's folder (a path or a bucket URI) may hold two marks, each a one-line file:

- ``FINISHED_FILE``, written by ``raymcn sweep`` when it ends normally with no trial left
  unfinished: its search and, when ``sweep.confirm`` asks for one, its confirmation;
- ``STOPPED_FILE``, written by ``raymcn sweep --stop``: the lab stopped it on purpose.

A run of ``raymcn sweep --resume`` or ``--confirm`` on a sweep removes both first: the sweep is
running again, so it is unfinished until that run ends, and a sweep the lab resumed by hand is no
longer stopped. Sweeps are ordered by their ``raymcn_sweep.yaml``'s time, as ``--resume latest``
orders them (it is written once, when the sweep starts).
"""

from __future__ import annotations

import datetime
import getpass
import posixpath
import socket

import pyarrow.fs as pafs

from raymcn import storage
from raymcn.config import SWEEP_CONFIG_FILE

FINISHED_FILE = "raymcn_finished"
STOPPED_FILE = "raymcn_stopped"


def _stamp(what: str) -> str:
    return f"{what} {datetime.datetime.now().astimezone().isoformat(timespec='seconds')} " \
           f"by {getpass.getuser()}@{socket.gethostname()}\n"


def mark_finished(experiment_dir: str) -> None:
    """The sweep ended normally with every trial finished (``cmd_sweep``'s end)."""
    storage.write_text(storage.join(experiment_dir, FINISHED_FILE), _stamp("finished"))


def mark_stopped(experiment_dir: str) -> None:
    """The lab stopped the sweep on purpose: a boot never continues it."""
    storage.write_text(storage.join(experiment_dir, STOPPED_FILE), _stamp("stopped"))


def clear_marks(experiment_dir: str) -> None:
    """The sweep runs again (``--resume``, ``--confirm``): neither finished nor stopped."""
    fs, path = storage.filesystem(experiment_dir)
    for name in (FINISHED_FILE, STOPPED_FILE):
        target = posixpath.join(path, name)
        if fs.get_file_info(target).type == pafs.FileType.File:
            fs.delete_file(target)


def sweeps_newest_first(location: str) -> list[str]:
    """Every sweep folder directly in ``location`` (a folder holding ``raymcn_sweep.yaml``), the one
    started last first; [] when ``location`` does not exist."""
    location = storage.normalize(location)
    fs, path = storage.filesystem(location)
    folders = storage.subfolders(fs, path)
    configs = [i for i in fs.get_file_info([posixpath.join(f, SWEEP_CONFIG_FILE) for f in folders])
               if i.type == pafs.FileType.File]
    configs.sort(key=lambda i: (i.mtime.timestamp() if i.mtime else 0.0, i.path), reverse=True)
    return [storage.join(location, posixpath.basename(posixpath.dirname(i.path))) for i in configs]


def state(experiment_dir: str) -> str:
    """``stopped``, ``finished`` or ``unfinished`` (a stop mark wins: the lab's word is the last)."""
    names = storage.files(experiment_dir)
    return "stopped" if STOPPED_FILE in names else "finished" if FINISHED_FILE in names else "unfinished"


def unfinished_sweeps(location: str) -> list[str]:
    """The sweeps in ``location`` neither finished nor stopped, the one started last first."""
    return [s for s in sweeps_newest_first(location) if state(s) == "unfinished"]
