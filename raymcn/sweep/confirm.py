"""The confirmation phase's pieces for Tune: a fixed list of trial configs, and its base config.

What to confirm is chosen on the reading side (``results.confirmation``: the best configuration per
group, fresh seeds, the plan); ``tuner.run_confirmation`` runs it in ``EXP/confirm/`` with the
search's own trial function, so every confirmation trial is a Ray Train run like the search's,
resumable the same way.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from ray.tune.search import Searcher

from raymcn.config import Config


class FixedConfigs(Searcher):
    """Hands out a fixed list of trial configs in order, then says it is finished."""

    def __init__(self, configs: list[dict[str, Any]]):
        super().__init__()
        self.configs, self.handed = list(configs), 0

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict, **spec) -> bool:
        self._metric, self._mode = metric, mode
        return True

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        if self.handed >= len(self.configs):
            return Searcher.FINISHED
        self.handed += 1
        return dict(self.configs[self.handed - 1])

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        pass

    def save(self, checkpoint_path: str) -> None:
        Path(checkpoint_path).write_bytes(pickle.dumps({"configs": self.configs, "handed": self.handed,
                                                        "metric": self._metric, "mode": self._mode}))

    def restore(self, checkpoint_path: str) -> None:
        state = pickle.loads(Path(checkpoint_path).read_bytes())
        self.configs, self.handed, self._metric, self._mode = (state["configs"], state["handed"], state["metric"],
                                                               state["mode"])


def confirm_config(cfg: Config) -> Config:
    """The base config of the confirmation experiment: the search's, without a search of its own
    (its ``raymcn_sweep.yaml`` tells the tables the full budget, ``schedule.epochs``)."""
    return cfg.replace({"sweep.space": {}, "sweep.algorithm": "grid", "sweep.repeats": 1, "sweep.confirm": {}})
