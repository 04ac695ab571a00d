"""Faults on a real local Ray instance: a SIGKILLed worker, a NaN step."""

import pytest

from raymcn.cli import preset_path
from raymcn.config import load_config
from raymcn.train import launch

from conftest import TINY

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# Differences after a restart come only from timing; the training itself is deterministic on CPU.
TOLERANCE = dict(rel=1e-5, abs=1e-5)


def test_killed_worker_restarts_from_checkpoint_and_matches(ray_local, tmp_path, monkeypatch):
    cfg = load_config(preset_path(), ["scale.num_workers=2", "scale.cpus_per_worker=0.5", "scale.max_failures=2",
                                      *TINY])
    reference = launch.fit(cfg, name="reference", storage_path=tmp_path)
    steps_per_epoch = int(reference.metrics["global_step"]) // 3
    # SIGKILL rank 1 in the middle of epoch 2; the group restarts from the epoch-1 checkpoint
    monkeypatch.setenv("RAYMCN_FAULT", f"kill_at_step={steps_per_epoch + 2}")
    monkeypatch.setenv("RAYMCN_FAULT_DIR", str(tmp_path / "fault-markers"))
    killed = launch.fit(cfg, name="killed", storage_path=tmp_path)
    assert (tmp_path / "fault-markers" / "fired-kill_at_step").exists()  # the kill did happen
    assert killed.metrics["epoch"] == 3 and killed.metrics["global_step"] == reference.metrics["global_step"]
    for key in ("total_loss", "cluster_loss", "text_to_video_R@10", "text_to_video_MedR"):
        assert killed.metrics[key] == pytest.approx(reference.metrics[key], **TOLERANCE), key
