"""bench.gpu_smoke, the one command someone with a GPU runs: checked here on CPU at its smoke size
(``--device cpu --smoke``: the suite's smoke run of it), in a process where Ray cannot be imported
(the benchmark must not need it). On a machine with CUDA the ``gpu`` test runs it on the GPU and
checks the memory estimate against the peak."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import last_json

ROOT = Path(__file__).resolve().parents[1]


def _smoke(tmp_path: Path, *args: str) -> dict:
    blocked = tmp_path / "no_ray" / "ray"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text('raise ImportError("ray is not installed on this machine")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked.parent), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_smoke", *args, "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert last_json(proc.stdout) == report
    return report


@pytest.mark.slow  # every variant's step on CPU: the full tier
def test_the_gpu_smoke_runs_every_variant_without_ray(tmp_path):
    report = _smoke(tmp_path, "--device", "cpu", "--smoke")
    assert set(report["variants"]) == {"plain", "cached", "ring"}
    for name, v in report["variants"].items():
        assert all(math.isfinite(x) for x in v["losses"].values()), name
        assert {"data", "forward", "loss", "backward", "optimizer"} <= set(v["phases_s"]), name
        assert v["samples_per_s"] > 0 and v["estimate_bytes"] > 0
    assert report["variants"]["cached"]["phases_s"]["reforward"] > 0  # the cached step did cache
    assert report["variants"]["plain"]["phases_s"]["reforward"] == 0
    # on one rank the ring is the gathered loss: the same terms
    plain, ring = report["variants"]["plain"]["losses"], report["variants"]["ring"]["losses"]
    assert plain.keys() == ring.keys()
    assert all(math.isclose(plain[k], ring[k], rel_tol=1e-5) for k in plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_the_estimate_is_never_below_the_peak(tmp_path):
    report = _smoke(tmp_path, "--steps", "3")
    for name, v in report["variants"].items():
        assert v["estimate_over_peak"] >= 1.0, (name, v)
