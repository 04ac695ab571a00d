"""The sweep schedulers' clock (``budget_epoch``) under Tune's real schedulers, stage 1 included.

Each trial here stands in for a Train run: it reports one result per epoch with the clock the
run's plan gives (``RunPlan.budget_epoch``), checkpoints every epoch and resumes from its
checkpoint, as a raymcn trial does after a BOHB pause. The schedulers are the ones a sweep builds
(``tuner.build_search``). Asserted for every scheduler and stage-1 share: no report is refused
(HyperBand asserts a non-negative clock), and no trial is paused or stopped before stage 1 has
ended: every pause or stop falls on a rung, at the same total epoch for every trial.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest

from raymcn.config import DEFAULT_OBJECTIVE, load_config, objective

# Only light imports at the top: each trial's process imports this module to find its function.
pytestmark = pytest.mark.ray
DEFAULT_METRIC = objective(DEFAULT_OBJECTIVE).reported  # what the default sweep reports to Tune


def stand_in_trial(config, epochs, offset, log_dir):
    """Reports epochs 1..epochs with the plan's clock; a restart continues after its checkpoint.
    Appends ("start", epoch) and ("report", epoch, clock) rows to its own log file."""
    from ray import tune

    from raymcn.train.stages import budget_epoch

    trial = tune.get_context().get_trial_id()
    log = Path(log_dir) / f"{trial}.jsonl"
    ckpt, epoch = tune.get_checkpoint(), 0
    if ckpt is not None:
        with ckpt.as_directory() as d:
            epoch = json.loads(Path(d, "epoch.json").read_text())["epoch"]
    with log.open("a") as f:
        f.write(json.dumps({"start": epoch}) + "\n")
    while epoch < epochs:
        epoch += 1
        clock = budget_epoch(epoch, offset)
        with log.open("a") as f:
            f.write(json.dumps({"epoch": epoch, "clock": clock}) + "\n")
        with tempfile.TemporaryDirectory() as d:
            Path(d, "epoch.json").write_text(json.dumps({"epoch": epoch}))
            # better learning rates score higher at every epoch: the schedulers' choices are determined
            tune.report({"epoch": epoch, "budget_epoch": clock, DEFAULT_METRIC: config["optim.lr"] * 1000 + epoch},
                        checkpoint=tune.Checkpoint.from_directory(d))


def run_stand_in_sweep(tmp_path, algorithm, epochs, fraction, samples=4, extra=()):
    from ray import tune

    from raymcn.cli import preset_path
    from raymcn.sweep.tuner import build_search, search_space
    from raymcn.train.run_plan import make_plan

    cfg = load_config(preset_path(), [
        f"schedule.epochs={epochs}", f"schedule.stage1_fraction={fraction}", f"sweep.algorithm={algorithm}",
        "sweep.grace_epochs=1", "sweep.reduction_factor=2", "sweep.repeats=1", "sweep.confirm={}",
        f"sweep.num_samples={samples}", "sweep.space={optim.lr: {choice: [0.001, 0.002, 0.003, 0.004]}}", *extra])
    offset = make_plan(cfg, videos=cfg.data.batch_size).budget_offset
    search, scheduler = build_search(cfg)
    decisions = record_decisions(scheduler)
    logs = tmp_path / "logs"
    logs.mkdir()
    grid = tune.Tuner(
        tune.with_resources(tune.with_parameters(stand_in_trial, epochs=epochs, offset=offset, log_dir=str(logs)),
                            {"cpu": 0.25}),
        param_space=search_space(cfg),
        tune_config=tune.TuneConfig(metric=DEFAULT_METRIC, mode="max", num_samples=samples, search_alg=search,
                                    scheduler=scheduler, max_concurrent_trials=1, reuse_actors=True),
        run_config=tune.RunConfig(storage_path=str(tmp_path), name="clock", verbose=0),
    ).fit()
    assert not grid.errors, [str(r.error) for r in grid if r.error]
    rows = {p.stem: [json.loads(x) for x in p.read_text().splitlines()] for p in logs.glob("*.jsonl")}
    return cfg, offset, rows, decisions


def record_decisions(scheduler) -> list[tuple[str, int, int, str, int]]:
    """(trial id, epoch, clock, decision, bracket) of every result the scheduler judged, in order
    (the scheduler runs in this process; bracket: HyperBand's bracket of the trial, else 0)."""
    decisions: list[tuple[str, int, int, str, int]] = []
    judge = scheduler.on_trial_result

    def recorded(controller, trial, result):
        decision = judge(controller, trial, result)
        bracket = id(getattr(scheduler, "_trial_info", {}).get(trial, (None,))[0] or 0)
        decisions.append((trial.trial_id, int(result["epoch"]), int(result["budget_epoch"]), decision, bracket))
        return decision

    scheduler.on_trial_result = recorded
    return decisions


def segments(rows: list[dict]) -> list[list[int]]:
    """The epochs a trial reported, one list per start (a pause ends a segment)."""
    out: list[list[int]] = []
    for r in rows:
        if "start" in r:
            out.append([])
        else:
            out[-1].append(r["epoch"])
    return out


CASES = [  # (epochs, stage1_fraction): the first rung right after stage 1; no stage 1; one epoch of stage 2
    (4, 0.5), (2, 0.0), (4, 0.75)]


@pytest.mark.slow  # 11 Tune runs of stand-in trials (about a minute): the full tier
@pytest.mark.parametrize("algorithm, extra", [("bohb", ()), ("asha", ()), ("asha", ("sweep.suggest=optuna",)),
                                              ("optuna", ()), ("random", ())])
@pytest.mark.parametrize("epochs, fraction", CASES)
def test_every_scheduler_gets_a_valid_clock_and_no_rung_inside_stage_1(tmp_path, ray_local, algorithm, extra,
                                                                       epochs, fraction):
    if algorithm in ("optuna", "random") and (epochs, fraction) != CASES[0]:
        pytest.skip("a FIFO scheduler reads no clock: one stage-1 share shows the reports pass")
    cfg, offset, rows, decisions = run_stand_in_sweep(tmp_path, algorithm, epochs, fraction)
    assert offset == math.ceil(fraction * epochs) and cfg.budget_epochs == epochs - offset
    assert len(rows) == 4
    rungs = {1, 2, 4, 8}  # grace 1, reduction factor 2, up to max_t = budget_epochs
    for trial, log in rows.items():
        reports = [r for r in log if "epoch" in r]
        assert all(r["clock"] == max(0, r["epoch"] - offset) >= 0 for r in reports), (trial, reports)
        parts = segments(log)  # a resumed trial continues after its checkpoint: no epoch twice, none lost
        assert [e for part in parts for e in part] == list(range(1, reports[-1]["epoch"] + 1)), (trial, parts)
    for trial, epoch, clock, decision, _ in decisions:
        assert epoch == offset + clock or clock == 0, (trial, epoch, clock)
        if decision != "CONTINUE":  # paused or stopped: on a rung, after stage 1, at the same epoch for all
            assert clock in rungs | {cfg.budget_epochs} and epoch > offset, (trial, epoch, decision, offset)
    paused = [d for d in decisions if d[3] == "PAUSE"]
    if algorithm == "bohb" and cfg.budget_epochs >= 2:
        # BOHB fills HyperBand's aggressive bracket first, its rung at 1: a trial waits there
        # (paused) until the bracket fills, and the better one goes on past it (promoted)
        waited = {bracket for _, _, clock, _, bracket in paused if clock == 1}
        assert waited, decisions
        assert any(clock > 1 and bracket in waited for _, _, clock, _, bracket in decisions), decisions
    else:
        assert not paused, decisions
