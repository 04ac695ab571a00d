"""`make test` is safe beside a running Ray: the launcher tier (whose `ray up` and `ray down` run
`ray stop`, ending every Ray instance of the machine) stands aside when one is up, and the other
tiers start instances of their own (``ray.init(address="local")``) and stop only those.

Proved for real: a `ray start --head` on a port of its own, the launcher tier run beside it in a
fresh pytest, and that instance found still answering afterwards."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from test_launcher import RAY, RUNNING_RAY, running_ray

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_launcher_tier_leaves_a_running_ray_instance_alone(tmp_path):
    if running_ray():
        pytest.skip(f"{RUNNING_RAY} already ({running_ray()}): this test starts and stops one of its own")
    port = _free_port()
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    dot_ray = Path.home() / ".ray"
    before = sorted(dot_ray.rglob("*")) if dot_ray.exists() else None  # what ~/.ray held, if it existed
    started = subprocess.run([RAY, "start", "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
                              f"--temp-dir={tmp_path / 'ray'}"], env=env, capture_output=True, text=True, timeout=120)
    try:
        assert started.returncode == 0, started.stderr[-2000:]
        tier = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-m", "launcher", "-p", "no:cacheprovider",
                               "tests/test_launcher.py"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert RUNNING_RAY in tier.stdout and " passed" not in tier.stdout, tier.stdout[-3000:]
        status = subprocess.run([RAY, "status", f"--address=127.0.0.1:{port}"], env=env, capture_output=True,
                                text=True, timeout=60)
        assert status.returncode == 0 and "1.0 CPU" in status.stdout, status.stdout + status.stderr
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)  # the one it started
        if before is None:
            shutil.rmtree(dot_ray, ignore_errors=True)
        else:
            for path in sorted(set(dot_ray.rglob("*")) - set(before), reverse=True):
                path.unlink() if path.is_file() else path.rmdir()
