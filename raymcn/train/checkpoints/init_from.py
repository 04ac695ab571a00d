"""Start a run from existing weights: ``run.init_from`` (``raymcn train|sweep --init-from DIR``). No Ray.

Only the model's parameters and BN statistics are taken from the checkpoint (an imported original
or any raymcn checkpoint). The optimizer, the LR schedule with its warm-up, the global step, the
queue and the centroids start fresh: this is a new run, not a resume (``--resume`` continues a
run with all of its state). In a sweep every trial starts from the same weights, so the
architecture (``model.*``) cannot be swept together with ``run.init_from``.

The driver checks the checkpoint before Ray starts (:func:`problems`, called by the preflight);
every worker then loads it into the bare model before the DDP wrap (:func:`load_weights`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from raymcn.config import RUN_CONFIG_FILE, Config, ModelConfig
from raymcn.train.checkpoints import payload as checkpoint
from raymcn.train.checkpoints.payload import CheckpointError

INIT_KEY = "run.init_from"
_LISTED = 5  # keys named per kind of mismatch before "... and N more"


def checkpoint_dir(path: str | os.PathLike) -> Path:
    """The checkpoint directory named by ``path`` (the directory itself or its state.pt).

    Raises:
        CheckpointError: the path does not exist, or is a run directory (naming its latest checkpoint).
    """
    path = Path(path).expanduser()
    if path.is_file() and path.name == checkpoint.STATE_FILE:
        return path.parent
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if path.is_dir() and not (path / checkpoint.STATE_FILE).exists():
        runs = checkpoint.list_checkpoints(path)
        if runs:
            raise CheckpointError(f"{path} is a run directory, not a checkpoint; pass one of its checkpoints, "
                                  f"e.g. the latest: {runs[-1]}")
        raise CheckpointError(f"{path} holds no {checkpoint.STATE_FILE}; expected a raymcn checkpoint directory "
                              "(from a run, or written by `raymcn import-original`)")
    if not path.is_dir():
        raise CheckpointError(f"{path} is neither a checkpoint directory nor its {checkpoint.STATE_FILE} (a checkpoint "
                              "of the original code is imported first: raymcn import-original FILE --out DIR)")
    return path


def read_model_state(path: str | os.PathLike, mmap: bool = True) -> tuple[dict[str, torch.Tensor], dict | None]:
    """(model state dict, the checkpoint's model settings or None) of the checkpoint at ``path``.

    With ``mmap`` the tensors are mapped, not read: the driver's shape check costs almost nothing.
    """
    directory = checkpoint_dir(path)
    payload = checkpoint.load(directory, mmap=mmap)
    if not isinstance(payload.get("model"), dict):
        raise CheckpointError(f"{directory / checkpoint.STATE_FILE} holds no model weights")
    model_cfg = (payload.get("config") or {}).get("model")
    return payload["model"], model_cfg


def _listed(kind: str, keys: list[str]) -> list[str]:
    if not keys:
        return []
    more = f" and {len(keys) - _LISTED} more" if len(keys) > _LISTED else ""
    return [f"{kind}: {', '.join(keys[:_LISTED])}{more}"]


def mismatch(state: dict[str, torch.Tensor], cfg: ModelConfig) -> list[str]:
    """Why ``state`` does not load strictly into ``MCN(cfg)``: missing, unexpected and wrong-shape keys."""
    from raymcn.model.original import expected_shapes  # MCN on the meta device: allocates nothing

    expected = expected_shapes(cfg)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    return (_listed("missing", [k for k in expected if k not in shapes])
            + _listed("unexpected", [k for k in shapes if k not in expected])
            + _listed("wrong shape", [f"{k} {shapes[k]} (the run needs {expected[k]})"
                                      for k in expected if k in shapes and shapes[k] != expected[k]]))


def _fix_hint(path: Path, ckpt_model: dict | None, cfg: ModelConfig) -> str:
    """Which model settings differ, and which config file carries the checkpoint's."""
    ours = Config(model=cfg).to_dict()["model"]
    # a setting an older checkpoint's config lacks had its default then (e.g. the model's parts)
    theirs = {**Config().to_dict()["model"], **ckpt_model} if ckpt_model else {}
    diffs = [f"model.{k}: the checkpoint has {v!r}, this run {ours[k]!r}"
             for k, v in theirs.items() if k in ours and ours[k] != v]
    # Only an imported checkpoint's own config is suggested whole: a run's saved config may carry
    # its run.name, and reusing that name would silently resume the old run instead of a new one.
    own = path / RUN_CONFIG_FILE
    hint = f"; use the checkpoint's settings, e.g. --config {own}" if own.is_file() else \
        "; set model.* to the checkpoint's values"
    return ("; ".join(diffs) or "same model settings, different tensors") + hint


def compatibility_problems(path: str | os.PathLike, cfg: ModelConfig) -> list[str]:
    """Problems (empty if none) with starting a run of model settings ``cfg`` from ``path``."""
    where = f"{INIT_KEY}={str(path)!r}"
    try:
        directory = checkpoint_dir(path)
        state, ckpt_model = read_model_state(directory)
    except CheckpointError as e:
        return [f"{where}: {e}"]
    found = mismatch(state, cfg)
    if not found:
        return []
    return [f"{where}: its weights do not fit this run's model ({_fix_hint(directory, ckpt_model, cfg)}): "
            + "; ".join(found)]


def problems(cfg: Config) -> list[str]:
    """Every ``run.init_from`` problem of a run or sweep config, for the preflight (before Ray starts).

    A sweep may list several starting points as ``run.init_from: {choice: [...]}``; each is checked.
    """
    space = cfg.sweep.space
    values = [cfg.run.init_from]
    if isinstance(space.get(INIT_KEY), dict):
        values += [v for v in next(iter(space[INIT_KEY].values()), []) if isinstance(v, str)]
    values = list(dict.fromkeys(v for v in values if v))
    if not values:
        return []
    found = []
    swept_model = sorted(k for k in space if k.startswith("model."))
    if swept_model:
        found.append(f"sweep.space sweeps {', '.join(swept_model)} while {INIT_KEY} is set: every trial starts "
                     "from the same weights, so the model architecture cannot differ between trials")
    for value in values:
        found += compatibility_problems(value, cfg.model)
    return found


def load_weights(model: nn.Module, path: str | os.PathLike) -> Path:
    """Load the model weights of the checkpoint at ``path`` into ``model`` (the bare MCN, before DDP).

    Strict: a missing, unexpected or wrong-shape tensor raises instead of leaving a partly random
    model (the original's silent strict=False fallback). Returns the state.pt read.

    Raises:
        CheckpointError: naming the path and the offending keys.
    """
    directory = checkpoint_dir(path)
    state, ckpt_model = read_model_state(directory)
    cfg = getattr(model, "cfg", None)
    found = mismatch(state, cfg) if isinstance(cfg, ModelConfig) else []
    if found:
        raise CheckpointError(f"{directory}: its weights do not fit the model ({_fix_hint(directory, ckpt_model, cfg)})"
                              f": " + "; ".join(found))
    model.load_state_dict(state, strict=True)
    return directory / checkpoint.STATE_FILE
