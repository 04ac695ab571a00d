"""Builds and runs the ``TorchTrainer`` for one training run (the driver side).

A fresh run gets a unique name: Ray Train resumes silently from the latest checkpoint of an
existing (storage_path, name), so reusing a name is how ``--resume`` works and must never
happen by accident. The resolved config is written next to the run's checkpoints. The storage
may be a local/NFS folder or a bucket URI (``data/storage.py``); run locations are strings.
"""

from __future__ import annotations

import datetime
import os
import secrets
from dataclasses import dataclass

import ray
import ray.train
import ray.train.torch
from ray.train.torch import TorchTrainer
from ray.train.v2.api.callback import UserCallback

from raymcn.config import (PRIMARY_METRIC, PRIMARY_MODE, RUN_CONFIG_FILE, Config, ConfigError, default_storage_path,
                           load_config_text, permanent_cause)
from raymcn.data import storage
from raymcn.train import watchdog
from raymcn.train.plan import plan_run
from raymcn.train.worker import train_func_per_worker

CONFIG_FILE = RUN_CONFIG_FILE


@dataclass
class RunResult:
    metrics: dict[str, float]
    run_dir: str  # a path or a URI
    checkpoint_path: str | None


def new_run_name(cfg: Config) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"mcn-{cfg.schedule.stage_order}-{stamp}-{secrets.token_hex(3)}"


def default_run_dir(cfg: Config) -> str:
    """Where a fresh run of ``cfg`` writes: storage path / (run.name or a new unique name)."""
    return storage.join(default_storage_path(cfg), cfg.run.name or new_run_name(cfg))


def latest_run_dir(cfg: Config) -> str:
    """The run under ``cfg``'s storage path whose config was written last (``--resume latest``)."""
    where = storage.normalize(default_storage_path(cfg))
    found = storage.newest(where, CONFIG_FILE)
    if found is None:
        raise ConfigError([f"--resume latest: no raymcn run (a folder with {CONFIG_FILE}) under {where}"])
    return found


def cluster_problems(cfg: Config, concurrent_runs: int = 1) -> list[str]:
    """The preflight's last check, right after ``ray.init``: the request against
    ``ray.cluster_resources()`` (Ray would otherwise wait forever for what is not there)."""
    have = ray.cluster_resources()
    # an elastic group must be able to start with its minimum (it grows when more is free)
    workers = max(1, cfg.scale.min_workers) * concurrent_runs
    need_cpu = cfg.scale.cpus_per_worker * workers
    problems = []
    if cfg.scale.max_workers and need_cpu + 0.05 > have.get("CPU", 0):
        problems.append(f"scale.num_workers={cfg.scale.workers_text} x scale.cpus_per_worker="
                        f"{cfg.scale.cpus_per_worker} x {concurrent_runs} concurrent run(s) reserves {need_cpu:g} CPUs "
                        f"and Ray Data needs some left; the cluster has {have.get('CPU', 0):g} (Ray would wait "
                        "forever): lower scale.cpus_per_worker or scale.num_workers")
    if cfg.scale.use_gpu and workers > have.get("GPU", 0):
        problems.append(f"scale.use_gpu=true with scale.num_workers={cfg.scale.workers_text} needs {workers} GPUs; "
                        f"the cluster has {have.get('GPU', 0):g}")
    return problems


class PermanentRunError(RuntimeError):
    """A worker failed with an error a restart cannot cure; the run was not retried."""


class FailFastOnPermanentErrors(UserCallback):
    """Ends the run at once when a worker fails with a :class:`~raymcn.config.PermanentError` (or a
    missing file), or when two attempts stalled at the same step and phase (``watchdog``): Ray
    Train's failure policy would otherwise restart the worker group ``scale.max_failures`` times on
    the same bad input. Lost workers and nodes, and a first stall, are left to the policy, which
    restarts from the latest checkpoint."""

    def __init__(self, run_dir: str | None = None):
        self.run_dir = run_dir

    def after_exception(self, run_context, worker_exceptions: dict[int, BaseException]) -> None:
        # Raised in the controller: Ray Train treats a callback's error as not retryable.
        for rank, error in sorted(worker_exceptions.items()):
            cause = permanent_cause(error)
            if cause is not None:
                raise PermanentRunError(f"rank {rank} failed with {type(cause).__name__}: {cause} "
                                        "(a restart from the last checkpoint cannot cure this; not retried)")
        repeated = watchdog.repeated_stall(self.run_dir) if self.run_dir else None
        if repeated:
            raise PermanentRunError(repeated)


def build_trainer(cfg: Config, name: str, storage_path: str, callbacks: list | None = None,
                  label: str = "") -> TorchTrainer:
    """A TorchTrainer for ``cfg`` whose checkpoints live in ``storage_path/name``; its plan (shard
    folder, counts, shares) and the shards' video index are made here, once, and handed to every
    worker. ``label`` names the run's in-epoch progress lines (a sweep's trial name)."""
    from raymcn.data.order import build_index

    plan, manifest = plan_run(cfg)  # the synthetic default is generated and sharded once
    # Where every video's bytes lie: each rank reads exactly its part of each step (data/order.py).
    index = build_index(plan.shards_dir, manifest)
    # Read by the Train controller, which the driver's fit() starts with this variable (Ray propagates it).
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(cfg.scale.worker_start_timeout_s)
    run_dir = storage.join(storage_path, name)
    watchdog.clear(run_dir)  # a stall of an earlier invocation does not make this one's first stall permanent
    resources = {"CPU": cfg.scale.cpus_per_worker}
    if cfg.scale.use_gpu:
        resources["GPU"] = 1  # one GPU per worker: DDP, never DataParallel
    return TorchTrainer(
        train_func_per_worker,
        train_loop_config={"config": cfg.to_dict(), "plan": plan.to_dict(), "index": index,
                           "run_dir": run_dir, "label": label},
        # A collective one rank never joins fails after 2 x run.stall_timeout_s (Ray's default: 30 min),
        # a backstop: the ranks' watchdogs end such a wait after run.stall_timeout_s (train/watchdog.py).
        torch_config=ray.train.torch.TorchConfig(
            timeout_s=int(watchdog.COLLECTIVE_TIMEOUT_FACTOR * cfg.run.stall_timeout_s)),
        scaling_config=ray.train.ScalingConfig(num_workers=cfg.scale.num_workers, use_gpu=cfg.scale.use_gpu,
                                               resources_per_worker=resources,
                                               elastic_resize_monitor_interval_s=cfg.scale.elastic_resize_interval_s),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=storage.normalize(storage_path),
            # Ray keeps the latest checkpoint and the best run.checkpoints_to_keep by R@10: the
            # epoch ends compete; a mid-epoch checkpoint reports the worst score, so it stays on
            # disk only while it is the latest (what a resume needs).
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.run.checkpoints_to_keep,
                                                         checkpoint_score_attribute=PRIMARY_METRIC,
                                                         checkpoint_score_order=PRIMARY_MODE),
            failure_config=ray.train.FailureConfig(max_failures=cfg.scale.max_failures),
            callbacks=[*(callbacks or []), FailFastOnPermanentErrors(run_dir)],  # last: its raise ends the hook
            # Workers see the driver's RAYMCN_* settings (cache and results folders, fault injection).
            worker_runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k.startswith("RAYMCN_")}},
        ),
    )


def run_trainer(cfg: Config, name: str, storage_path: str, callbacks: list | None = None, label: str = ""):
    """Build and fit the TorchTrainer of ``cfg`` (:func:`build_trainer`); returns Ray's Result."""
    return build_trainer(cfg, name, storage_path, callbacks, label).fit()


def fit(cfg: Config, name: str | None = None, storage_path: str | None = None,
        callbacks: list | None = None) -> RunResult:
    """Run training to completion (or resume ``name`` if it already has checkpoints)."""
    default = default_run_dir(cfg)
    storage_path = storage.normalize(storage_path or storage.parent(default))
    name = name or storage.basename(default)
    run_dir = storage.join(storage_path, name)
    storage.write_text(storage.join(run_dir, CONFIG_FILE), cfg.dump_text())
    result = run_trainer(cfg, name, storage_path, callbacks)
    metrics = dict(result.return_value or result.metrics or {})
    ckpt = result.checkpoint.path if result.checkpoint else None
    return RunResult(metrics=metrics, run_dir=run_dir, checkpoint_path=ckpt)


def resume(run_dir: str, overrides: list[str] | None = None) -> RunResult:
    """Continue the run in ``run_dir`` (a path or URI) from its latest checkpoint, with its own saved config."""
    run_dir = storage.normalize(run_dir)
    try:
        text = storage.read_text(storage.join(run_dir, CONFIG_FILE))
    except FileNotFoundError:
        raise ConfigError([f"--resume {run_dir}: no {CONFIG_FILE} there; is it a raymcn run directory?"]) from None
    cfg = load_config_text(text, overrides, source=storage.join(run_dir, CONFIG_FILE))
    if cfg.scale.max_workers == 0:
        raise ConfigError([f"--resume {run_dir}: the run used local mode (scale.num_workers=0), which keeps no "
                           "checkpoints; train with scale.num_workers >= 1 to be able to resume"])
    return fit(cfg, name=storage.basename(run_dir), storage_path=storage.parent(run_dir))
