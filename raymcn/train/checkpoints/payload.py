"""Checkpoint payloads: everything a resumed run needs to continue as if never stopped.

One file, ``state.pt``, holding model, optimizer, scheduler, loop counters (global step, epoch),
the clustering state (queue, centroids, last active modalities), RNG states and the resolved
config. Written to a temporary name and renamed, so a crash mid-write never leaves a file that
looks complete. No Ray here: ``worker.py`` hands the directory to ``ray.train.report``.

Loaded with ``torch.load(weights_only=True)``, allowing only torch's default types (tensors, dicts,
lists, tuples, numbers, strings, None, OrderedDict): checkpoints sit on shared storage and every
node that resumes loads them, so a file that unpickles anything else (which could run code) is
refused, naming the file and the types (:class:`UnsafeCheckpointError`). A payload holds nothing
else (numpy's RNG state as plain values), so every torch of pyproject's range reads it the same
way; a checkpoint of an earlier raymcn, whose numpy RNG state pickled numpy objects, loads with
exactly those allowed where torch can allow them (2.5 and later).
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


# What checkpoints written before the numpy RNG state became plain values hold beyond torch's
# default allowlist: numpy's RNG state, ``np.random.get_state()``, whose key array pickles as an
# ndarray of a uint32 dtype, its bytes through ``_codecs.encode`` (in torch's default allowlist
# since 2.4; ``numpy.core`` is numpy 1's name of ``numpy._core``).
LEGACY_NUMPY_GLOBALS = frozenset({
    "numpy.ndarray", "numpy.dtype", "numpy.dtypes.UInt32DType", "_codecs.encode",
    "numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct"})


def pickled_globals(path: str | os.PathLike) -> set[str]:
    """Every ``module.name`` the pickle of the ``torch.save`` file ``path`` refers to (its GLOBAL
    opcodes: torch saves with pickle's protocol 2, and its ``weights_only`` unpickler refuses
    every other way of naming a global), read without unpickling anything.

    Raises:
        ValueError: ``path`` is not a ``torch.save`` archive holding a readable ``data.pkl``.
    """
    import pickletools
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.rpartition("/")[2] == "data.pkl"), None)
            if name is None:
                raise ValueError(f"{path} holds no data.pkl: not a checkpoint torch.save wrote")
            data = archive.read(name)
        return {".".join(arg.split(" ", 1)) for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}
    except (zipfile.BadZipFile, ValueError, EOFError) as e:  # pickletools: ValueError on a bad opcode
        raise ValueError(f"{path} is not a readable torch.save archive: {type(e).__name__}: {e}") from e


def unsafe_globals(path: str | os.PathLike) -> set[str]:
    """The pickled globals of ``path`` outside torch's default ``weights_only`` allowlist, e.g.
    ``{'builtins.exec'}``: torch's own answer (``get_unsafe_globals_in_checkpoint``, torch 2.6 and
    later), else :func:`pickled_globals` less the allowlist of torch's unpickler (older torch).

    Raises:
        ValueError: not a ``torch.save`` archive.
    """
    ask_torch = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if ask_torch is not None:
        return set(ask_torch(path))
    from torch import _weights_only_unpickler

    return pickled_globals(path) - set(_weights_only_unpickler._get_allowed_globals())


def foreign_types(path: str | os.PathLike) -> list[str]:
    """The pickled globals in the checkpoint file ``path`` that neither torch's default allowlist
    nor an earlier raymcn's payload (:data:`LEGACY_NUMPY_GLOBALS`) accounts for, sorted, e.g.
    ``['builtins.exec']``."""
    return sorted(unsafe_globals(path) - LEGACY_NUMPY_GLOBALS)


def _legacy_numpy_allowlist():
    """A context in which torch's ``weights_only`` load accepts :data:`LEGACY_NUMPY_GLOBALS`, or
    None where this torch cannot say so: ``safe_globals`` came in torch 2.5, and naming a global
    by another module's name (numpy 1's ``numpy.core``) in torch 2.6."""
    safe_globals = getattr(torch.serialization, "safe_globals", None)
    if safe_globals is None:
        return None
    numpy2 = int(np.__version__.split(".")[0]) >= 2
    reconstruct = (np._core if numpy2 else np.core).multiarray._reconstruct
    entries = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), reconstruct]
    if hasattr(torch.serialization, "get_unsafe_globals_in_checkpoint"):  # torch 2.6: (object, name) pairs too
        entries.append((reconstruct, f"numpy.{'core' if numpy2 else '_core'}.multiarray._reconstruct"))
    return safe_globals(entries)


def refusal(path: str | os.PathLike, types: list[str]) -> str:
    """The message that names a refused checkpoint file and what it holds."""
    return (f"checkpoint {path} holds pickled objects of types raymcn never saves ({', '.join(types)}); "
            "refused, since loading them could run code from the file. Resume from a checkpoint raymcn "
            "wrote, and find out who changed this one")


def rng_state() -> dict[str, Any]:
    """The host generators and, on a GPU, this process's device's generator only: a worker owns one
    GPU, and a resume may see fewer GPUs than the saving process did (another placement, fewer
    workers), where restoring one state per GPU of the saver fails."""
    state = {"torch": torch.get_rng_state(), "numpy": numpy_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def numpy_rng_state() -> tuple:
    """``np.random.get_state()`` in values torch's ``weights_only`` load accepts on every torch
    (no numpy object: an allowlist for numpy's came only in torch 2.5): (name, keys as an int64
    tensor (624,), position, has_gauss, cached_gaussian)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]  # keys: a tensor, or an earlier raymcn's uint32 ndarray
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
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
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # truncated or corrupted file, or a type outside the allowlist: say which
        unsafe = _unsafe_in(path)
        if unsafe - LEGACY_NUMPY_GLOBALS:
            raise UnsafeCheckpointError(refusal(shown, sorted(unsafe - LEGACY_NUMPY_GLOBALS))) from None
        if not unsafe:
            raise CheckpointError(f"checkpoint {shown} is unreadable: {type(e).__name__}: {e}") from e
        payload = _load_legacy(path, shown, mmap, e)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {shown} has an unknown format")
    return payload


def _unsafe_in(path: Path) -> set[str]:
    """:func:`unsafe_globals` of ``path``; none where it is not even a readable archive (then the
    load's own error says more)."""
    import pickle

    try:
        return unsafe_globals(path)
    except (ValueError, RuntimeError, OSError, EOFError, pickle.UnpicklingError):
        return set()


def _load_legacy(path: Path, shown, mmap: bool, error: Exception) -> dict[str, Any]:
    """The payload of a checkpoint an earlier raymcn wrote (numpy's RNG state as numpy objects:
    :data:`LEGACY_NUMPY_GLOBALS`), loaded with those allowed; ``error``: the plain load's."""
    allowing = _legacy_numpy_allowlist()
    if allowing is None:
        raise CheckpointError(f"checkpoint {shown} holds numpy's RNG state as numpy objects (an earlier raymcn "
                              f"wrote it), which torch {torch.__version__} cannot allow in a weights-only load "
                              "(torch 2.5 and later can): resume it once with such a torch") from error
    try:
        with allowing:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # damaged after all: say how
        raise CheckpointError(f"checkpoint {shown} is unreadable: {type(e).__name__}: {e}") from e


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
