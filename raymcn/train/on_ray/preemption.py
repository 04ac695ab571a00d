"""Ray's side of a drained node (``raymcn drain``): the question the ranks ask, and Ray Train's
failure policy for the restart that follows. The decision when to ask is Ray-free
(``train/checkpoints/policy.py``).

Ray Train 2.60's preemption watcher (an actor per worker group, on unless
``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0``) polls Ray's drained nodes every
``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S`` (5 s) and marks every worker of a run with ranks on one;
``ray.train.get_preemption_info()`` hands rank 0's mark to every rank (a barrier). The controller
keeps the group training until the drain's deadline passes or the group ends, then restarts it from
the latest checkpoint, counted against ``FailureConfig.max_preemption_failures``, not
``max_failures``; a worker killed on a node drained for preemption counts as a preemption too.
raymcn's local instances turn the watcher off (``cluster.LOCAL_TRAIN_ENV``: one machine has no
other node to go on with, and the watcher costs an actor per run), and then its ranks never ask.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import ray.train

from raymcn.config import Config

# Ray Train 2.60's switch for the watcher (on when unset; set, on only for "1" or "true"), a public
# variable whose name Ray keeps in a private module: written here, and checked against Ray's in tests
WATCHER_VARIABLE = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


def watcher_on() -> bool:
    """Whether Ray Train runs its preemption watcher for this worker's run: the variable the
    controller decided by, which Ray Train passes from the driver to the controller and to every
    worker (its ``ENV_VARS_TO_PROPAGATE``), read as Ray reads it; raymcn's local instances set it to 0."""
    value = os.environ.get(WATCHER_VARIABLE)
    return True if value is None else value.lower() in ("1", "true")


def drain_question() -> Callable[[], Any] | None:
    """What a rank asks Ray Train to learn of a drain (``ray.train.get_preemption_info``, a barrier
    over the ranks), for the run's checkpoint policy; None when the watcher is off: the answer
    could only be None."""
    return ray.train.get_preemption_info if watcher_on() else None


def failure_config(cfg: Config) -> ray.train.FailureConfig:
    """Restarts after a lost worker or node (``scale.max_failures``) and, counted apart, after a
    drained node (``scale.max_preemption_failures``; -1: any number)."""
    return ray.train.FailureConfig(max_failures=cfg.scale.max_failures,
                                   max_preemption_failures=cfg.scale.max_preemption_failures)
