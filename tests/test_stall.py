"""A run never waits in silence, on Ray Train workers: `raymcn train` as a person runs it (its own
process and Ray instance), with ``run.stall_timeout_s=10`` and two injected stalls in one run
(TINY: 4 steps per epoch, 2 workers, epoch-end checkpoints):

1. rank 1's batch of global step 2 never arrives (once): its watchdog names it on the terminal
   and ends the attempt; Ray Train restarts from the start (no checkpoint yet) and the run goes on;
2. from global step 6 on, rank 1 never reaches the step's collectives (in every attempt): rank 0
   waits in them. Named and restarted from the epoch-1 checkpoint; the same stall at step 6 again
   ends the run with an error naming the step, not retried.

Its own module: the run's Ray instance must be the only one of this test process.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY

# the soak tier: two stalls' limits and three group starts, minutes past CI's time (the watchdog's
# rules, without Ray: tests/test_watchdog.py)
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.soak, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="2 workers need 2 CPUs")
def test_a_data_stall_restarts_and_a_repeated_collective_stall_ends_the_run_naming_the_step(tmp_path):
    markers = tmp_path / "markers"
    env = {**os.environ, "RAY_ADDRESS": "local", "RAYMCN_FAULT": "stall_data_at_step=2,stall_at_step=6",
           "RAYMCN_FAULT_DIR": str(markers), "PYTHONUNBUFFERED": "1"}
    settings = ["scale.num_workers=2", "scale.cpus_per_worker=0.5", *TINY, "run.stall_timeout_s=10",
                "scale.max_failures=3", f"run.storage_path={tmp_path}", "run.name=stalls"]
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "raymcn.cli", "train", *sum((["--set", s] for s in settings), [])],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[tuple[float, str]] = []  # (seconds since start, terminal line)
    for line in proc.stdout:
        seen.append((time.monotonic() - started, line.rstrip("\n")))
    stderr = proc.stderr.read()
    proc.wait(timeout=60)
    out = "\n".join(line for _, line in seen)
    assert (markers / "fired-stall_data_at_step").exists()

    stalls = [(t, line) for t, line in seen if line.startswith("STALL: ")]
    # 1. the data stall: rank 1 named, waiting for its batch, at step 2; then the run went on
    data = [line for _, line in stalls if "waiting for its next batch" in line]
    assert len(data) == 1 and "rank 1 made no progress for" in data[0] and "at global step 2," in data[0], out
    assert re.search(r"epoch 1/3 ", out), out  # trained past the data stall after the restart
    # 2. the collective stall: named at step 6 in both attempts, then the run ends with it
    step6 = [line for _, line in stalls if "at global step 6," in line]
    assert len(step6) >= 2 and all("the step's compute and collectives" in line for line in step6), out
    assert "resumed from" in out and "at epoch 2, global step 4" in out, out
    assert proc.returncode == 1, out + stderr
    assert "not retried" in stderr and "the same stall in two attempts" in stderr and "global step 6" in stderr, stderr
    # never named before its limit: every stall's wait as printed is at least run.stall_timeout_s
    assert all(float(re.search(r"no progress for (\d+) s", line).group(1)) >= 10 for _, line in stalls)
    for t, line in seen:  # with -s: when each line reached the terminal (the closing note's figures)
        print(f"{t:6.1f} s  {line[:160]}")
