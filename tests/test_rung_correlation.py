"""``bench.rung_correlation``: its statistics on fixed inputs, and the benchmark at its smoke size:
configurations trained through the run assembly under both arms (the warm-up in steps before, in
videos after)."""

from __future__ import annotations

import json
import math

import pytest

from bench import rung_correlation


@pytest.fixture(scope="module")
def bench():
    return rung_correlation


def test_spearman_interval(bench):
    rho, low, high = bench.spearman_interval([1, 2, 3, 4, 5], [10, 20, 30, 40, 50])
    assert rho == pytest.approx(1.0) and (low, high) == pytest.approx((1.0, 1.0))  # perfect agreement: no spread
    assert bench.spearman_interval([1, 2, 3, 4, 5], [5, 4, 3, 2, 1])[0] == pytest.approx(-1.0)
    rho, low, high = bench.spearman_interval([1, 2, 3, 4, 5, 6], [1, 3, 2, 4, 6, 5])
    assert low < rho < high and rho == pytest.approx(1 - 6 * 4 / (6 * 35))  # two swapped pairs: Σd² = 4
    assert all(math.isnan(v) for v in bench.spearman_interval([1, 2, 3], [1, 2, 3]))  # too few pairs
    assert all(math.isnan(v) for v in bench.spearman_interval([1, 1, 1, 1], [1, 2, 3, 4]))  # a constant rung


def test_correlations_rank_each_epoch_against_the_last(bench):
    curves = {"after": [[1, 5, 9], [2, 6, 8], [3, 7, 7], [4, 8, 6]]}  # epoch 1 ranks opposite to the end
    rows = bench.correlations(curves, epochs=3)
    assert [r["epoch"] for r in rows] == [1, 2, 3] and [r["rung (budget_epoch)"] for r in rows] == [0, 1, 2]
    assert [r["after rho"] for r in rows] == pytest.approx([-1.0, -1.0, 1.0])


@pytest.mark.slow  # trains every configuration twice: the full tier
@pytest.mark.soak  # a benchmark's smoke: before a release
def test_the_benchmark_trains_every_configuration_under_both_arms(bench, tmp_path):
    """The benchmark at its smoke size (the suite's smoke run of it): 4 drawn configurations x 2
    epochs on the 64-video corpus, each under both warm-ups (one run where they coincide)."""
    out = tmp_path / "rung.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert not (tmp_path / "rung.json.partial").exists()
    runs = {(r["config"], r["arm"]): r for r in figures["runs"]}
    assert sorted(runs) == [(i, arm) for i in range(4) for arm in ("after", "before")]
    for (i, arm), run in runs.items():
        batch = figures["configs"][i]["data.batch_size"]
        assert len(run["curve"]) == 2 and not run["diverged"] and all(0 <= r <= 100 for r in run["curve"])
        assert run["steps_per_epoch"] == 64 // batch
        # before: a fixed 16 steps at any batch size; after: 256 videos, i.e. 256 // batch steps
        assert run["warmup_steps"] == (16 if arm == "before" else 256 // batch)
    assert figures["kept"] == [0, 1, 2, 3] and [r["epoch"] for r in figures["rows"]] == [1, 2]
