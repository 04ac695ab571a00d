"""Stage orders: which modalities are active at each global step.

``AV_T`` trains audio and video first and adds text in stage 2; ``VT_A`` and ``AT_V`` likewise;
``joint`` uses all three from the start. The switch is a fraction of the run's step budget, so
a sweep's rungs can be placed after it (fair early stopping across orders).
"""

from __future__ import annotations

import math

from raymcn.config import MODALITIES, STAGE_ORDERS

_LETTER = {"A": "audio", "V": "video", "T": "text"}
ALL = frozenset(MODALITIES)


def first_stage(stage_order: str) -> frozenset[str]:
    """Modalities active in stage 1 (all three for ``joint``)."""
    if stage_order not in STAGE_ORDERS:
        raise ValueError(f"schedule.stage_order={stage_order!r}: allowed values are {', '.join(STAGE_ORDERS)}")
    if stage_order == "joint":
        return ALL
    return frozenset(_LETTER[c] for c in stage_order.split("_")[0])


def switch_step(stage_order: str, stage1_fraction: float, total_steps: int) -> int:
    """First global step of stage 2 (0 for ``joint``: there is only one stage)."""
    if stage_order == "joint":
        return 0
    return int(math.ceil(stage1_fraction * total_steps))


def active_modalities(stage_order: str, step: int, switch: int) -> frozenset[str]:
    """The set of modalities that take part in the loss at global ``step``."""
    return ALL if step >= switch else first_stage(stage_order)


def stage_of(stage_order: str, step: int, switch: int) -> int:
    """1 or 2 (``joint`` has a single stage, numbered 1)."""
    if stage_order == "joint":
        return 1
    return 1 if step < switch else 2


def budget_offset(stage1_fraction: float, epochs: int) -> int:
    """Epochs of stage 1, rounded up: the schedulers' clock starts after them (:func:`budget_epoch`)."""
    return int(math.ceil(stage1_fraction * epochs))


def budget_epoch(epoch: int, stage1_fraction: float, epochs: int) -> int:
    """Epochs completed since every stage order has all three modalities active.

    Sweep schedulers use this as their clock (not Tune's ``training_iteration``, which restarts
    when BOHB pauses a trial), so no rung can fall inside stage 1 and a staged order is never
    stopped only because its third modality has not started. The offset is the same for every
    trial of a sweep (``joint`` included), so every rung compares runs after equal total epochs.
    """
    return epoch - budget_offset(stage1_fraction, epochs)
