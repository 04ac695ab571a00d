"""The fidelity rule: warm-up measured in videos, so early rungs compare runs of any batch size at
the same point of the LR schedule; the paper's defaults still give its 5000 warm-up steps."""

import math

import pytest

from raymcn.cli import preset_path
from raymcn.config import Config, ConfigError, load_config
from raymcn.train.optim import lr_factor
from raymcn.train.run_plan import make_plan, warmup_steps

HOWTO100M_VIDEOS = 1_238_911  # any corpus of the paper's size; the default does not depend on it


def test_paper_defaults_give_5000_warmup_steps_at_batch_128():
    cfg = Config()
    assert warmup_steps(cfg) == 5000
    plan = make_plan(cfg, HOWTO100M_VIDEOS)
    assert plan.warmup_steps == 5000 and plan.total_steps == 30 * (HOWTO100M_VIDEOS // 128)


def test_warmup_ends_after_the_same_videos_at_every_batch_size():
    base = load_config(preset_path(), {"scale.num_workers": 0})  # 256 videos, warm-up 256 videos
    plans = {b: make_plan(base.replace({"data.batch_size": b}), 256) for b in (8, 16, 32)}
    assert {b: p.warmup_steps for b, p in plans.items()} == {8: 32, 16: 16, 32: 8}
    assert {p.warmup_epochs for p in plans.values()} == {1.0}
    # at every epoch boundary the LR factor is the same whatever the batch: a rung compares like with like
    for epoch in range(11):
        factors = {round(lr_factor(epoch * p.steps_per_epoch, p.warmup_steps, p.total_steps), 12)
                   for p in plans.values()}
        assert len(factors) == 1, (epoch, factors)


def test_a_fixed_step_count_still_means_steps_and_differs_across_batch_sizes():
    base = load_config(preset_path(), {"scale.num_workers": 0, "optim.warmup_steps": 16})
    epochs = {b: make_plan(base.replace({"data.batch_size": b}), 256).warmup_epochs for b in (8, 32)}
    assert epochs == {8: 0.5, 32: 2.0}  # what was measured before: the first rung compared unlike runs


def test_warmup_rounds_up_to_whole_steps():
    cfg = load_config(preset_path(), {"scale.num_workers": 0, "optim.warmup_videos": 100, "data.batch_size": 32})
    assert warmup_steps(cfg) == math.ceil(100 / 32) == 4


def test_multi_fidelity_sweep_over_batch_size_refuses_a_fixed_step_warmup():
    space = {"data.batch_size": {"choice": [8, 32]}}
    with pytest.raises(ConfigError, match="optim.warmup_steps=16 fixes the warm-up in steps"):
        load_config(preset_path(), {"optim.warmup_steps": 16, "sweep.algorithm": "asha", "sweep.space": space,
                                    "sweep.confirm": {}})
    # random search trains every trial to the end: no rung to be unfair at
    load_config(preset_path(), {"optim.warmup_steps": 16, "sweep.algorithm": "random", "sweep.space": space,
                                "sweep.repeats": 1, "sweep.confirm": {}})


@pytest.mark.parametrize("grace, starts", [(1, [1, 3, 9]), (2, [3, 9]), (3, [3, 9]), (4, [9]), (9, [9])])
def test_bohb_brackets_start_no_earlier_than_the_first_rung(grace, starts):
    """HyperBand's brackets over max_t = 9 budget epochs (eta 3) start at 9, 3 and 1; with
    sweep.grace_epochs the brackets that would compare trials earlier are dropped."""
    pytest.importorskip("ray")
    from raymcn.sweep.tuner import build_search

    cfg = load_config(preset_path(), {"schedule.epochs": 10, "schedule.stage1_fraction": 0.1, "sweep.algorithm": "bohb",
                                      "sweep.reduction_factor": 3, "sweep.grace_epochs": grace, "sweep.repeats": 1,
                                      "sweep.space": {"optim.lr": {"loguniform": [1e-4, 1e-2]}}, "sweep.confirm": {}})
    _, hb = build_search(cfg)
    assert sorted(hb._get_r0(s) for s in range(hb._s_max_1)) == starts


@pytest.mark.parametrize("algorithm", ["asha", "bohb"])
def test_a_first_rung_past_the_budget_is_refused_naming_both_settings(algorithm):
    """grace_epochs beyond the epochs after stage 1 would stop nothing early (and stage 1 filling
    the run would leave the clock no epoch at all)."""
    base = {"schedule.epochs": 10, "schedule.stage1_fraction": 0.1, "sweep.algorithm": algorithm, "sweep.repeats": 1,
            "sweep.space": {"optim.lr": {"loguniform": [1e-4, 1e-2]}}, "sweep.confirm": {}}
    with pytest.raises(ConfigError, match=r"sweep.grace_epochs=12: schedule.epochs=10 with schedule.stage1_fraction=0.1 "
                                          r"leaves 9 epochs after stage 1 \(1 epochs\).*allowed 1..9"):
        load_config(preset_path(), {**base, "sweep.grace_epochs": 12})
    with pytest.raises(ConfigError, match=r"stage1_fraction=0.95 leaves 0 epochs after stage 1.*no rung could ever"):
        load_config(preset_path(), {**base, "schedule.stage1_fraction": 0.95})


def test_preflight_refuses_a_first_rung_inside_the_warmup(tmp_path, monkeypatch):
    from raymcn.train.preflight import checks as preflight

    monkeypatch.setenv("RAYMCN_RESULTS", str(tmp_path))
    base = {"sweep.algorithm": "asha", "schedule.stage1_fraction": 0.1, "schedule.epochs": 10, "sweep.repeats": 1,
            "sweep.grace_epochs": 1, "sweep.space": {"data.batch_size": {"choice": [8, 32]}}, "sweep.confirm": {}}
    ok = load_config(preset_path(), base)  # warm-up 1 epoch (256 videos), first rung after epoch 2
    assert preflight._rung_problems(ok, 256) == []
    late = ok.replace({"optim.warmup_videos": 768})  # 3 epochs of warm-up
    (problem,) = preflight._rung_problems(late, 256)
    assert "ends after the first rung of the asha sweep (epoch 2" in problem and "data.batch_size=8" in problem
    assert preflight._rung_problems(late.replace({"sweep.grace_epochs": 2}), 256) == []
