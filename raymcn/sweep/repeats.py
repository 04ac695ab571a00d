"""``sweep.repeats: N``: every configuration a sweep proposes is trained N times, over seeds.

The seeds are ``run.seed``, ``run.seed + 1``, ... ``run.seed + N - 1``, written into each trial's
config as ``run.seed``, so a trial's ``params.json`` holds its seed and the results table pairs
trials that differ only in the grouping key (``results/stats.py``: same seed, same other keys).

* ``grid``: the seeds become one more grid axis (:func:`seed_axis`), so every grid cell is run
  once per seed. A grid sweep with keys drawn at random (loguniform ...) would draw them anew per
  seed, so those repeats would not be repeats: refused by ``config.validate_sweep``.
* every other algorithm: the searcher is wrapped in :class:`SeedRepeater`, which hands each
  suggestion out N times with the N seeds. The searcher sees one trial per configuration: the
  first repeat's intermediate results (BOHB's budgets, Optuna's pruning steps) and, when all
  repeats have ended, the mean of their final metric. Random search uses :class:`RandomSearcher`
  (Tune's variant generator is not a ``Searcher`` and cannot be wrapped).
"""

from __future__ import annotations

import math
import pickle
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from ray import tune
from ray.tune.search import Searcher

SEED_KEY = "run.seed"


def seeds(first: int, repeats: int) -> list[int]:
    """The seeds of ``repeats`` repeats: ``first``, ``first + 1``, ..."""
    return [first + i for i in range(repeats)]


def seed_axis(first: int, repeats: int):
    """``run.seed`` as a grid axis (the grid algorithm's repeats)."""
    return tune.grid_search(seeds(first, repeats))


class RandomSearcher(Searcher):
    """Random search as a ``Searcher``: every key of the Tune space drawn independently with a
    seeded generator (the domains' own samplers: loguniform, uniform, randint, choice)."""

    def __init__(self, seed: int):
        super().__init__()
        self.space: dict[str, Any] = {}
        self.rng = np.random.default_rng(seed)

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict, **spec) -> bool:
        """Tune hands over the param space here (the sweep's domains)."""
        self._metric, self._mode, self.space = metric, mode, dict(config)
        return True

    def suggest(self, trial_id: str) -> dict[str, Any]:
        return {k: (d.sample(random_state=self.rng) if hasattr(d, "sample") else d) for k, d in self.space.items()}

    def save(self, checkpoint_path: str) -> None:
        state = {"space": self.space, "metric": self._metric, "mode": self._mode, "rng": self.rng.bit_generator.state}
        Path(checkpoint_path).write_bytes(pickle.dumps(state))

    def restore(self, checkpoint_path: str) -> None:
        state = pickle.loads(Path(checkpoint_path).read_bytes())
        self.space, self._metric, self._mode = state["space"], state["metric"], state["mode"]
        self.rng.bit_generator.state = state["rng"]


class SeedRepeater(Searcher):
    """Hands every suggestion of ``searcher`` out once per seed (module doc).

    Tune's own ``Repeater`` forwards no intermediate results and no pause/unpause (which BOHB's
    scheduler calls), and writes a ``__trial_index__`` the results table cannot pair on; this one
    writes ``run.seed`` and forwards both, for the first repeat of each configuration.
    """

    def __init__(self, searcher: Searcher, seed_values: list[int]):
        super().__init__(metric=searcher.metric, mode=searcher.mode)
        self.searcher, self.seed_values = searcher, list(seed_values)
        self._groups: dict[str, dict[str, Any]] = {}  # trial id -> its group
        self._current: dict[str, Any] | None = None

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict, **spec) -> bool:
        ok = self.searcher.set_search_properties(metric, mode, config, **spec)
        if ok:
            self._metric, self._mode = metric, mode
        return ok

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        group = self._current
        if group is None or len(group["members"]) == len(self.seed_values):
            config = self.searcher.suggest(trial_id)
            if config is None or config == Searcher.FINISHED:
                return config
            group = self._current = {"primary": trial_id, "config": dict(config), "members": [], "scores": {}}
        seed = self.seed_values[len(group["members"])]
        group["members"].append(trial_id)
        self._groups[trial_id] = group
        return {**group["config"], SEED_KEY: seed}

    def _primary(self, trial_id: str) -> bool:
        group = self._groups.get(trial_id)
        return group is not None and group["primary"] == trial_id

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if self._primary(trial_id):
            self.searcher.on_trial_result(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        group = self._groups.get(trial_id)
        if group is None:
            return
        value = (result or {}).get(self.metric) if not error else None
        group["scores"][trial_id] = math.nan if value is None else float(value)
        if len(group["scores"]) < len(self.seed_values):
            return
        scores = [v for v in group["scores"].values() if not math.isnan(v)]
        if scores:
            self.searcher.on_trial_complete(group["primary"], result={self.metric: float(np.mean(scores))})
        else:
            self.searcher.on_trial_complete(group["primary"], result=None, error=True)

    def on_pause(self, trial_id: str) -> None:  # HyperBandForBOHB calls these on the searcher
        if self._primary(trial_id) and hasattr(self.searcher, "on_pause"):
            self.searcher.on_pause(trial_id)

    def on_unpause(self, trial_id: str) -> None:
        if self._primary(trial_id) and hasattr(self.searcher, "on_unpause"):
            self.searcher.on_unpause(trial_id)

    def save(self, checkpoint_path: str) -> None:
        with tempfile.TemporaryDirectory() as d:
            inner = Path(d) / "searcher.pkl"
            self.searcher.save(str(inner))
            state = {"groups": self._groups, "current": self._current, "inner": inner.read_bytes()}
        Path(checkpoint_path).write_bytes(pickle.dumps(state))

    def restore(self, checkpoint_path: str) -> None:
        state = pickle.loads(Path(checkpoint_path).read_bytes())
        self._groups, self._current = state["groups"], state["current"]
        with tempfile.TemporaryDirectory() as d:
            inner = Path(d) / "searcher.pkl"
            inner.write_bytes(state["inner"])
            self.searcher.restore(str(inner))
