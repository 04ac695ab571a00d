"""Mid-epoch checkpoints inside a BOHB sweep: Tune's schedulers still see exactly one result per
epoch per trial (the ``budget_epoch`` clock they had), and a paused trial resumes from its newest
checkpoint.

Its own Ray instance, with the dashboard on: when BOHB pauses a trial, Ray Train's placement-group
cleaner frees the paused run's resources only if it can ask the State API (served by the
dashboard) that the run's controller is gone. Without it (the other test modules' Ray) the next
trial waits for those CPUs forever; a cluster started by ``ray up`` or ``ray.init()`` has it on.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from conftest import TINY

from raymcn.cli import preset_path
from raymcn.config import load_config
from raymcn.train.checkpoints import payload as checkpoint
from raymcn.train.stages import budget_epoch

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def ray_with_dashboard():
    ray = pytest.importorskip("ray")
    tests_dir = os.path.dirname(__file__)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))
    if ray.is_initialized():
        ray.shutdown()
    ctx = ray.init(address="local", num_cpus=2, object_store_memory=150 * 1024**2, include_dashboard=True,
                   dashboard_host="127.0.0.1", log_to_driver=False, configure_logging=False)
    yield ctx
    ray.shutdown()


def test_a_bohb_sweep_checkpointing_mid_epoch_reports_one_result_per_epoch(ray_with_dashboard, tmp_path):
    """A checkpoint every 2 steps (one inside each 4-step epoch); BOHB pauses trials at its rungs
    and resumes the promoted ones. Each trial's results are epochs 1, 2, ... once each, at that
    epoch's step count and budget clock, with none repeated after a pause."""
    from raymcn.sweep import tuner

    epochs = 4
    cfg = load_config(preset_path(), [  # one worker per trial: Tune's results are rank 0's either way
        "scale.num_workers=1", "scale.cpus_per_worker=0.5", *TINY, f"schedule.epochs={epochs}",
        "schedule.stage1_fraction=0.25", "run.checkpoint_every=2", "run.checkpoints_to_keep=50",
        "sweep.algorithm=bohb", "sweep.num_samples=3", "sweep.repeats=1", "sweep.grace_epochs=1",
        "sweep.reduction_factor=2", "sweep.max_concurrent=1", "sweep.space={optim.lr: {loguniform: [0.001, 0.01]}}",
        "sweep.confirm={}",
        "run.name=bohb", f"run.storage_path={tmp_path}"])
    result = tuner.run_sweep(cfg)
    assert result.num_errors == 0 and result.num_unfinished == 0
    rows: dict[str, list[dict]] = {}
    for f in (tmp_path / "bohb").glob("*/result.json"):
        lines = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        rows[lines[0]["trial_id"]] = lines
    assert len(rows) == 3
    for trial, lines in rows.items():
        assert not any("mid_epoch" in r for r in lines)
        seen = [int(r["epoch"]) for r in lines]
        assert seen == list(range(1, len(seen) + 1)), (trial, seen)  # one result per epoch, none repeated
        assert [int(r["global_step"]) for r in lines] == [4 * e for e in seen], trial
        assert [r["budget_epoch"] for r in lines] == [budget_epoch(e, math.ceil(0.25 * epochs)) for e in seen], trial
    assert max(len(lines) for lines in rows.values()) > 2, "no trial went past its first rung"
    mid = [ck for run in (tmp_path / "bohb" / "train").glob("train-*") for ck in checkpoint.list_checkpoints(run)
           if json.loads((ck / checkpoint.META_FILE).read_text())["progress"]["steps"]]
    assert mid, "no mid-epoch checkpoint was taken"
