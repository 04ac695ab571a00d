"""``sweep.repeats``: every configuration over seeds, with ``run.seed`` in each trial's config so the
results table pairs the repeats. Without a Ray instance (the searchers are driven by hand); the
real sweep is ``tests/test_sweep_console.py``."""

from __future__ import annotations

import math

import pytest
from conftest import preset

from raymcn.config import ConfigError

pytest.importorskip("ray")

from ray.tune.search import Searcher  # noqa: E402

from raymcn.sweep.repeats import RandomSearcher, SeedRepeater  # noqa: E402
from raymcn.sweep.tuner import build_search, num_samples, search_space  # noqa: E402


class Recorder(Searcher):
    """A searcher that proposes lr = 1, 2, 3 ... and records what it is told."""

    def __init__(self):
        super().__init__(metric="m", mode="max")
        self.n, self.results, self.completed, self.paused = 0, [], [], []

    def suggest(self, trial_id):
        self.n += 1
        return {"optim.lr": float(self.n)}

    def on_trial_result(self, trial_id, result):
        self.results.append((trial_id, result["m"]))

    def on_trial_complete(self, trial_id, result=None, error=False):
        self.completed.append((trial_id, None if result is None else result["m"], error))

    def on_pause(self, trial_id):
        self.paused.append(trial_id)


def test_each_suggestion_is_handed_out_once_per_seed():
    inner = Recorder()
    rep = SeedRepeater(inner, [1, 2, 3])
    configs = {f"t{i}": rep.suggest(f"t{i}") for i in range(6)}
    assert [c["optim.lr"] for c in configs.values()] == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    assert [c["run.seed"] for c in configs.values()] == [1, 2, 3, 1, 2, 3]
    # the searcher sees one trial per configuration: the first repeat's results and pauses ...
    for tid in ("t0", "t1", "t2"):
        rep.on_trial_result(tid, {"m": 5.0})
        rep.on_pause(tid)
    assert inner.results == [("t0", 5.0)] and inner.paused == ["t0"]
    # ... and, once every repeat has ended, the mean of their final metric
    rep.on_trial_complete("t1", {"m": 10.0})
    rep.on_trial_complete("t0", {"m": 20.0})
    assert inner.completed == []
    rep.on_trial_complete("t2", None, error=True)  # an errored repeat does not count
    assert inner.completed == [("t0", 15.0, False)]
    for tid in ("t3", "t4", "t5"):
        rep.on_trial_complete(tid, None, error=True)
    assert inner.completed[-1] == ("t3", None, True)


def test_repeater_state_survives_save_and_restore(tmp_path):
    inner = RandomSearcher(seed=0)
    from ray import tune

    inner.set_search_properties("m", "max", {"optim.lr": tune.loguniform(1e-4, 1e-2)})
    rep = SeedRepeater(inner, [1, 2])
    first = rep.suggest("a")
    rep.save(str(tmp_path / "state"))
    second = rep.suggest("b")
    restored = SeedRepeater(RandomSearcher(seed=99), [1, 2])
    restored.restore(str(tmp_path / "state"))
    assert restored.suggest("b") == second == {**first, "run.seed": 2}
    assert restored.suggest("c") == rep.suggest("c")  # the random generator's state came back too


LR = {"optim.lr": {"loguniform": [1e-4, 1e-2]}}


def _sweep(**sweep) -> dict:
    """The dotted ``sweep.*`` settings of ``sweep`` (default: the LR space, no confirmation)."""
    return {f"sweep.{k}": v for k, v in {"space": LR, "confirm": {}, **sweep}.items()}


def test_grid_repeats_are_a_seed_axis_and_other_algorithms_wrap_their_searcher():
    from ray.tune.search.basic_variant import BasicVariantGenerator
    from ray.tune.search.bohb import TuneBOHB

    orders = {"schedule.stage_order": {"grid": ["AV_T", "joint"]}}
    grid = preset(_sweep(algorithm="grid", repeats=3, num_samples=1, space=orders))
    assert search_space(grid)["run.seed"] == {"grid_search": [1, 2, 3]} and num_samples(grid) == 1
    assert isinstance(build_search(grid)[0], BasicVariantGenerator)
    for algorithm, inner in (("random", RandomSearcher), ("asha", RandomSearcher), ("bohb", TuneBOHB)):
        cfg = preset(_sweep(algorithm=algorithm, repeats=3, num_samples=4))
        search, _ = build_search(cfg)
        assert isinstance(search, SeedRepeater) and isinstance(search.searcher, inner)
        assert search.seed_values == [1, 2, 3] and num_samples(cfg) == 12 and "run.seed" not in search_space(cfg)
    # repeats: 1 is unchanged
    assert not isinstance(build_search(preset(_sweep(algorithm="asha", repeats=1)))[0], SeedRepeater)


@pytest.mark.parametrize("sweep, fragment", [
    ({"repeats": 2, "space": {"run.seed": {"choice": [1, 2]}}}, "run.seed is also in sweep.space"),
    ({"repeats": 2, "algorithm": "grid", "space": {"optim.lr": {"loguniform": [1e-4, 1e-3]}}},
     "optim.lr would be drawn anew for every seed"),
    ({"repeats": 0}, "sweep.repeats=0: must be >= 1"),
    ({"repeats": 2, "algorithm": "random", "space": {"schedule.stage_order": {"grid": ["AV_T", "joint"]}}},
     "schedule.stage_order is a grid domain, which only the grid algorithm enumerates"),
])
def test_repeats_refused_where_they_would_not_repeat(sweep, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.").replace("(", r"\(")):
        preset(_sweep(**sweep))


def test_random_searcher_draws_each_domain():
    from ray import tune

    s = RandomSearcher(seed=3)
    assert s.set_search_properties("m", "max", {"optim.lr": tune.loguniform(1e-4, 1e-2),
                                                 "data.batch_size": tune.choice([8, 16])})
    draws = [s.suggest(str(i)) for i in range(50)]
    assert all(1e-4 <= d["optim.lr"] <= 1e-2 for d in draws) and {d["data.batch_size"] for d in draws} == {8, 16}
    assert not math.isclose(draws[0]["optim.lr"], draws[1]["optim.lr"])
