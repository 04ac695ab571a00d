"""Search, then confirm, on Ray: a small random search (a learning rate drawn per stage order), its
confirmation interrupted by a whole-machine loss (driver and Ray SIGKILLed), and the resume.

(Selection, seeds, plan and statistics on fixed inputs: tests/test_confirm.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import TINY
from tune_dirs import result_rows, trial_statuses

from raymcn.results.confirmation import read_plan
from raymcn.results.experiment import load_experiment

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ORDER, LR, SEED = "schedule.stage_order", "optim.lr", "run.seed"


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the sweep's 2 workers need 2 CPUs")
@pytest.mark.timeout(1500)
def test_search_then_confirm_survives_a_kill_in_the_confirmation(ray_local, tmp_path, capsys):
    from raymcn.cli import main

    exp = tmp_path / "exp"
    confirm = exp / "confirm"
    # one worker per trial: the phases, not DDP, are under test (2 search trials, 4 confirmation runs)
    settings = [*TINY, "schedule.epochs=2", "scale.num_workers=1", "sweep.algorithm=random", "sweep.num_samples=1",
                "sweep.repeats=1", "run.seed=3",
                f"sweep.space={{{ORDER}: {{grid: [AV_T, joint]}}, {LR}: {{loguniform: [0.001, 0.01]}}}}",
                f"sweep.confirm={{per: {ORDER}, repeats: 2}}", f"run.storage_path={tmp_path}", "run.name=exp"]
    env = dict(os.environ, RAY_ADDRESS="local")  # its own Ray, killed with it
    proc = subprocess.Popen([sys.executable, "-m", "raymcn.cli", "sweep", *[a for s in settings for a in ("--set", s)]],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 900
        while "TERMINATED" not in trial_statuses(confirm).values():
            assert proc.poll() is None, "the sweep ended before its confirmation could be interrupted"
            assert time.time() < deadline, "no confirmation trial finished in time"
            time.sleep(1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and every Ray process it started
        proc.wait()
    finished = [t for t, s in trial_statuses(confirm).items() if s == "TERMINATED"]
    search_before, confirm_before = result_rows(exp), result_rows(confirm)
    assert len(search_before) == 2 and all(rows == [1, 2] for rows in search_before.values())

    assert main(["sweep", "--resume", str(exp)]) == 0
    out = capsys.readouterr().out

    assert result_rows(exp) == search_before  # the finished search was not touched
    after = result_rows(confirm)
    assert set(trial_statuses(confirm).values()) == {"TERMINATED"} and len(after) == 4
    for t in finished:
        assert after[t] == confirm_before[t] == [1, 2]  # kept, not rerun

    # each group's confirmation runs share the configuration the search selected for it (here
    # its one trial's learning rate, drawn for it: the groups run different ones) ...
    search, _ = load_experiment(exp)
    _, candidates, seeds = read_plan(exp)
    assert search[LR].nunique() == 2
    for order in ("AV_T", "joint"):
        (lr,) = search.loc[search[ORDER] == order, LR]
        (candidate,) = [c for c in candidates if c.group == order]
        assert candidate.config == {ORDER: order, LR: lr} and candidate.basis == "full budget (2 epochs)"
    # ... over the same fresh seeds for every group
    assert seeds == [4, 5]  # the search ran seed 3
    runs = [json.loads((d / "params.json").read_text()) for d in confirm.iterdir() if (d / "params.json").exists()]
    assert len(runs) == 4
    by_order = {o: sorted(r[SEED] for r in runs if r[ORDER] == o) for o in ("AV_T", "joint")}
    assert by_order == {"AV_T": seeds, "joint": seeds}
    for r in runs:
        (candidate,) = [c for c in candidates if c.group == r[ORDER]]
        assert {k: r[k] for k in candidate.config} == candidate.config
    # the console ends with the confirmation's table and the answer
    assert "by schedule.stage_order, confirmation:" in out and "\nAnswer: " in out
    assert (exp / "best_by_stage_order.png").exists() and (exp / "search_best_by_stage_order.png").exists()
