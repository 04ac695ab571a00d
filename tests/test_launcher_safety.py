"""`make test` is safe beside a running Ray: the launcher tier (whose `ray up` and `ray down` run
`ray stop`, ending every Ray instance of the machine) stands aside when one is up, and the other
tiers start instances of their own (``ray.init(address="local")``) and stop only those.

Proved for real: a `ray start --head` on a port of its own, the launcher tier run beside it in a
fresh pytest, and a driver connecting to that instance afterwards (it still answers, with the one
CPU it was started with)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import free_port, stop_shared_ray
from test_launcher import RAY, RUNNING_RAY, running_ray

from bench.services import free_port

pytestmark = [pytest.mark.launcher, pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[1]


def test_the_launcher_tier_leaves_a_running_ray_instance_alone():
    stop_shared_ray()  # the suite's own Ray instance: ours to stop (started again by the next module)
    if running_ray():
        pytest.skip(f"{RUNNING_RAY} already ({running_ray()}): this test starts and stops one of its own")
    port = free_port()
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")  # no token to share with `ray status`
    dot_ray = Path.home() / ".ray"
    before = sorted(dot_ray.rglob("*")) if dot_ray.exists() else None  # what ~/.ray held, if it existed
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    started = subprocess.run([RAY, "start", "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
                              f"--temp-dir={temp}"], env=env, capture_output=True, text=True, timeout=120)
    try:
        assert started.returncode == 0, started.stderr[-2000:]
        tier = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-m", "launcher", "-p", "no:cacheprovider",
                               "tests/test_launcher.py"], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)
        assert RUNNING_RAY in tier.stdout and " passed" not in tier.stdout, tier.stdout[-3000:]
        probe = ("import ray; ray.init(address='127.0.0.1:%d', log_to_driver=False); "
                 "print('CPU', ray.cluster_resources().get('CPU'))" % port)
        alive = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        assert "CPU 1.0" in alive.stdout, alive.stdout + alive.stderr[-2000:]  # still up, still the one started
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)  # the one it started
        shutil.rmtree(temp, ignore_errors=True)
        if before is None:
            shutil.rmtree(dot_ray, ignore_errors=True)
        else:
            for path in sorted(set(dot_ray.rglob("*")) - set(before), reverse=True):
                path.unlink() if path.is_file() else path.rmdir()
