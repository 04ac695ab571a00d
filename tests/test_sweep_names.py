"""Readable trial directory names (``sweep.names``) and their wiring into the sweep's Tuner,
tested without starting Ray."""

from __future__ import annotations

import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from raymcn.sweep.names import format_value, trial_dirname, trial_dirname_creator


def test_trial_dirname_is_short_readable_and_unique():
    cfg = {"optim.lr": 3e-4, "data.batch_size": 16, "schedule.stage_order": "AV_T", "run.seed": 1}
    assert trial_dirname(cfg, "a1b2c_00003") == "AV_T-lr3e-4-bs16-seed1-a1b2c_00003"
    assert trial_dirname(cfg, "a1b2c_00004") != trial_dirname(cfg, "a1b2c_00003")  # same config, two trials
    np = pytest.importorskip("numpy")
    bohb = {"schedule.stage_order": np.str_("joint"), "loss.num_clusters": np.int64(256),
            "optim.lr": np.float64(0.000329), "loss.margin": 0.001}
    assert trial_dirname(bohb, "x_1") == "joint-lr3.3e-4-K256-margin1e-3-x_1"
    assert trial_dirname({"data": {"batch_size": 8}}, "x_2") == "bs8-x_2"  # nested configs are flattened
    assert trial_dirname({}, "x_3") == "x_3"
    odd = trial_dirname({"data.shards": "/data/shards v2", "loss.note": "a:b|c" * 40}, "x_4")
    assert "/" not in odd and re.fullmatch(r"[A-Za-z0-9._+=-]+", odd) and odd.endswith("-x_4")
    assert len(odd) <= 80 + 1 + len("x_4")
    assert [format_value(v) for v in (1e-5, 0.05, 2.0, 16, True, 1e5)] == ["1e-5", "0.05", "2", "16", "true", "1e+05"]


def test_trial_dirname_creator_reads_a_tune_trial():
    trial = SimpleNamespace(config={"schedule.stage_order": "VT_A", "optim.lr": 1e-4}, trial_id="f00d_00001")
    assert trial_dirname_creator(trial) == "VT_A-lr1e-4-f00d_00001"


def test_names_module_imports_no_ray():
    code = "import sys, raymcn.sweep.names; sys.exit(1 if 'ray' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_sweep_tuner_names_trial_dirs(tmp_path, monkeypatch):
    """run_sweep hands Tune the readable names. Tune is replaced by a recorder and Ray is never
    started (ray.init raises if anything tries; the suite's shared instance may already be up)."""
    ray = pytest.importorskip("ray")
    from raymcn.cli import preset_path
    from raymcn.config import load_config
    from raymcn.sweep import tuner

    def no_ray(*a, **k):
        raise AssertionError("this test must not start Ray")

    monkeypatch.setattr(ray, "init", no_ray)
    was_up = ray.is_initialized()
    seen = {}

    class Grid(list):
        errors = []
        _experiment_analysis = SimpleNamespace(trials=[])

    class Recorder:
        def __init__(self, trainable, **kwargs):
            seen.update(kwargs)

        def fit(self):
            return Grid()

    monkeypatch.setattr(tuner, "_trainable", lambda cfg, experiment_dir, inputs, env: (lambda config: None))
    monkeypatch.setattr(tuner.tune, "Tuner", Recorder)
    tuner.run_sweep(load_config(preset_path()), str(tmp_path / "named"))
    creator = seen["tune_config"].trial_dirname_creator
    assert creator(SimpleNamespace(config={"schedule.stage_order": "AT_V"}, trial_id="ab_1")) == "AT_V-ab_1"
    assert ray.is_initialized() == was_up


def test_the_stand_in_trials_take_what_the_sweep_passes_its_trainable():
    """``stand_in_sweep.py`` (the soak tier's restore tests of the random and optuna searches) swaps
    ``tuner._trainable`` for its own: it must take every argument the sweep passes, or each such
    test ends before its kill, found only in the soak tier."""
    import inspect

    from stand_in_sweep import trainable

    from raymcn.sweep import tuner

    theirs = inspect.signature(tuner._trainable).parameters
    ours = inspect.signature(trainable).parameters
    assert list(ours) == list(theirs), (list(ours), list(theirs))
