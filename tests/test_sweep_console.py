"""A real sweep as a person runs it: the console contract, Ray's output in the log, paired repeats.

Its own module: the sweep runs in a process of its own with its own Ray instance, and no other
Ray instance of this test process may be alive beside it (see README, one Ray instance per machine).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray


EPOCH_LINE = re.compile(r"^(?P<trial>\S+) epoch (?P<epoch>\d+)/2  R@10 +[\d.]+  loss \S+  \d+ samples/s$")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the smoke sweep's 2 workers need 2 CPUs")
def test_sweep_console_contract_and_paired_repeats(tmp_path):
    """`raymcn sweep` as a person runs it (its own process and Ray instance): the smoke sweep over
    {AV_T, joint} with sweep.repeats=2, one trial's run crashing once after epoch 1 (Ray Train
    restarts it from its checkpoint). The terminal: a start line per trial, one line per
    trial-epoch, status tables, no line twice, at most 80 lines before the results; Ray's output
    and the crash's traceback only in the console log. The repeats pair: a paired t-test over 2 seeds."""
    env = {**os.environ, "RAY_ADDRESS": "local", "RAYMCN_RESULTS": str(tmp_path / "results"),
           "RAYMCN_FAULT": "raise_after_epoch=1", "RAYMCN_FAULT_DIR": str(tmp_path / "faults")}
    proc = subprocess.run([sys.executable, "-m", "raymcn.cli", "sweep", "--config", "sweeps/smoke.yaml", "--json",
                           "--set", "schedule.epochs=2", "--set", "schedule.steps_per_epoch=4",
                           "--set", "sweep.repeats=2", "--set", "sweep.status_every=30"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    end = next(i for i, line in enumerate(lines) if re.match(r"^search: 4 trials \(0 errored\) in ", line))
    head = [line for line in lines[:end] if line.strip()]
    assert len(head) <= 80 and len(head) == len(set(head)), "\n".join(head)
    exp_dir = Path(json.loads(lines[-1])["experiment_dir"])
    # raymcn's own lines fit a terminal too (Ray's warnings, relayed as they are, aside)
    assert max(len(line.replace(str(exp_dir), "EXP")) for line in head if not line.startswith("Ray ")) <= 160, head
    starts = [line for line in head if line.startswith("trial ") and " started: " in line]
    epochs = [m.group("trial", "epoch") for m in map(EPOCH_LINE.match, head) if m]
    assert len(starts) == 4 and sorted(epochs) == sorted({(t, e) for t, _ in epochs for e in ("1", "2")})
    assert len(epochs) == 8 and any(line.startswith("status after ") for line in head)
    log = (exp_dir / "raymcn_console.log").read_text()
    for chatter in ("TrainingReport", "InjectedFault", "Execution plan of Dataset"):
        assert chatter in log and chatter not in proc.stdout + proc.stderr, chatter
    assert (tmp_path / "faults" / "fired-raise_after_epoch").exists()  # the crash did happen
    # the repeats pair across stage orders: same run.seed, nothing else swept
    header = next(line for line in lines[end:] if line.startswith("| schedule.stage_order |"))
    stats = next(line for line in lines[end:] if line.startswith("| AV_T |") and "paired t" in line)
    pairs = [c.strip() for c in header.split("|")].index("pairs")
    assert stats.split("|")[pairs].strip() == "2", stats
    # the end reads on one screen: no line wider than the results' limit, the wide tables in CSV files
    tail = lines[end:-1]
    # (the experiment's folder counted as 3 characters: its length is the user's, here pytest's tmp_path)
    assert max(len(line.replace(str(exp_dir), "EXP")) for line in tail) <= 160 and len(tail) <= 40, "\n".join(tail)
    assert (exp_dir / "tables" / "search_trials.csv").exists()
