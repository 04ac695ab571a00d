"""Builds and runs the ``TorchTrainer`` for one training run (the driver side).

A fresh run gets a unique name: Ray Train resumes silently from the latest checkpoint of an
existing (storage_path, name), so reusing a name is how ``--resume`` works and must never
happen by accident. The resolved config is written next to the run's checkpoints, and the
driver's provenance entry is added to the run's record (``train/run_record.py``). The storage
may be a local/NFS folder or a bucket URI (``storage.py``); run locations are strings.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import posixpath
import secrets
from dataclasses import dataclass

import ray
import ray.train
import ray.train.torch
from ray.train.torch import TorchTrainer
from ray.train.v2.api.callback import UserCallback

from raymcn import storage
from raymcn.config import (
    METRICS_FILE,
    REHEARSAL_FILE,
    RUN_CONFIG_FILE,
    Config,
    ConfigError,
    default_storage_path,
    load_config_text,
    objective,
    permanent_cause,
)
from raymcn.environment import Environment
from raymcn.provenance import record
from raymcn.train import run_record
from raymcn.train.checkpoints import payload as checkpoint
from raymcn.train.checkpoints import persist, space
from raymcn.train.inputs import resolve_inputs
from raymcn.train.monitor import history, trackers, watchdog
from raymcn.train.monitor.console import tagged, write_line
from raymcn.train.on_ray import cluster, preemption
from raymcn.train.on_ray.cluster import scoped_env
from raymcn.train.on_ray.worker import train_func_per_worker
from raymcn.train.run_plan import RunPlan, plan_of

CONFIG_FILE = RUN_CONFIG_FILE


@dataclass
class RunResult:
    metrics: dict[str, float]
    run_dir: str  # a path or a URI
    checkpoint_path: str | None


def new_run_name(cfg: Config) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"mcn-{cfg.schedule.stage_order}-{stamp}-{secrets.token_hex(3)}"


def new_run_dir(cfg: Config) -> str:
    """Where a fresh run of ``cfg`` writes: its storage path / (run.name or a new unique name).
    The one place a run's folder is decided; everything after receives it."""
    return storage.join(default_storage_path(cfg), cfg.run.name or new_run_name(cfg))


RESUMED = "unfinished and not a rehearsal"  # the runs `--resume latest` continues, as the console says it


def latest_run_dir(cfg: Config) -> tuple[str, str]:
    """``raymcn train --resume latest``: the newest run under ``cfg``'s storage path (by when its
    config was written) that is neither finished nor a rehearsal, as a boot picks a sweep, and the
    line naming it and the newer runs skipped, with why.

    Raises:
        ConfigError: no run there, or each is finished or a rehearsal (named).
    """
    return storage.latest(default_storage_path(cfg), CONFIG_FILE, "raymcn run", not_resumed_because, RESUMED)


def not_resumed_because(run_dir: str) -> str | None:
    """Why ``--resume latest`` leaves the run in ``run_dir`` alone: a rehearsal (its mark), or finished
    (its metrics.csv holds its config's last epoch); None when it continues it."""
    names = storage.files(run_dir)
    if REHEARSAL_FILE in names:
        return "a rehearsal: `--resume RUN_DIR` continues it"
    if METRICS_FILE not in names:
        return None
    try:
        epochs = load_config_text(storage.read_text(storage.join(run_dir, CONFIG_FILE))).schedule.epochs
    except (ConfigError, OSError, ValueError):  # a config this version cannot read: not known to be finished
        return None
    done = max(history.EpochTable(run_dir).rows, default=0)
    return f"finished: its {METRICS_FILE} holds all {epochs} epochs" if done >= epochs else None


class PermanentRunError(RuntimeError):
    """A worker failed with an error a restart cannot cure; the run was not retried. ``cause``: that
    error (``config.permanent_cause`` finds it there: Ray hands this error to the driver pickled,
    which keeps attributes, not ``__cause__``); None for a stall seen twice."""

    def __init__(self, message: str, cause: BaseException | None = None):
        super().__init__(message, cause)
        self.cause = cause

    def __str__(self) -> str:
        return str(self.args[0])


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
                                        "(a restart from the last checkpoint cannot cure this; not retried)", cause)
        repeated = watchdog.repeated_stall(self.run_dir) if self.run_dir else None
        if repeated:
            raise PermanentRunError(repeated)


class TrackersOnController(UserCallback):
    """``run.trackers`` of a single run, fed rank 0's metrics of every report on Ray Train's
    controller (``trackers.EpochReports``). Ray pins the controller to the driver's node, so a run
    stored in a bucket keeps its trackers' files in the driver's cache whichever node holds rank
    0, and no rank waits on a tracker at an epoch's end."""

    def __init__(self, cfg: Config, run_dir: str, epochs: int):
        self.reports = trackers.EpochReports(cfg, run_dir, epochs, say=_to_terminal)

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        self.reports.report(metrics[0] if metrics else {})


def _to_terminal(line: str) -> None:
    """A line of Ray Train's controller for the terminal: Ray forwards the controller's output to
    the driver, whose console shows a tagged line."""
    write_line(tagged(line))


NO_SETTINGS = Environment()  # no RAYMCN_* setting handed on


def worker_env(env: Environment) -> dict[str, str]:
    """What the workers' environment gets from the driver: its ``RAYMCN_*`` settings ``env`` (cache
    and results folders, fault injection, the trace and the timeline), which a worker reads at its
    start, and PyTorch's NCCL error handling (``watchdog.NCCL_ERROR_HANDLING``: a NCCL timeout
    raises, named as a stall, instead of ending the process unnamed; a value already set in the
    driver's environment wins)."""
    return {**env.variables(), **{k: os.environ.get(k, v) for k, v in watchdog.NCCL_ERROR_HANDLING.items()}}


def controller_env(cfg: Config) -> dict[str, str]:
    """What Ray Train's controller reads from the driver's environment when ``fit()`` starts it (Ray
    has no other way to set it): how long a worker group may take to start."""
    return {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(cfg.scale.worker_start_timeout_s)}


def build_trainer(cfg: Config, plan: RunPlan, run_dir: str, callbacks: list | None = None, label: str = "",
                  env: Environment = NO_SETTINGS) -> TorchTrainer:
    """A TorchTrainer for ``cfg`` whose checkpoints live in ``run_dir``; every worker runs
    ``worker.train_func_per_worker`` and receives the config and ``plan`` (made on the driver,
    inputs and video index included) and, in its runtime environment, the driver's settings
    ``env``. ``label`` names the run's in-epoch progress lines (a sweep's trial name). Its
    ``fit()`` runs inside ``scoped_env(controller_env(cfg))``."""
    watchdog.clear(run_dir)  # a stall of an earlier invocation does not make this one's first stall permanent
    # (a run without workers feeds its trackers from its in-process rank: worker.Reports)
    tracking = [TrackersOnController(cfg, run_dir, plan.epochs)] if cfg.run.trackers and plan.max_workers else []
    ranked = objective(cfg.sweep.metric)
    return TorchTrainer(
        train_func_per_worker,
        train_loop_config={"config": cfg, "plan": plan, "run_dir": run_dir, "label": label},
        # A collective one rank never joins fails after run.collective_timeout_s (default 2 x
        # run.stall_timeout_s; Ray's default: 30 min), a backstop: the ranks' watchdogs end such a
        # wait first, their limits capped below it (monitor/watchdog.py).
        torch_config=ray.train.torch.TorchConfig(backend=cluster.process_group_backend(cfg),
                                                 timeout_s=math.ceil(cfg.run.collective_timeout)),
        scaling_config=ray.train.ScalingConfig(num_workers=cfg.scale.num_workers, use_gpu=cfg.scale.use_gpu,
                                               resources_per_worker=cluster.worker_resources(cfg),
                                               placement_strategy=cluster.placement_strategy(cfg, cluster.node_resources()),
                                               elastic_resize_monitor_interval_s=cfg.scale.elastic_resize_interval_s),
        run_config=ray.train.RunConfig(
            # Ray names a run by (storage path, name): the run dir's parent and its last component.
            name=storage.basename(run_dir),
            storage_path=storage.parent(run_dir),
            # Ray keeps the latest checkpoint and the best run.checkpoints_to_keep by sweep.metric's
            # metric: the epoch ends compete; a mid-epoch checkpoint reports the worst score, so it
            # stays on disk only while it is the latest (what a resume needs).
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.run.checkpoints_to_keep,
                                                         checkpoint_score_attribute=ranked.reported,
                                                         checkpoint_score_order=ranked.mode),
            failure_config=preemption.failure_config(cfg),  # a drained node's restart counted apart
            callbacks=[*(callbacks or []), *tracking, FailFastOnPermanentErrors(run_dir)],  # last: its raise ends the hook
            worker_runtime_env={"env_vars": worker_env(env)},
        ),
    )


def fit(cfg: Config, run_dir: str | os.PathLike | None = None, *, plan: RunPlan | None = None,
        callbacks: list | None = None, label: str = "", env: Environment | None = None,
        entry: dict | None = None) -> RunResult:
    """Run training to completion in ``run_dir`` (default: :func:`new_run_dir`), or resume it if
    it already has checkpoints. ``plan``: the run's plan when the caller made it (its preflight
    did); otherwise it is made here, once. ``env``: the driver's settings, read at its start (the
    command line's), handed to the workers; None: a program calling this as its entry, whose
    variables are read here. ``entry``: the driver's provenance entry, added to the run's record
    (``run_record.driver_entry``; made here when not given)."""
    env = Environment.read() if env is None else env
    run_dir = storage.normalize(str(run_dir)) if run_dir is not None else new_run_dir(cfg)
    if plan is None:
        plan = plan_of(cfg, resolve_inputs(cfg))
    storage.write_text(storage.join(run_dir, CONFIG_FILE), cfg.dump_text())
    for name in persist.remove_partials(*storage.filesystem(run_dir)):
        _to_terminal(f"removed {storage.join(run_dir, name)}: a checkpoint's copy that never finished (its process "
                     "ended in the middle)")
    record.append(run_dir, entry or run_record.driver_entry(cfg, plan.inputs))
    trainer = build_trainer(cfg, plan, run_dir, callbacks, label, env=env)
    with scoped_env(controller_env(cfg)):
        result = trainer.fit()
    metrics = dict(result.return_value or result.metrics or {})
    ckpt = result.checkpoint.path if result.checkpoint else None
    return RunResult(metrics=metrics, run_dir=run_dir, checkpoint_path=ckpt)


def checkpoints_held(run_dir: str) -> int:
    """Bytes the checkpoints of the run in ``run_dir`` hold in its storage (0 in a bucket, whose
    free space the preflight does not check)."""
    if storage.is_uri(run_dir):
        return 0
    return sum(space.folder_bytes(p) for p in checkpoint.list_checkpoints(storage.normalize(run_dir)))


def newest_checkpoint(run_dir: str) -> str | None:
    """The newest checkpoint folder of the run in ``run_dir`` (a path or URI), as a path on its
    storage's filesystem (the form of ``ray.train.Checkpoint.path``); None: it has none."""
    fs, path = storage.filesystem(storage.normalize(run_dir))
    newest = storage.subfolders(fs, path, prefix="checkpoint_")[-1:]
    return newest[0] if newest else None


def finished_metrics(run_dir: str, epochs: int) -> dict[str, float] | None:
    """The last epoch's metrics when the run in ``run_dir`` (a path or URI) has a checkpoint at the
    end of epoch ``epochs``, its last; else None (not started, or more to train)."""
    newest = newest_checkpoint(run_dir)
    try:
        loop = json.loads(storage.read_text(storage.join(run_dir, posixpath.basename(newest), checkpoint.META_FILE)))
        if int(loop["epoch"]) < epochs or loop.get("progress", {}).get("steps", 0):
            return None
        return json.loads(storage.read_text(storage.join(run_dir, posixpath.basename(newest),
                                                         checkpoint.METRICS_META_FILE)))
    except (TypeError, FileNotFoundError, ValueError, KeyError):  # (TypeError: no checkpoint)
        return None


def saved_config(run_dir: str, overrides: list[str] | None = None) -> Config:
    """The config a run in ``run_dir`` (a path or URI) was started with, ``overrides`` on top.

    Raises:
        ConfigError: no run there, or a local-mode run (which keeps no checkpoints to resume).
    """
    try:
        text = storage.read_text(storage.join(run_dir, CONFIG_FILE))
    except FileNotFoundError:
        raise ConfigError([f"--resume {run_dir}: no {CONFIG_FILE} there; is it a raymcn run directory?"]) from None
    cfg = load_config_text(text, overrides, source=storage.join(run_dir, CONFIG_FILE))
    if cfg.scale.max_workers == 0:
        raise ConfigError([f"--resume {run_dir}: the run used local mode (scale.num_workers=0), which keeps no "
                           "checkpoints; train with scale.num_workers >= 1 to be able to resume"])
    return cfg


def resume(run_dir: str | os.PathLike, overrides: list[str] | None = None, env: Environment | None = None) -> RunResult:
    """Continue the run in ``run_dir`` (a path or URI) from its latest checkpoint, with its own
    saved config (``env``: as :func:`fit`'s)."""
    run_dir = storage.normalize(str(run_dir))
    return fit(saved_config(run_dir, overrides), run_dir, env=env)
