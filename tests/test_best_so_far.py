"""Each epoch reports every metric's best so far (``best_<metric>``, ``config.best_values``), kept in
the loop's state so that a run restarted from its checkpoint (a reboot, a BOHB pause, a restored
sweep) reports the best of the epochs before the restart too. No Ray: the loop of
``train/loop.py`` on random batches, its evaluation a script of values."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from raymcn.config import BEST, best_values, load_config, metric_table

R10, MEDR = "text_to_video_R@10", "text_to_video_MedR"
SMOKE = Path(__file__).resolve().parents[1] / "sweeps" / "smoke.yaml"


def test_the_best_follows_each_metrics_direction_and_a_nan_never_wins():
    best = best_values({}, {R10: 20.0, MEDR: 9.0, "total_loss": 3.0})
    assert best == {BEST + R10: 20.0, BEST + MEDR: 9.0}  # listed metrics only
    best = best_values(best, {R10: 10.0, MEDR: 4.0})
    assert best == {BEST + R10: 20.0, BEST + MEDR: 4.0}  # R@K: the highest; a rank: the lowest
    assert best_values(best, {R10: math.nan, MEDR: 5.0}) == best  # a NaN keeps the number; a worse one too
    assert best_values({BEST + R10: math.nan}, {R10: 1.0}) == {BEST + R10: 1.0}
    assert best_values(best, {}) == best  # an epoch without an evaluation keeps them
    assert {BEST + m.name for m in metric_table()} == set(best_values({}, {m.name: 1.0 for m in metric_table()}))


def test_the_loop_state_keeps_the_best_and_an_older_checkpoint_without_it_loads():
    from raymcn.train.run import LoopState

    state = LoopState(step=7, epoch=2, best={BEST + R10: 12.5})
    again = LoopState()
    again.load_state_dict(state.state_dict())
    assert again.best == {BEST + R10: 12.5} and again.step == 7
    older = {k: v for k, v in state.state_dict().items() if k != "best"}  # written before the best was kept
    again.load_state_dict(older)
    assert again.best == {} and again.epoch == 2


SCRIPT = {1: {R10: 50.0, MEDR: 9.0}, 2: {R10: 10.0, MEDR: 12.0}, 3: {R10: 20.0, MEDR: 3.0}}  # epoch -> evaluation


def scripted_run(cfg, reported: list[dict]):
    """A run of ``cfg`` on random batches whose evaluation after epoch e returns ``SCRIPT[e]``; each
    epoch's metrics are appended to ``reported``."""
    from raymcn.data.formats.batch import random_batch
    from raymcn.train.build import assemble
    from raymcn.train.run import Hooks
    from raymcn.train.run_plan import make_plan

    plan = make_plan(cfg, 2 * cfg.data.batch_size)

    def batches(run, epoch, start):
        steps = range(start, plan.steps_per_epoch)
        return [random_batch(cfg, cfg.clips_per_step, 100 * epoch + s) for s in steps], None

    return assemble(cfg, plan, hooks=Hooks(batches=batches, evaluate=lambda run: dict(SCRIPT[run.state.epoch]),
                                           after_epoch=[lambda run, metrics: reported.append(dict(metrics))]))


class Killed(Exception):
    pass


def test_a_run_restarted_from_its_checkpoint_reports_the_best_of_the_epochs_before_it(tmp_path):
    """Epoch 1 is the best R@10 (50), epoch 3 the best MedR (3): the run killed after its checkpoint
    of epoch 2 and restarted from it reports at epoch 3 the R@10 of epoch 1."""
    from raymcn.train.checkpoints import payload
    from raymcn.train.loop import run_epochs

    cfg = load_config(SMOKE, ["schedule.epochs=3", "run.checkpoint_every=0"])
    first: list[dict] = []
    run = scripted_run(cfg, first)

    def checkpoint_then_kill(run, metrics):  # the epoch's end: its checkpoint (as the worker saves it), then a kill
        if run.state.epoch == 2:
            payload.save(tmp_path / "ck", **run.parts(), config=cfg.to_dict(), metrics=metrics)
            raise Killed

    run.hooks.after_epoch.append(checkpoint_then_kill)
    with pytest.raises(Killed):
        run_epochs(run)
    resumed: list[dict] = []
    again = scripted_run(cfg, resumed)  # a new process: nothing of the first run but its checkpoint
    payload.restore(payload.load(tmp_path / "ck"), **again.parts())
    run_epochs(again)
    assert [(m[BEST + R10], m[BEST + MEDR]) for m in first] == [(50.0, 9.0), (50.0, 9.0)]
    assert [m["epoch"] for m in resumed] == [3.0]
    assert {k: v for k, v in resumed[0].items() if k.startswith(BEST)} == {BEST + R10: 50.0, BEST + MEDR: 3.0}
    assert payload.load(tmp_path / "ck")["metrics"][BEST + R10] == 50.0  # beside the checkpoint, as Ray keeps it


def test_a_mid_epoch_checkpoint_holds_the_best_of_the_epochs_it_follows(tmp_path):
    """A checkpoint inside epoch 3 holds the best of epochs 1 and 2: resumed there, epoch 3 reports
    the best as the uninterrupted run does."""
    from raymcn.train.checkpoints import payload
    from raymcn.train.loop import run_epochs

    cfg = load_config(SMOKE, ["schedule.epochs=3", "run.checkpoint_every=0"])
    whole: list[dict] = []
    run = scripted_run(cfg, whole)
    saved: list[int] = []

    def save(run, metrics):  # the worker's save hook: a checkpoint after epoch 2 and after epoch 3's first step
        if metrics is None or run.state.epoch == 2:
            payload.save(tmp_path / f"ck{run.state.step}", **run.parts(), config=cfg.to_dict(), metrics=metrics or {})
            saved.append(run.state.step)

    run.hooks.save = save

    class AfterFirstStep:  # the checkpoint policy, asking once: after epoch 3's first step
        pending = False

        def due(self, step):
            return step == 2 * run.plan.steps_per_epoch + 1

        def done(self):
            pass

    run.checkpoints = AfterFirstStep()
    run_epochs(run)
    inside = saved[-1]
    assert inside == 2 * run.plan.steps_per_epoch + 1
    assert payload.load(tmp_path / f"ck{inside}")["loop"]["best"] == {BEST + R10: 50.0, BEST + MEDR: 9.0}
    resumed: list[dict] = []
    again = scripted_run(cfg, resumed)
    payload.restore(payload.load(tmp_path / f"ck{inside}"), **again.parts())
    run_epochs(again)
    assert [m["epoch"] for m in resumed] == [3.0] and resumed[0][BEST + R10] == 50.0 and resumed[0][BEST + MEDR] == 3.0
    assert resumed[0][BEST + R10] == whole[-1][BEST + R10]


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
