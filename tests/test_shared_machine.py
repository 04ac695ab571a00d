"""A run on a shared machine is its own (``train/on_ray/cluster.py``).

Beside a Ray instance of someone else's (here a ``ray start --head`` of this test's own, ended by
its processes' pids: other people's Ray instances on the machine are never stopped), the README's
``raymcn train`` on the smoke file, given no address, starts a Ray instance of its own, says so on
its first line about Ray, and finishes; the instance beside it runs nothing of its. Told to, by
``--address`` or ``RAY_ADDRESS``, a run joins it. Each command is a process of its own with a Ray
temp folder of its own (``RAY_TMPDIR``): a Ray session found there is one the command started.
``raymcn sweep`` decides where it runs in the same call, with the same arguments
(``cli.ray_session``; its choices: tests/test_reasons.py), so one command shows it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from test_reasons import own_ray_instance  # noqa: F401 - the fixture: a `ray start --head` of this test's own

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(1500)]
REPO = Path(__file__).resolve().parents[1]
ALONE = "Ray: starting a new local instance (no --address or RAY_ADDRESS: a run of its own, beside "


def _drivers(instance_logs: Path) -> set[str]:
    """The drivers that joined the instance: Ray writes a core-driver log for each into its session."""
    return {p.name for p in instance_logs.glob("python-core-driver-*")}


def _logs_of(processes: dict) -> Path:
    """The session log folder of the instance whose processes (by name) are given (its GCS's --log_dir)."""
    (log_dir,) = [a.split("=", 1)[1] for a in processes["gcs_server"].cmdline() if a.startswith("--log_dir=")]
    return Path(log_dir)


def _raymcn(args: list[str], results: Path, env_extra: dict[str, str] | None = None) -> tuple[int, str, list[str]]:
    """``raymcn ARGS`` in a process of its own, as a user starts it (no RAY_ADDRESS unless given):
    (status, its output, the Ray sessions it started)."""
    private = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env.update(RAYMCN_RESULTS=str(results), RAY_TMPDIR=private, **(env_extra or {}))
    try:
        done = subprocess.run([sys.executable, "-m", "raymcn.cli", *args], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=900)
        sessions = sorted(p.name for p in Path(private, "ray").glob("session_2*"))
    finally:
        subprocess.run(["rm", "-rf", private], check=False)
    return done.returncode, done.stdout + done.stderr, sessions


def _first_ray_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("Ray: "))


def test_a_run_beside_another_ray_instance_is_its_own_and_joins_it_only_when_told(own_ray_instance, tmp_path):  # noqa: F811
    address, processes = own_ray_instance
    logs = _logs_of(processes)
    before = _drivers(logs)

    code, out, sessions = _raymcn(["train", "--config", "sweeps/smoke.yaml", "--num-workers", "2",
                                   "--set", "schedule.epochs=2"], tmp_path / "a")  # the README's, 2 epochs of its 4
    assert code == 0, out[-4000:]
    assert _first_ray_line(out).startswith(ALONE) and "other Ray instance" in _first_ray_line(out), out[-4000:]
    assert len(sessions) == 1 and "final metrics" in out
    run_dir = next((tmp_path / "a").glob("mcn-*"))
    log = (run_dir / "raymcn_console.log").read_text().splitlines()
    tagged = [line for line in log if "[raymcn] epoch " in line]  # rank 0's epoch lines, through Ray's forwarding
    assert len(tagged) == 2 and len(set(tagged)) == 2, tagged  # each written once
    worker_lines = [line for line in log if "RayTrainWorker pid=" in line]
    assert worker_lines and len(worker_lines) == len(set(worker_lines)), "a worker line written twice"

    assert _drivers(logs) == before  # it ran nothing on the instance beside it
    assert all(p.is_running() for p in processes.values())  # ... nor stopped it

    one_epoch = ["train", "--config", "sweeps/smoke.yaml", "--num-workers", "1", "--set", "schedule.epochs=1",
                 "--set", "scale.cpus_per_worker=0.5"]  # the instance has 1 CPU: some left for the reads
    told = [(["--address", address], {}, "given by --address"), ([], {"RAY_ADDRESS": address}, "given by RAY_ADDRESS")]
    for extra, env, why in told:
        code, out, sessions = _raymcn(one_epoch + extra, tmp_path / "c", {**env, "RAY_AUTH_MODE": "disabled"})
        assert code == 0, out[-4000:]
        assert _first_ray_line(out) == f"Ray: connecting to the instance at {address} ({why})", out[-4000:]
        assert sessions == [], "told to join, it started an instance of its own"
    assert len(_drivers(logs) - before) == 2  # both ran on it
