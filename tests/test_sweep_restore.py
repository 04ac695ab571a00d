"""A search killed with its Ray mid-search and resumed, for the algorithms no shipped file uses
(random, optuna), on stand-in trials (``stand_in_sweep.py``): raymcn's own sweep and resume, Tune's
state and the searcher's, without a Ray Train run per trial. What they lose on restore is nothing
(tests/test_rehearsals.py's doc); the shipped files (grid, asha, bohb) are killed and resumed for
real there. Asserted: the trials finished before the kill are kept as they were, every trial of
the search ends, a trial resumed after the kill continues from its last checkpoint Tune saved
(not from scratch), and the search draws no more trials than it asked for.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tune_dirs import result_rows, saved_checkpoint_epochs, trial_statuses

# the soak tier: four Ray starts and the stand-ins' epochs, minutes past CI's time (CI kills and
# resumes the grid and BOHB files: tests/test_rehearsals.py)
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.soak]

TESTS = Path(__file__).resolve().parent
SAMPLES, EPOCHS = 4, 4


def stand_in_sweep(command: str, exp: Path, *overrides: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]), RAY_ADDRESS="local")
    env.pop("RAY_API_SERVER_ADDRESS", None)  # a Ray of its own, as the lab's sweep
    return subprocess.Popen([sys.executable, str(TESTS / "stand_in_sweep.py"), command, str(exp), *overrides],
                            cwd=TESTS.parent, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def logs(exp: Path) -> dict[str, list[dict]]:
    return {p.stem: [json.loads(x) for x in p.read_text().splitlines()] for p in (exp / "stand_in").glob("*.jsonl")}


@pytest.mark.parametrize("algorithm", ["random", "optuna"])
def test_a_search_killed_mid_search_resumes_to_its_end(tmp_path, algorithm):
    exp = tmp_path / "sweep"
    overrides = [f"sweep.algorithm={algorithm}", f"sweep.num_samples={SAMPLES}", "sweep.confirm={}",
                 "sweep.max_concurrent=1", f"schedule.epochs={EPOCHS}",
                 "sweep.space={schedule.stage_order: {choice: [AV_T, joint]}, optim.lr: {loguniform: [0.001, 0.01]}}"]
    run = stand_in_sweep("run", exp, *overrides)
    try:
        deadline = time.time() + 300
        while True:  # kill once a trial has finished and a later one has a checkpoint, both in Tune's saved state
            assert run.poll() is None, f"the search ended before the kill:\n{run.stdout.read()[-3000:]}"
            assert time.time() < deadline, "no trial finished within 300 s"
            statuses, saved = (trial_statuses(exp), saved_checkpoint_epochs(exp)) if exp.is_dir() else ({}, {})
            finished = {t for t, s in statuses.items() if s == "TERMINATED"}
            if finished and any(saved[t] > 0 for t in statuses if t not in finished):
                break
            time.sleep(0.2)
        before = result_rows(exp)
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    resume = stand_in_sweep("resume", exp)
    out, _ = resume.communicate(timeout=300)
    assert resume.returncode == 0, out[-3000:]
    statuses, after = trial_statuses(exp), result_rows(exp)
    assert len(statuses) == SAMPLES and set(statuses.values()) == {"TERMINATED"}, statuses  # none lost, none extra
    for trial in finished:  # a trial finished before the reboot is kept, not trained again
        assert after[trial] == before[trial], trial
    for trial, rows in logs(exp).items():  # a trial resumed after the kill continues after its checkpoint
        trained = 0  # epochs logged before each start
        for i, row in enumerate(rows):
            if "start" in row:
                # never past what it trained; after the kill, not before the checkpoint Tune had saved
                assert row["start"] <= trained and (i == 0 or row["start"] >= saved.get(trial, 0)), (trial, saved, rows)
                expected = row["start"]
            else:
                expected += 1
                assert row["epoch"] == expected, (trial, rows)  # contiguous from where it started
                trained = max(trained, row["epoch"])
        assert trained == EPOCHS, (trial, rows)
    assert any(saved[t] > 0 and t not in finished for t in saved)  # the resume had a checkpoint to continue from
