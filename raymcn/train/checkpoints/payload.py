"""Checkpoint payloads: everything a resumed run needs to continue as if never stopped.

One file, ``state.pt``, holding model, optimizer, scheduler, loop counters (global step, epoch),
the clustering state (queue, centroids, last active modalities), RNG states and the resolved
config. Written to a temporary name and renamed, so a crash mid-write never leaves a file that
looks complete. No Ray here: ``worker.py`` hands the directory to ``ray.train.report``.

Loaded with ``torch.load(weights_only=True)``, allowing only the types raymcn saves: checkpoints
sit on shared storage and every node that resumes loads them, so a file that unpickles anything
else (which could run code) is refused, naming the file and the types (:class:`UnsafeCheckpointError`).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raymcn.config import PermanentError

STATE_FILE = "state.pt"
META_FILE = "loop.json"
METRICS_META_FILE = "metrics.json"  # beside an epoch-end checkpoint: the metrics its epoch reported
FORMAT_VERSION = 1


class CheckpointError(RuntimeError, PermanentError):
    """A checkpoint file is missing or unreadable (the message names it)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint holds pickled objects of types raymcn never saves; it is not loaded."""


def _saved_types() -> list:
    """What a raymcn payload holds beyond torch's default allowlist (tensors, dicts, lists, tuples,
    numbers, strings, None, OrderedDict): numpy's RNG state, ``np.random.get_state()``, whose key
    array pickles as an ndarray of a uint32 dtype. The second name of ``_reconstruct`` is the one
    numpy 1 wrote, so checkpoints saved under numpy 1 still load."""
    reconstruct = np._core.multiarray._reconstruct
    return [np.ndarray, np.dtype, type(np.dtype(np.uint32)), reconstruct,
            (reconstruct, "numpy.core.multiarray._reconstruct")]


def foreign_types(path: str | os.PathLike) -> list[str]:
    """The pickled globals in the checkpoint file ``path`` that neither torch's default allowlist
    nor raymcn's own payload (:func:`_saved_types`) accounts for, e.g. ``['builtins.exec']``."""
    allowed = {f"{t.__module__}.{t.__qualname__}" for t in _saved_types() if not isinstance(t, tuple)}
    allowed |= {t[1] for t in _saved_types() if isinstance(t, tuple)}
    return [name for name in torch.serialization.get_unsafe_globals_in_checkpoint(path) if name not in allowed]


def refusal(path: str | os.PathLike, types: list[str]) -> str:
    """The message that names a refused checkpoint file and what it holds."""
    return (f"checkpoint {path} holds pickled objects of types raymcn never saves ({', '.join(types)}); "
            "refused, since loading them could run code from the file. Resume from a checkpoint raymcn "
            "wrote, and find out who changed this one")


def rng_state() -> dict[str, Any]:
    """The host generators and, on a GPU, this process's device's generator only: a worker owns one
    GPU, and a resume may see fewer GPUs than the saving process did (another placement, fewer
    workers), where restoring one state per GPU of the saver fails."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, (list, tuple)):  # older checkpoints: one state per GPU the saver saw
            index = torch.cuda.current_device()
            cuda = cuda[index] if index < len(cuda) else cuda[0]
        torch.cuda.set_rng_state(cuda)  # this process's device (MCN draws no CUDA random numbers in training)


def save(directory: str | os.PathLike, **parts: Any) -> Path:
    """Write ``parts`` (objects with ``state_dict()`` or plain values) to ``directory/state.pt`` atomically."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT_VERSION, "rng": rng_state()}
    for name, part in parts.items():
        payload[name] = part.state_dict() if hasattr(part, "state_dict") else part
    final = directory / STATE_FILE
    tmp = directory / (STATE_FILE + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. disk full: drop the partial file, keep the previous one
        raise
    os.replace(tmp, final)  # atomic on POSIX: readers see the old file or the whole new one
    if "loop" in payload:  # small sidecars: the driver reads the epoch without loading the weights
        (directory / META_FILE).write_text(json.dumps(payload["loop"]))
    if "metrics" in payload:
        (directory / METRICS_META_FILE).write_text(json.dumps(payload["metrics"]))
    return final


def load(directory: str | os.PathLike, mmap: bool = False, shown_as: str | None = None) -> dict[str, Any]:
    """The payload of ``directory/state.pt``; ``mmap=True`` maps the tensors instead of reading them
    (checking shapes of a 224 M-parameter checkpoint then reads almost nothing).

    Args:
        shown_as: the folder that messages name (a bucket's, when ``directory`` is a local copy).

    Raises:
        UnsafeCheckpointError: the file holds types raymcn never saves (module doc).
        CheckpointError: the file is missing, unreadable or of another format.
    """
    path = Path(directory) / STATE_FILE
    shown = f"{shown_as.rstrip('/')}/{STATE_FILE}" if shown_as else path
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        with torch.serialization.safe_globals(_saved_types()):
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # truncated or corrupted file, or a type outside the allowlist: say which
        try:
            foreign = foreign_types(path)
        except Exception:  # noqa: BLE001 - not even a readable archive: the load's own error says more
            foreign = []
        if foreign:
            raise UnsafeCheckpointError(refusal(shown, foreign)) from None
        raise CheckpointError(f"checkpoint {shown} is unreadable: {type(e).__name__}: {e}") from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {shown} has an unknown format")
    return payload


def restore(payload: dict[str, Any], **parts: Any) -> None:
    """Load each named part's state from ``payload`` (strictly: a mismatch is an error, not a warning)."""
    for name, part in parts.items():
        if name not in payload:
            raise CheckpointError(f"checkpoint lacks '{name}'")
        part.load_state_dict(payload[name])
    set_rng_state(payload["rng"])


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Checkpoint directories of a run, oldest first (Ray names them by timestamp)."""
    return sorted(p for p in Path(run_dir).glob("checkpoint_*") if p.is_dir())


def load_latest_good(latest: str | os.PathLike, warn=print, filesystem=None) -> tuple[dict[str, Any], str]:
    """Load ``latest``; if it is unreadable, fall back to the newest readable older checkpoint of
    the same run (with a warning naming both), so one damaged file costs one epoch, not the run.

    Args:
        latest: the checkpoint folder, a path on ``filesystem`` (a ``pyarrow.fs`` filesystem, e.g.
            the bucket of ``ray.train.Checkpoint.filesystem``; default the local one). A remote
            checkpoint is downloaded to a temporary folder before it is read.

    Raises:
        CheckpointError: when no checkpoint of the run is readable.
    """
    import tempfile

    from raymcn import storage

    fs = filesystem or storage.local_filesystem()
    latest = str(latest)
    name = os.path.basename(latest.rstrip("/"))
    older = [p for p in reversed(storage.subfolders(fs, os.path.dirname(latest.rstrip("/")), "checkpoint_"))
             if os.path.basename(p) < name]
    problems = []
    for path in [latest, *older]:
        with tempfile.TemporaryDirectory(prefix="raymcn-ckpt-") as tmp:
            try:
                payload = load(storage.fetch(fs, path, tmp), shown_as=path)
            except UnsafeCheckpointError:
                # Not damage: someone wrote this file. Going back to an older checkpoint would
                # hide that, so the resume stops here (a permanent error: not retried).
                raise
            except (CheckpointError, OSError) as e:
                problems.append(str(e) if isinstance(e, CheckpointError) else f"checkpoint {path} unreadable: {e}")
                continue
        if problems:
            warn(f"warning: {'; '.join(problems)}; resuming from the older checkpoint {path} instead")
        return payload, path
    raise CheckpointError("no readable checkpoint: " + "; ".join(problems))
