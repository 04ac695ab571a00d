"""Single runs in Ray Train's local mode (num_workers=0: the same loop, in-process, no workers).

Local mode keeps no checkpoints, so resume is tested with real workers in test_train_ray.py. The
shards are still read through Ray Data, which needs a Ray instance: the module's own small one.
"""

import math

import pytest
import yaml
from conftest import TINY

from raymcn.cli import preset_path
from raymcn.config import ConfigError, load_config
from raymcn.train.loop import NonFiniteLossError
from raymcn.train.on_ray import launch

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_local):
    yield


def tiny(*extra):
    return load_config(preset_path(), ["scale.num_workers=0", *TINY, *extra])


def test_run_dir_holds_resolved_config(tmp_path):
    cfg = tiny("schedule.epochs=1")
    result = launch.fit(cfg, tmp_path / "cfg")
    saved = yaml.safe_load((tmp_path / "cfg" / launch.CONFIG_FILE).read_text())
    assert saved["schedule"]["epochs"] == 1 and saved["data"]["batch_size"] == 16
    assert result.run_dir == str(tmp_path / "cfg")
    for key in ("text_to_video_R@1", "text_to_video_R@5", "text_to_video_R@10", "text_to_video_MedR",
                "total_loss", "contrastive_loss", "cluster_loss", "recon_loss", "eval_size",
                "time_data_s", "time_forward_s", "time_loss_s", "time_backward_s", "time_optimizer_s",
                "samples_per_s"):
        assert key in result.metrics and math.isfinite(result.metrics[key]), key


def test_fresh_runs_get_unique_names(tmp_path):
    cfg = tiny()
    assert launch.new_run_name(cfg) != launch.new_run_name(cfg)


def test_nonfinite_loss_stops_with_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYMCN_FAULT", "nan_at_step=2")
    with pytest.raises(NonFiniteLossError, match="non-finite for 1 consecutive steps"):
        launch.fit(tiny("optim.max_nonfinite_steps=0", "schedule.epochs=1"), tmp_path / "nan")


def test_nonfinite_step_is_skipped_and_counted(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYMCN_FAULT", "nan_at_step=2")
    result = launch.fit(tiny("optim.max_nonfinite_steps=1", "schedule.epochs=1"), tmp_path / "skip")
    assert result.metrics["skipped_steps"] == 1
    assert math.isfinite(result.metrics["total_loss"])


@pytest.mark.parametrize("order", ["AV_T", "VT_A", "AT_V"])
def test_staged_orders_switch_stage(tmp_path, order):
    result = launch.fit(tiny(f"schedule.stage_order={order}", "schedule.stage1_fraction=0.5"), tmp_path / order)
    assert result.metrics["stage"] == 2  # the last epoch trained all three modalities
    assert {"tv_contrastive_loss", "at_contrastive_loss", "av_contrastive_loss"} <= set(result.metrics)


def test_local_mode_cannot_resume(tmp_path):
    launch.fit(tiny("schedule.epochs=1"), tmp_path / "local")
    with pytest.raises(ConfigError, match="local mode"):
        launch.resume(tmp_path / "local")


def test_a_tilde_shard_path_works_in_preflight_and_training(tmp_path, monkeypatch):
    """`--set data.shards=~/...`: the preflight and the trainer resolve it in one place (the plan)."""
    import shutil

    from raymcn.train.inputs import resolve_inputs, shard_folder
    from raymcn.train.preflight import checks as preflight

    home = tmp_path / "home"
    shutil.copytree(shard_folder(tiny()), home / "shards")  # the cached synthetic shards
    monkeypatch.setenv("HOME", str(home))
    cfg = tiny("data.shards=~/shards", "schedule.epochs=1", f"run.storage_path={tmp_path}/runs")
    plan = preflight.checked_plan(cfg, resolve_inputs(cfg), device_bytes=16 << 30)
    assert plan.shards_dir == str(home / "shards")
    result = launch.fit(cfg, tmp_path / "runs" / "tilde", plan=plan)
    assert result.metrics["epoch"] == 1 and result.metrics["bad_samples"] == 0
