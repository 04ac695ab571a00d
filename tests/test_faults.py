"""Faults on a real local Ray instance: a NaN step.

(A SIGKILLed worker and a reboot mid-epoch: tests/test_resume.py; a killed sweep driver:
tests/test_confirm_ray.py and the launcher tier.)"""


import pytest
from conftest import TINY, event_log_callback, read_events

from raymcn.cli import preset_path
from raymcn.config import load_config
from raymcn.train.on_ray import launch

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_a_permanent_error_fails_at_once_instead_of_being_retried(ray_local, tmp_path, monkeypatch):
    """A diverged loss (non-finite past optim.max_nonfinite_steps) would diverge again after a
    restart: the run fails on the first failure, with the default scale.max_failures."""
    cfg = load_config(preset_path(), ["scale.num_workers=2", "scale.cpus_per_worker=0.5", *TINY,
                                      "optim.max_nonfinite_steps=0"])
    monkeypatch.setenv("RAYMCN_FAULT", "nan_at_step=2")
    log = tmp_path / "events.jsonl"
    with pytest.raises(Exception, match="NonFiniteLossError.*not retried"):
        launch.fit(cfg, tmp_path / "diverged", callbacks=[event_log_callback(log)])
    failures = [e for e in read_events(log) if "failure" in e]
    assert len(failures) == 1 and failures[0]["errors"] == ["NonFiniteLossError"], failures
