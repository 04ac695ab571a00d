"""In-epoch progress (train/monitor/in_epoch.py): the terminal line's figures, its cadence, the marker
beside the run and the resume line's replayed steps, with an injected clock (no Ray)."""

from __future__ import annotations

import json
from types import SimpleNamespace as Plan  # the three figures Progress reads from a run's plan

import pytest

from raymcn.config import PROGRESS_FILE
from raymcn.train.monitor.in_epoch import Progress, duration, progress_line, read_mark


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (42.4, "42s"), (61, "1m"), (3599, "59m"), (3600, "1h00m"),
                                           (11100, "3h05m"), (187200, "2d04h")])
def test_duration(seconds, text):
    assert duration(seconds) == text


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_steps(progress: Progress, clock: Clock, steps: range, seconds_per_step: float) -> None:
    for s in steps:
        clock.now += seconds_per_step
        progress.step(s)


def test_lines_every_interval_with_rate_and_etas(tmp_path):
    clock, said = Clock(), []
    p = Progress(str(tmp_path), Plan(steps_per_epoch=100, epochs=3, clips_per_step=64), every_s=10, say=said.append,
                 clock=clock)
    run_steps(p, clock, range(1, 41), 0.5)  # 2 steps/s, 20 s: a line at 10 s and at 20 s
    assert said == ["epoch 1/3  step 20/100  128 samples/s  epoch ETA 40s  run ETA 2m",
                    "epoch 1/3  step 40/100  128 samples/s  epoch ETA 30s  run ETA 2m"]
    mark = p.mark(40)
    assert (mark["epoch"], mark["in_epoch"], mark["global_step"]) == (0, 40, 40)
    assert mark["eta_epoch_s"] == pytest.approx(30) and mark["eta_run_s"] == pytest.approx(130)
    assert progress_line(mark, "trial x") == "trial x " + said[-1]


def test_no_eta_until_steps_after_the_start_up_are_timed(tmp_path):
    """A one-minute run: its first step carries the start-up (30 s here), the others take 0.25 s. Its
    first line came at step 1 with "run ETA 5m" for 63 steps left; the rate now starts at the end of
    the first step, and the rate and ETAs are shown once ETA_MIN_STEPS steps are timed."""
    from raymcn.train.monitor.in_epoch import ETA_MIN_STEPS

    clock, said = Clock(), []
    p = Progress(None, Plan(steps_per_epoch=16, epochs=4, clips_per_step=32), every_s=2, say=said.append, clock=clock)
    p.restart_clock(0)  # the worker's start
    clock.now = 30.0
    p.step(1)  # the first step: the reader's start, the first batch
    run_steps(p, clock, range(2, 17), 0.25)
    assert said[0] == f"epoch 1/4  step 1/16  rate and ETA from step {1 + ETA_MIN_STEPS}", said
    assert said[1] == "epoch 1/4  step 9/16  128 samples/s  epoch ETA 2s  run ETA 14s", said
    assert p.mark(16)["eta_run_s"] == pytest.approx(48 * 0.25)  # the steps left at the steady rate
    p.restart_clock(16)  # an evaluation between epochs: the next step is not timed either
    clock.now += 20.0
    p.step(17)
    assert p.mark(17)["samples_per_s"] is None and "rate and ETA from step 22" in progress_line(p.mark(17))


def test_rate_follows_the_last_minutes_not_the_whole_run(tmp_path):
    clock = Clock()
    p = Progress(None, Plan(steps_per_epoch=1000, epochs=1, clips_per_step=10), every_s=0, say=None, clock=clock)
    run_steps(p, clock, range(1, 201), 1.0)   # 1 step/s for 200 s
    run_steps(p, clock, range(201, 401), 0.25)  # then 4 steps/s for 50 s
    assert p.mark(400)["samples_per_s"] == pytest.approx(35.0)  # steps 190..400 over the last 60 s
    run_steps(p, clock, range(401, 801), 0.25)  # 100 s more at 4 steps/s: the window holds only those
    assert p.mark(800)["samples_per_s"] == pytest.approx(40.0)


def test_epoch_end_counts_as_the_last_step_of_its_epoch(tmp_path):
    p = Progress(None, Plan(steps_per_epoch=10, epochs=2, clips_per_step=1), every_s=0, say=None, clock=Clock())
    assert (p.mark(10)["epoch"], p.mark(10)["in_epoch"]) == (0, 10)
    assert (p.mark(11)["epoch"], p.mark(11)["in_epoch"]) == (1, 1)


def test_marker_written_in_the_background_and_read_back(tmp_path):
    clock = Clock()
    p = Progress(str(tmp_path), Plan(steps_per_epoch=10, epochs=2, clips_per_step=4), every_s=0, say=None,
                 write_every_s=5, clock=clock)
    run_steps(p, clock, range(1, 13), 1.0)  # writes due at 5 s and 10 s
    p.flush()
    mark = read_mark(str(tmp_path))
    assert mark["global_step"] == 10 and mark["line"] == progress_line(mark)
    assert read_mark(str(tmp_path / "absent")) is None
    (tmp_path / PROGRESS_FILE).write_text('{"global_st')  # caught mid-write by a reader
    assert read_mark(str(tmp_path)) is None
    p.write(12)
    p.flush()
    assert json.loads((tmp_path / PROGRESS_FILE).read_text())["global_step"] == 12
