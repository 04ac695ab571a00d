"""The room a run's checkpoints take in its storage: checked before the GPU-hours, named when a write fails.

One checkpoint (``state.pt``, ``payload.py``) holds the model's state, Adam's two fp32 moments per
parameter, the clustering queue and centroids, the loop counters and the RNG states:
:func:`checkpoint_bytes` estimates it from the config (the model built on the meta device, nothing
allocated), to within a few kilobytes of what ``torch.save`` writes (``tests/test_storage_space.py``).
Ray Train keeps ``run.checkpoints_to_keep`` of them by ``sweep.metric`` and the latest, and writes
the next one beside them before it deletes the one that drops out: :func:`held_at_once`, per trial
(a sweep runs ``sweep.max_concurrent`` trials at once, each with its own).

:func:`space_problems` is the preflight's check (and ``raymcn doctor``'s row); :func:`storage_error`
the message of a write that failed because the storage cannot take it (full, over quota, read-only),
which ends a run at once instead of restarting it into the same wall.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from raymcn import storage
from raymcn.config import Config, StorageError, default_storage_path, is_storage_error
from raymcn.storage import size_text

FP32 = 4
QUEUE_ITEMSIZE = {"float32": 4, "bfloat16": 2}
# torch.save's zip archive: a record per tensor (header, name, 64-byte alignment) and the pickled
# structure around them; the RNG states (numpy's 624 words, torch's 5 kB) and the config. Upper
# bounds of what the checkpoints of the shipped configs hold (tests/test_storage_space.py).
PER_TENSOR_BYTES = 256
FIXED_BYTES = 64 * 1024


def checkpoint_bytes(cfg: Config) -> int:
    """The bytes of one checkpoint of ``cfg`` once its optimizer has stepped and its queue is full
    (the size every checkpoint after the first few steps has)."""
    import torch

    from raymcn.model import MCN

    with torch.device("meta"):
        net = MCN(cfg.model)
    state = net.state_dict()
    params = list(net.parameters())
    tensors = len(state) + 3 * len(params)  # the state, and per parameter Adam's two moments and its step
    queue = cfg.queue_rows * cfg.model.embed_dim * QUEUE_ITEMSIZE[cfg.loss.queue_dtype]
    return (sum(t.numel() * t.element_size() for t in state.values()) + 2 * FP32 * sum(p.numel() for p in params)
            + queue + cfg.loss.num_clusters * cfg.model.embed_dim * FP32
            + tensors * PER_TENSOR_BYTES + FIXED_BYTES)


def held_at_once(cfg: Config) -> int:
    """Checkpoints of one run on its storage at most: the ``run.checkpoints_to_keep`` best, the
    latest, and the next one being written before the one that drops out is deleted."""
    return cfg.run.checkpoints_to_keep + 2


def _kept(cfg: Config) -> str:
    return (f"a run keeps {cfg.run.checkpoints_to_keep + 1} (run.checkpoints_to_keep={cfg.run.checkpoints_to_keep} "
            "by sweep.metric, and the latest) and writes the next before it drops one")


@dataclass(frozen=True)
class Need:
    """What a run (or ``trials`` runs at once) writes into its storage at most, beyond what it
    holds there already (``held``: a resumed run's checkpoints)."""

    checkpoint: int
    count: int
    trials: int = 1
    held: int = 0

    @property
    def total(self) -> int:
        return max(0, self.checkpoint * self.count * self.trials - self.held)

    def text(self, setting: bool = True) -> str:
        """``4 x 14.1 MB = 56.3 MB``, with the trials at once (``setting``: naming their setting) and
        what is held already."""
        named = " (sweep.max_concurrent)" if setting else ""
        trials = f" x {self.trials} trials at once{named}" if self.trials > 1 else ""
        held = f" - {size_text(self.held)} its checkpoints hold already" if self.held else ""
        return f"{self.count} x {size_text(self.checkpoint)}{trials}{held} = {size_text(self.total)}"


def need_of(cfg: Config, trials: int = 1, held: int = 0) -> Need:
    return Need(checkpoint_bytes(cfg), held_at_once(cfg), trials, held)


def space_problems(cfg: Config, trials: int = 1, held: int = 0) -> tuple[list[str], list[str]]:
    """(problems, notes) of the storage's free space against what ``trials`` runs of ``cfg`` at
    once write (:class:`Need`; ``held``: bytes a resumed run's checkpoints hold there already). A
    bucket URI is not checked: the note says so."""
    where = storage.normalize(default_storage_path(cfg))
    space = storage.space_at(where)
    if space is None:
        return [], [f"storage: {where} is an object store: its free space is not checked"]
    need = need_of(cfg, trials, held)
    if need.total <= space.free:
        # (a note on the console: short enough for a terminal's line with the user's path in it)
        return [], [f"storage: the checkpoints take at most {need.text(setting=False)}; {size_text(space.free)} "
                    f"free at {space.named()}"]
    return [f"run.storage_path={where!r}: the checkpoints do not fit: {_kept(cfg)}, at most {need.text()}, and "
            f"{size_text(space.free)} are free at {space.named()}: short by {size_text(need.total - space.free)}. "
            f"{REMEDY}"], []


REMEDY = ("Free space there, lower run.checkpoints_to_keep, or point RAYMCN_RESULTS (run.storage_path) at a larger "
          "disk")


def storage_error(error: OSError | StorageError, where: str, cfg: Config, *, size: int | None = None,
                  what: str = "a write", fix: str = "") -> StorageError:
    """The :class:`StorageError` of ``error`` (a storage ``OSError``, or already one: returned as
    it is) at ``where`` (a path or URI): what failed and why, the filesystem and its free bytes, one
    checkpoint's size (``size``, else :func:`checkpoint_bytes`) and how many the run keeps, and
    what to do (``fix``, else the storage's remedies). Resuming is the caller's line (it knows the
    command)."""
    if isinstance(error, StorageError):
        return error
    code = error.errno or errno.ENOSPC
    space = storage.space_at(where)
    at = (f"{space.named()}: {size_text(space.free)} free of {size_text(space.total)}" if space is not None
          else f"{where} (an object store)")
    size = checkpoint_bytes(cfg) if size is None else size
    fix = fix or {errno.EROFS: "Make it writable, or point RAYMCN_RESULTS (run.storage_path) at a writable disk",
                  errno.EDQUOT: "Ask for a larger quota, " + REMEDY[0].lower() + REMEDY[1:]}.get(code, REMEDY)
    return StorageError(f"{what} failed: {os.strerror(code)}, at {at}. One checkpoint is {size_text(size)}; "
                        f"{_kept(cfg)}: {size_text(size * held_at_once(cfg))} at most. Nothing partial is left "
                        f"under a checkpoint's name. {fix}", code)


def explained(error: BaseException, where: str, cfg: Config) -> str:
    """What a person is shown of a storage ``error`` that ended a run writing to ``where``."""
    if isinstance(error, StorageError) or not is_storage_error(error):
        return str(error)
    return str(storage_error(error, where, cfg))


def folder_bytes(folder: str | os.PathLike) -> int:
    """Bytes of the files in the local ``folder`` and below."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
