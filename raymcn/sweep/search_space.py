"""The ``sweep.space`` section of a YAML file -> a Ray Tune search space over dotted config keys.

The keys are the config's own dotted keys (``optim.lr``); the values were already checked by
``config.validate_sweep`` before Ray starts, so this module only translates.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from ray import tune

from raymcn.config import SweepConfig


def to_domain(spec: dict[str, Any], grid: bool = False):
    """``{loguniform: [lo, hi]}`` / ``{uniform: ...}`` / ``{randint: [lo, hi]}`` (hi inclusive) /
    ``{choice: [...]}`` / ``{grid: [...]}`` -> a Tune domain. With ``grid`` (the grid algorithm)
    categorical choices become grid axes."""
    domain, args = next(iter(spec.items()))
    if domain == "loguniform":
        return tune.loguniform(float(args[0]), float(args[1]))
    if domain == "uniform":
        return tune.uniform(float(args[0]), float(args[1]))
    if domain == "randint":
        return tune.randint(int(args[0]), int(args[1]) + 1)  # Tune's upper bound is exclusive
    if domain == "grid" or (grid and domain == "choice"):
        return tune.grid_search(list(args))
    return tune.choice(list(args))


def param_space(sweep: SweepConfig) -> dict[str, Any]:
    grid = sweep.algorithm == "grid"
    return {key: to_domain(spec, grid) for key, spec in sweep.space.items()}


def plain(config: dict[str, Any]) -> dict[str, Any]:
    """Numpy scalars (BOHB returns ``np.int64``, ``np.str_``) -> Python values, so configs serialise."""
    return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in config.items()}
