"""Readable trial directory names, e.g. ``AV_T-lr3e-4-bs16-seed1-a1b2c_00003``.

TensorBoard names each run after its directory below ``--logdir``, so ``tensorboard --logdir EXP``
lists trials by what distinguishes them instead of Tune's default
``trial_fn_a1b2c_00003_3_data.batch_size=16,optim.lr=0.0003,..._2026-01-01_12-00-00``. Passed to
Tune as ``TuneConfig(trial_dirname_creator=trial_dirname_creator)``. Imports no Ray: the name is
a pure function of the trial's config and id, so it is tested without Ray and a restored trial
gets the same name again.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

# Short labels for the keys the lab sweeps most; the stage order is written bare, first.
SHORT = {"optim.lr": "lr", "data.batch_size": "bs", "loss.num_clusters": "K", "run.seed": "seed"}
STAGE_KEY = "schedule.stage_order"
MAX_CONFIG_CHARS = 80  # the config part; the trial id after it keeps every name unique
_UNSAFE = re.compile(r"[^A-Za-z0-9._+=-]")  # Tune rejects '/', and these survive any file system and shell


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def format_value(value: Any) -> str:
    """Compact and file-name safe: 0.0003 -> ``3e-4``, 0.00033 -> ``3.3e-4``, 0.5 -> ``0.5``,
    16 -> ``16``, True -> ``true``; other text with unsafe characters replaced by ``_``."""
    if isinstance(value, bool):
        return str(value).lower()
    if hasattr(value, "item"):  # numpy scalars (BOHB suggests np.float64 / np.str_)
        value = value.item()
    if isinstance(value, float) and math.isfinite(value) and value != int(value) and abs(value) < 1e-2:
        mantissa, exp = f"{value:.1e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exp)}"
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.3g}"
    return _UNSAFE.sub("_", str(value))


def trial_dirname(config: Mapping[str, Any], trial_id: str) -> str:
    """``<stage order>-<key><value>-...-<trial_id>``: the stage order bare, then lr, bs, K, seed
    (when in ``config``), then every other key by its last dotted part (``margin0.001``), sorted.
    The config part is cut at :data:`MAX_CONFIG_CHARS`; the trial id keeps names unique. Never
    contains ``/`` or characters outside ``[A-Za-z0-9._+=-]``."""
    flat = _flat(config)
    parts = [format_value(flat.pop(STAGE_KEY))] if STAGE_KEY in flat else []
    parts += [f"{short}{format_value(flat.pop(key))}" for key, short in SHORT.items() if key in flat]
    parts += [f"{_UNSAFE.sub('_', key.rsplit('.', 1)[-1])}{format_value(v)}" for key, v in sorted(flat.items())]
    head = "-".join(parts)[:MAX_CONFIG_CHARS].rstrip("-")
    tail = _UNSAFE.sub("_", str(trial_id))
    return f"{head}-{tail}" if head else tail


def trial_dirname_creator(trial: Any) -> str:
    """Tune's ``trial_dirname_creator``: any object with ``config`` and ``trial_id`` (a Tune Trial)."""
    return trial_dirname(trial.config, trial.trial_id)
