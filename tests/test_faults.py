"""Faults on a real local Ray instance: a NaN step, a killed sweep driver.

(A SIGKILLed worker and a reboot mid-epoch: tests/test_resume.py.)"""

import os

import pytest

from raymcn.cli import preset_path
from raymcn.config import load_config
from raymcn.train import launch

from conftest import TINY, event_log_callback, read_events

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_a_permanent_error_fails_at_once_instead_of_being_retried(ray_local, tmp_path, monkeypatch):
    """A diverged loss (non-finite past optim.max_nonfinite_steps) would diverge again after a
    restart: the run fails on the first failure, with the default scale.max_failures."""
    cfg = load_config(preset_path(), ["scale.num_workers=2", "scale.cpus_per_worker=0.5", *TINY,
                                      "optim.max_nonfinite_steps=0"])
    monkeypatch.setenv("RAYMCN_FAULT", "nan_at_step=2")
    log = tmp_path / "events.jsonl"
    with pytest.raises(Exception, match="NonFiniteLossError.*not retried"):
        launch.fit(cfg, name="diverged", storage_path=tmp_path, callbacks=[event_log_callback(log)])
    failures = [e for e in read_events(log) if "failure" in e]
    assert len(failures) == 1 and failures[0]["errors"] == ["NonFiniteLossError"], failures


def trial_statuses(exp_dir):
    import glob
    import json

    states = sorted(glob.glob(str(exp_dir / "experiment_state-*.json")))
    if not states:
        return {}
    try:
        data = json.loads(open(states[-1]).read())
    except ValueError:  # being rewritten
        return {}
    return {json.loads(t[0])["trial_id"]: json.loads(t[0])["status"] for t in data["trial_data"]}


def result_rows(exp_dir):
    import json

    rows = {}
    for f in exp_dir.glob("*/result.json"):  # trial dirs are named by sweep.names.trial_dirname
        lines = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        if lines:
            rows[lines[0]["trial_id"]] = [int(r["epoch"]) for r in lines]
    return rows


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the smoke sweep's 2 workers need 2 CPUs")
@pytest.mark.timeout(1200)
def test_sweep_survives_driver_kill_and_resumes(ray_local, tmp_path):
    """Whole-machine loss: the sweep driver and its Ray processes are SIGKILLed after one trial
    finished; `raymcn sweep --resume` finishes the sweep without rerunning the finished trial."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from raymcn.cli import main

    exp_dir = tmp_path / "exp"
    env = dict(os.environ, RAY_ADDRESS="local")  # its own Ray, killed with it
    proc = subprocess.Popen([sys.executable, "-m", "raymcn.cli", "sweep", "--config", "sweeps/smoke.yaml",
                             "--set", f"run.storage_path={tmp_path}", "--set", "run.name=exp",
                             "--set", "schedule.epochs=2"],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 400
        while "TERMINATED" not in trial_statuses(exp_dir).values():
            assert proc.poll() is None, "the sweep ended before it could be killed"
            assert time.time() < deadline, "no trial finished in time"
            time.sleep(1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and every Ray process it started
        proc.wait()
    finished = [t for t, s in trial_statuses(exp_dir).items() if s == "TERMINATED"]
    before = result_rows(exp_dir)

    assert main(["sweep", "--resume", str(exp_dir)]) == 0
    after = result_rows(exp_dir)
    assert set(trial_statuses(exp_dir).values()) == {"TERMINATED"} and len(after) == 2
    for t in finished:
        assert after[t] == before[t] == [1, 2]  # kept, not rerun
    for t in set(after) - set(finished):
        assert after[t][-1] == 2  # the interrupted trial completed
