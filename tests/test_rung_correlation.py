"""``bench/rung_correlation.py``: its statistics on fixed inputs, and one real configuration trained
through the run assembly under both arms (the warm-up in steps before, in videos after)."""

from __future__ import annotations

import math

import pytest
from conftest import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("rung_correlation")


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


def test_one_configuration_trains_under_both_arms(bench):
    config = {"optim.lr": 1e-3, "data.batch_size": 8, "loss.num_clusters": 8, "schedule.stage_order": "AV_T"}
    before = bench.train_curve(config, bench.ARMS["before"], epochs=2)
    after = bench.train_curve(config, bench.ARMS["after"], epochs=2)
    for run in (before, after):
        assert len(run["curve"]) == 2 and not run["diverged"]
        assert all(0 <= r <= 100 for r in run["curve"])
    assert before["steps_per_epoch"] == after["steps_per_epoch"] == 256 // 8
    assert before["warmup_steps"] == 16  # a fixed step count: half an epoch at batch 8
    assert after["warmup_steps"] == 256 // 8  # 256 videos: one epoch at any batch size
