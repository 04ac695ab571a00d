"""A trial's workers on one server: the trainer asks Ray for STRICT_PACK when its largest group fits one
node (the lab's 4-GPU trial on a 4-GPU server), PACK otherwise (a group no node holds, an elastic
range whose maximum needs two servers)."""

from __future__ import annotations

from conftest import preset

from raymcn.train.on_ray import cluster

LAB_SERVER = {"CPU": 64.0, "GPU": 4.0, "memory": 5e11}
CPU_HEAD = {"CPU": 8.0}


def test_a_group_that_fits_one_node_is_strictly_packed():
    cfg = preset("scale.num_workers=4", "scale.use_gpu=true", "scale.cpus_per_worker=8")
    assert cluster.placement_strategy(cfg, [CPU_HEAD, LAB_SERVER, LAB_SERVER]) == "STRICT_PACK"


def test_a_group_no_node_holds_may_spread():
    gpus = preset("scale.num_workers=8", "scale.use_gpu=true")
    assert cluster.placement_strategy(gpus, [LAB_SERVER, LAB_SERVER]) == "PACK"
    cpus = preset("scale.num_workers=4", "scale.use_gpu=true", "scale.cpus_per_worker=32")  # 4 GPUs, 128 CPUs
    assert cluster.placement_strategy(cpus, [LAB_SERVER, LAB_SERVER]) == "PACK"
    assert cluster.placement_strategy(preset("scale.num_workers=2"), []) == "PACK"  # before ray.init: nothing known


def test_an_elastic_group_is_judged_by_its_maximum():
    assert cluster.placement_strategy(preset("scale.num_workers=4-8", "scale.use_gpu=true"), [LAB_SERVER] * 2) == "PACK"
    assert cluster.placement_strategy(preset("scale.num_workers=2-4", "scale.use_gpu=true"), [LAB_SERVER] * 2) == "STRICT_PACK"


def test_the_trainer_carries_the_strategy(monkeypatch, tmp_path):
    from raymcn.train.on_ray.launch import build_trainer
    from raymcn.train.run_plan import make_plan

    cfg = preset("scale.num_workers=2", "scale.cpus_per_worker=1")
    monkeypatch.setattr(cluster, "node_resources", lambda: [{"CPU": 2.0}])
    trainer = build_trainer(cfg, make_plan(cfg, 256), str(tmp_path / "run"))
    assert trainer.scaling_config.placement_strategy == "STRICT_PACK"
    monkeypatch.setattr(cluster, "node_resources", lambda: [{"CPU": 1.0}] * 3)  # tests/test_multinode.py's nodes
    trainer = build_trainer(cfg, make_plan(cfg, 256), str(tmp_path / "run"))
    assert trainer.scaling_config.placement_strategy == "PACK"


def test_a_commands_raymcn_settings_reach_every_process_of_its_job(monkeypatch):
    """On a cluster, trial drivers and Train's workers are started by raylets that never saw the
    command's environment: its RAYMCN_* settings go into the job's runtime environment, whether
    the command connects or starts a local instance (no Ray is started here)."""
    calls = []
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cluster.ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(cluster.ray, "shutdown", lambda: None)
    monkeypatch.setattr(cluster, "wait_for_gcs", lambda *args, **kwargs: None)  # no cluster at 10.0.0.1 here
    settings = {"RAYMCN_TRACE": "/shared/trace", "RAYMCN_CACHE": "/data/cache"}
    with cluster.ray_session("10.0.0.1:6379", settings) as started:
        assert not started
    with cluster.ray_session("local", settings) as started:
        assert started
    connected, local = calls
    assert connected["address"] == "10.0.0.1:6379" and connected["runtime_env"] == {"env_vars": settings}
    assert local["runtime_env"]["env_vars"] == {**settings, **cluster.local_instance_env(local["dashboard_port"])}
    with cluster.ray_session("10.0.0.1:6379"):
        assert "runtime_env" not in calls[-1]  # nothing to hand on: the job's environment left as Ray makes it


def test_workers_sharing_a_gpu_reserve_their_share_and_talk_over_gloo(monkeypatch, tmp_path):
    """``scale.gpus_per_worker`` below 1: each worker reserves that share of a GPU and the group runs
    over gloo (NCCL refuses two ranks on one GPU); a GPU of its own: Ray Train's default, NCCL; CPU
    workers: no GPU asked for, gloo by Ray Train's default. What the trainer is built with, no Ray."""
    from raymcn.train.on_ray.launch import build_trainer
    from raymcn.train.run_plan import make_plan

    monkeypatch.setattr(cluster, "node_resources", lambda: [LAB_SERVER])
    cases = {("scale.use_gpu=true", "scale.gpus_per_worker=0.5"): ("gloo", "gloo", {"CPU": 1.0, "GPU": 0.5}),
             ("scale.use_gpu=true", "scale.gpus_per_worker=1"): (None, "nccl", {"CPU": 1.0, "GPU": 1.0}),
             ("scale.use_gpu=false", "scale.gpus_per_worker=0.5"): (None, "gloo", {"CPU": 1.0})}
    for overrides, (ours, backend, resources) in cases.items():
        cfg = preset("scale.num_workers=2", "scale.cpus_per_worker=1", *overrides)
        assert (cluster.process_group_backend(cfg), cluster.worker_resources(cfg)) == (ours, resources), overrides
        trainer = build_trainer(cfg, make_plan(cfg, 256), str(tmp_path / "run"))
        assert trainer.backend_config.backend == backend, overrides  # as Ray Train resolves it
        assert trainer.scaling_config.resources_per_worker == resources, overrides
        assert trainer.scaling_config.use_gpu is ("scale.use_gpu=true" in overrides), overrides
