"""``bench.sweep_efficiency``: the figures from a hand-made ledger (no Ray), and a short real BOHB run
(slow) checking the budget count and that paused trials resume from their checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import sweep_efficiency

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    return sweep_efficiency


def test_epochs_to_reach(bench):
    curve = [1.0, 5.0, 5.0, 9.0]
    assert bench.epochs_to_reach(curve, 5.0) == 2
    assert bench.epochs_to_reach(curve, 9.0) == 4
    assert bench.epochs_to_reach(curve, 9.5) is None
    assert bench.epochs_to_reach(curve, None) is None


def _run(alg, seed, curve, trials=3, full=1):
    return {"algorithm": alg, "seed": seed, "best": curve[-1], "curve": curve, "trials": trials,
            "full_trials": full, "repeated_epochs": 0, "errors": 0, "wall_s": 1.0}


def test_summarise_uses_each_seeds_random_best(bench):
    runs = [_run("random", 0, [1, 2, 3, 4, 6, 6]), _run("random", 1, [1, 2, 2, 2, 2, 3]),
            _run("asha", 0, [6, 6, 6, 6, 6, 6]), _run("asha", 1, [1, 3, 3, 3, 3, 3]),
            _run("bohb", 0, [1, 1, 1, 1, 1, 5]), _run("bohb", 1, [1, 1, 1, 1, 1, 4])]
    s = bench.summarise(runs, budget=6, seeds=[0, 1])
    a = s["algorithms"]
    assert s["random_best_per_seed"] == [6, 3] and s["random_best_mean"] == 4.5
    assert a["random"]["epochs_to_random_best_per_seed"] == [5, 6]
    assert a["asha"]["epochs_to_random_best_per_seed"] == [1, 2]
    assert a["asha"]["ratio_to_budget"]["mean"] == pytest.approx(1.5 / 6) and a["asha"]["meets_target"]
    # t-interval of (1/6, 2/6): mean 0.25, s = 0.1179, t(0.975, 1) = 12.706
    low, high = a["asha"]["ratio_to_budget"]["ci95"]
    assert (low, high) == pytest.approx((0.25 - 12.706 * 0.1179 / 2 ** 0.5, 0.25 + 12.706 * 0.1179 / 2 ** 0.5), rel=1e-3)
    assert not a["asha"]["interval_below_target"]
    # a seed that never reaches the target counts as the whole budget, not as left out
    assert a["bohb"]["epochs_to_random_best_per_seed"] == [None, 6] and a["bohb"]["reached"] == 1
    assert a["bohb"]["cost_per_seed"] == [6.0, 6.0] and a["bohb"]["ratio_to_budget"]["mean"] == 1.0
    assert not a["bohb"]["meets_target"]
    assert a["asha"]["best_r10"]["mean"] == pytest.approx(4.5)
    text = bench.table(s, 6, 2)
    assert "| asha |" in text and "asha: meets the target" in text and "bohb: misses the target" in text


@pytest.mark.slow
@pytest.mark.soak  # BOHB's pauses and resumes: also in test_rehearsals.py's bohb rehearsal (CI)
def test_bohb_run_counts_budget_and_resumes_paused_trials():
    """The benchmark at its smoke size (the suite's smoke run of it): BOHB alone over HyperBand's
    first bracket (--grace 1: 9 trials x 2 epochs, then the promoted trials resume), one trial at a
    time, so which trials HyperBand promotes does not depend on the order results arrive in (i.e.
    on the machine's speed)."""
    budget = sweep_efficiency.SMOKE["budget"]
    proc = subprocess.run([sys.executable, "-m", "bench.sweep_efficiency", "--smoke", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["settings"]["algorithms"] == ["bohb"] and out["settings"]["max_concurrent"] == 1
    run = out["runs"][0]
    assert run["epochs_counted"] == budget == len(run["curve"]) == len(run["log"])
    assert run["repeated_epochs"] == 0 and run["errors"] == 0
    epochs: dict[int, list[int]] = {}
    for trial, epoch, _ in run["log"]:
        epochs.setdefault(trial, []).append(epoch)
    for seq in epochs.values():  # each trial's epochs are 1, 2, 3, ... with no restart after a pause
        assert seq == list(range(1, len(seq) + 1))
    assert max(len(seq) for seq in epochs.values()) > 2, "no trial was resumed past the first rung"
    assert all(isinstance(v, (int, float, str)) for c in run["trial_configs"] for v in c.values())
