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


def budget_epoch(epoch: int, offset: int) -> int:
    """The sweep schedulers' clock after ``epoch`` completed epochs of a run whose stage 1 lasts
    ``offset`` epochs (``Config.stage1_epochs``): the epochs completed since every stage order has
    all three modalities, 0 throughout stage 1.

    Tune's schedulers read it instead of their ``training_iteration``: BOHB pauses trials, and a
    resumed trial's iteration count restarts while its Train run resumes from its checkpoint.

    * Valid for every scheduler at every report: never negative (HyperBand asserts that), 0 in
      stage 1, then 1, 2, ... up to ``max_t`` = epochs - offset.
    * No rung falls inside stage 1: every rung lies at ``sweep.grace_epochs`` >= 1 or later, and
      the clock reaches 1 only at the first epoch end after the offset. While it reads 0, ASHA
      has nothing to compare and HyperBand only counts the trial as not yet at its rung.
    * Every rung compares runs after equal total epochs: the offset is the same for every trial
      of a sweep (``joint`` included), so clock value r means epoch offset + r for all of them.
    * BOHB's pause and resume keep it: HyperBand pauses a trial at the report whose clock reaches
      its rung; that epoch's checkpoint goes with the report, the resumed Train run restarts from
      it, and its next report reads rung + 1. The clock is a function of the epoch alone, never of
      how often the trial was paused or restarted.
    """
    return max(0, epoch - offset)
