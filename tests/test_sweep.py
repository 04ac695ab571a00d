"""Sweeps: fair early stopping across stage orders (the real smoke sweep: tests/test_sweep_console.py)."""

import math
import re

import pytest

from raymcn.cli import preset_path
from raymcn.config import DEFAULT_OBJECTIVE, load_config, objective
from raymcn.train.stages import budget_epoch

pytestmark = pytest.mark.ray
DEFAULT_METRIC = objective(DEFAULT_OBJECTIVE).reported  # what the default sweep reports to Tune

EPOCHS, FRACTION = 6, 0.5  # stage 2 starts at epoch 3 (0-based): the third modality joins there


def fake_trial(config):
    """Stands in for a Train run: a staged order is useless until its third modality joins, then best."""
    from ray import tune

    staged = config["schedule.stage_order"] != "joint"
    for epoch in range(1, EPOCHS + 1):
        in_stage2 = epoch > math.ceil(FRACTION * EPOCHS)
        r10 = (60.0 + epoch if in_stage2 else 1.0) if staged else 20.0 + epoch
        tune.report({"epoch": epoch, "budget_epoch": budget_epoch(epoch, math.ceil(FRACTION * EPOCHS)), DEFAULT_METRIC: r10})


def run_fake_sweep(time_attr, tmp_path, orders):
    from ray import tune

    from raymcn.sweep.tuner import build_search

    cfg = load_config(preset_path(), [f"schedule.epochs={EPOCHS}", f"schedule.stage1_fraction={FRACTION}",
                                      "sweep.algorithm=asha", "sweep.grace_epochs=1", "sweep.reduction_factor=2",
                                      "sweep.repeats=1"])
    _, scheduler = build_search(cfg)
    if time_attr != "budget_epoch":  # the naive clock, to show the rule matters
        scheduler._time_attr = time_attr
    grid = tune.Tuner(
        tune.with_resources(fake_trial, {"cpu": 0.25}),
        param_space={"schedule.stage_order": tune.grid_search(orders)},
        # one trial at a time, in the given order: ASHA's decisions then do not depend on timing
        tune_config=tune.TuneConfig(metric=DEFAULT_METRIC, mode="max", scheduler=scheduler, max_concurrent_trials=1),
        run_config=tune.RunConfig(storage_path=str(tmp_path), name=time_attr, verbose=0),
    ).fit()
    return {r.config["schedule.stage_order"]: int(r.metrics["epoch"]) for r in grid}


@pytest.mark.slow  # a Tune run of Ray Train trials: the full tier
def test_staged_orders_are_not_stopped_before_their_third_modality(ray_local, tmp_path):
    # staged orders first, joint last: joint meets their rung values and is the one stopped
    epochs_run = run_fake_sweep("budget_epoch", tmp_path, ["AV_T", "VT_A", "AT_V", "joint"])
    switch = math.ceil(FRACTION * EPOCHS)
    for order in ("AV_T", "VT_A", "AT_V"):
        assert epochs_run[order] > switch, epochs_run  # every staged trial trained all modalities
    assert epochs_run["joint"] < EPOCHS  # and the scheduler did stop someone: the worse joint run


@pytest.mark.slow  # a Tune run of Ray Train trials: the full tier
def test_naive_epoch_clock_would_stop_staged_orders_early(ray_local, tmp_path):
    epochs_run = run_fake_sweep("epoch", tmp_path, ["joint", "AV_T", "VT_A", "AT_V"])
    assert min(epochs_run[o] for o in ("AV_T", "VT_A", "AT_V")) <= math.ceil(FRACTION * EPOCHS)



@pytest.mark.parametrize("algorithm,reused", [("grid", True), ("random", True), ("asha", False), ("bohb", False)])
def test_trial_drivers_are_reused_only_where_no_trial_is_stopped_or_paused(algorithm, reused):
    """Tune's actor reuse waits 2 s for the previous trial's thread; a trial that ASHA stopped or
    BOHB paused is still inside its Train run then, and Tune fails the next trial."""
    pytest.importorskip("ray")
    from raymcn.sweep.tuner import build_search, reuse_trial_drivers

    space = ("{schedule.stage_order: {grid: [AV_T, joint]}, optim.lr: {grid: [0.001, 0.003]}}" if algorithm == "grid"
             else "{schedule.stage_order: {choice: [AV_T, joint]}, optim.lr: {loguniform: [0.001, 0.01]}}")
    cfg = load_config(preset_path(), [f"sweep.algorithm={algorithm}", f"sweep.space={space}"])
    assert reuse_trial_drivers(build_search(cfg)[1]) is reused


@pytest.mark.parametrize("tolerant", [False, True], ids=["ray", "raymcn"])
def test_bohb_lets_go_of_a_trial_it_completed_before_a_restore(tmp_path, tolerant):
    """The lab's file resumed after a reboot: a trial HyperBand stopped while it was paused is saved
    by Tune as PAUSED, but BOHB's saved state has let go of it. After the restore HyperBand runs it
    and stops it again: Ray's TuneBOHB raises KeyError (the resumed sweep ends), raymcn's searcher
    leaves the repeat out of BOHB's model."""
    from ray import tune
    from ray.tune.search.bohb import TuneBOHB

    from raymcn.sweep.tuner import bohb_searcher_class

    cls = bohb_searcher_class() if tolerant else TuneBOHB
    space = {"optim.lr": tune.loguniform(1e-4, 1e-2)}
    before = cls(space=space, metric=DEFAULT_METRIC, mode="max", seed=0)
    assert before.suggest("t1") is not None
    result = {DEFAULT_METRIC: 0.5, "hyperband_info": {"budget": 2}}
    before.on_trial_result("t1", result)
    before.on_pause("t1")
    before.on_trial_complete("t1")  # stopped while paused (its bracket filled without it)
    before.save_to_dir(str(tmp_path), "before")  # Tune's checkpoint: Tune itself still says PAUSED

    after = cls(space=space, metric=DEFAULT_METRIC, mode="max", seed=0)
    after.restore_from_dir(str(tmp_path))
    after.on_unpause("t1")  # HyperBand runs it again ...
    if not tolerant:
        with pytest.raises(KeyError):
            after.on_trial_result("t1", result)
        return
    after.on_trial_result("t1", result)
    after.on_trial_complete("t1")  # ... and stops it again
    assert "t1" not in after.running and "t1" not in after.paused
    assert after.suggest("t2") is not None  # the search goes on


def test_a_sweep_whose_storage_fills_stops_before_a_second_trial_starts(ray_local, tmp_path, monkeypatch):
    """The smoke sweep (2 trials, one at a time): its first trial's copy of epoch 1's checkpoint
    fails as a full disk does (``RAYMCN_FAULT=disk_full_at_epoch``, once). The sweep stops there:
    no second trial starts and the first is not retried (``sweep.max_trial_failures`` would); the
    console says why and how to resume; the command fails; Tune's saved state leaves the trial
    unfinished, for ``raymcn sweep --resume`` once there is room."""
    import json

    from raymcn.cli import main
    from raymcn.config import TRIAL_STATUS_FILE

    monkeypatch.setenv("RAYMCN_FAULT", "disk_full_at_epoch=1")
    monkeypatch.setenv("RAYMCN_FAULT_DIR", str(tmp_path / "faults"))
    results = tmp_path / "results"
    assert main(["sweep", "--config", "sweeps/smoke.yaml", "--set", f"run.storage_path={results}"]) == 1
    (exp,) = results.glob("sweep-*")
    lines = (exp / "raymcn_console.log").read_text().splitlines()
    assert len([line for line in lines if line.startswith("trial ") and " started: " in line]) == 1, lines
    assert not any(line.startswith("trial ") and " resumed: " in line for line in lines), lines
    stop = next(i for i, line in enumerate(lines) if line.startswith("sweep stopped: trial "))
    assert "could not write to the storage: copying checkpoint" in lines[stop]
    assert "No space left on device" in lines[stop] and re.search(r"One checkpoint is [\d.]+ MB", lines[stop])
    assert lines[stop + 1].endswith(f"resume from their checkpoints with: raymcn sweep --resume {exp}")
    assert len(list((exp / "train").iterdir())) == 1  # the second trial's Train run never started
    # the grid hands Tune a trial as a slot frees: Tune holds the first only, requeued by its failure
    # policy for --resume, never restarted
    statuses = [json.loads(line)["status"] for line in (exp / TRIAL_STATUS_FILE).read_text().splitlines()]
    assert statuses == ["PENDING"], statuses
