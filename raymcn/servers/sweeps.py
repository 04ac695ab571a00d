"""Which sweep a boot continues, and which ``--resume latest`` picks: the newest one neither
finished, stopped on purpose nor a rehearsal.

A sweep's folder (a path or a bucket URI) may hold three marks, each a one-line file:

- ``FINISHED_FILE``, written by ``raymcn sweep`` when it ends normally with no trial left
  unfinished: its search and, when ``sweep.confirm`` asks for one, its confirmation;
- ``STOPPED_FILE``, written by ``raymcn sweep --stop``: the lab stopped it on purpose;
- ``REHEARSAL_FILE``, written as a rehearsal starts (``--rehearse``, ``raymcn doctor --rehearse``):
  a miniature, never the sweep a reboot interrupted. A folder named ``REHEARSAL_PREFIX-...`` (the
  doctor's) is one too.

A run of ``raymcn sweep --resume`` or ``--confirm`` on a sweep removes the first two: the sweep is
running again, so it is unfinished until that run ends, and a sweep the lab resumed by hand is no
longer stopped. A rehearsal stays one. Sweeps are ordered by their ``raymcn_sweep.yaml``'s time, as
``--resume latest`` orders them (it is written once, when the sweep starts).
"""

from __future__ import annotations

import datetime
import getpass
import posixpath
import socket

import pyarrow.fs as pafs

from raymcn import storage
from raymcn.config import REHEARSAL_FILE, REHEARSAL_PREFIX, SWEEP_CONFIG_FILE

FINISHED_FILE = "raymcn_finished"
STOPPED_FILE = "raymcn_stopped"
CONTINUED = "unfinished, not stopped and not a rehearsal"  # the rule, as the console says it


def _stamp(what: str) -> str:
    return f"{what} {datetime.datetime.now().astimezone().isoformat(timespec='seconds')} " \
           f"by {getpass.getuser()}@{socket.gethostname()}\n"


def mark_finished(experiment_dir: str) -> None:
    """The sweep ended normally with every trial finished (``cmd_sweep``'s end)."""
    storage.write_text(storage.join(experiment_dir, FINISHED_FILE), _stamp("finished"))


def mark_stopped(experiment_dir: str) -> None:
    """The lab stopped the sweep on purpose: a boot never continues it."""
    storage.write_text(storage.join(experiment_dir, STOPPED_FILE), _stamp("stopped"))


def mark_rehearsal(folder: str) -> None:
    """``folder`` (a sweep's or a run's) holds a rehearsal: neither a boot nor ``--resume latest``
    continues it."""
    storage.write_text(storage.join(folder, REHEARSAL_FILE), _stamp("rehearsal"))


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
    return storage.newest_first(location, SWEEP_CONFIG_FILE)


def is_rehearsal(folder: str, names: list[str] | None = None) -> bool:
    """Whether ``folder`` holds a rehearsal (its mark, or the doctor's name); ``names``: its files, if read."""
    names = storage.files(folder) if names is None else names
    return REHEARSAL_FILE in names or storage.basename(folder).startswith(f"{REHEARSAL_PREFIX}-")


def state(experiment_dir: str) -> str:
    """``stopped``, ``finished``, ``rehearsal`` or ``unfinished`` (a stop mark wins: the lab's word is
    the last)."""
    names = storage.files(experiment_dir)
    if STOPPED_FILE in names:
        return "stopped"
    if FINISHED_FILE in names:
        return "finished"
    return "rehearsal" if is_rehearsal(experiment_dir, names) else "unfinished"


SKIPPED_BECAUSE = {"stopped": "stopped on purpose", "finished": "finished",
                   "rehearsal": "a rehearsal: `--resume EXP` continues it"}


def not_continued_because(experiment_dir: str) -> str | None:
    """Why a boot and ``--resume latest`` leave the sweep ``experiment_dir`` alone, or None."""
    return SKIPPED_BECAUSE.get(state(experiment_dir))


def unfinished_sweeps(location: str) -> list[str]:
    """The sweeps in ``location`` neither finished, stopped nor rehearsals, the one started last first."""
    return [s for s in sweeps_newest_first(location) if state(s) == "unfinished"]


def latest_sweep(location: str) -> tuple[str, str]:
    """``raymcn sweep --resume latest``: the sweep a boot would continue (:func:`unfinished_sweeps`'
    first), and the line naming it and the newer sweeps skipped, with why.

    Raises:
        ConfigError: none is (each sweep there named, with why).
    """
    return storage.latest(location, SWEEP_CONFIG_FILE, "raymcn sweep", not_continued_because, CONTINUED)
