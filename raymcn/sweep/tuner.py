"""Runs a sweep: searchers and schedulers, the trial function, restore after interruption.

Three layers, as the Train V2 docs lay them out: ``Tuner`` -> ``trial_fn`` (one Tune trial builds
and fits one ``TorchTrainer``) -> ``worker.train_func_per_worker``. ``Tuner(trainer)`` no longer
works under Train V2 (ray-notes §1).

The schedulers' clock is the reported ``budget_epoch`` (epochs since every stage order has all
three modalities), never Tune's ``training_iteration``: BOHB pauses trials, and a resumed trial's
iteration count restarts while its Train run resumes from its checkpoint.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import tune

from raymcn.config import PRIMARY_METRIC, PRIMARY_MODE, Config, default_storage_path
from raymcn.sweep.names import trial_dirname_creator
from raymcn.sweep.space import param_space, plain
from raymcn.train.launch import build_trainer

SWEEP_CONFIG_FILE = "raymcn_sweep.yaml"
BUDGET_ATTR = "budget_epoch"
TRIAL_DRIVER_RESOURCES = {"cpu": 0.01}  # the trial only drives its Train run; 0 is rejected by Tune


@dataclass
class SweepResult:
    experiment_dir: Path
    best_config: dict[str, Any]
    best_metrics: dict[str, float]
    num_trials: int
    num_errors: int
    num_unfinished: int  # not terminated (e.g. after Ctrl-C): `raymcn sweep --resume` continues them


def trial_fn(config: dict[str, Any], base: dict[str, Any], train_storage: str) -> None:
    """One Tune trial = one Ray Train run. Its name is stable per trial, so a paused (BOHB) or
    restored trial resumes its Train run from the latest checkpoint instead of starting over."""
    from ray.tune.integration.ray_train import TuneReportCallback

    cfg = Config.from_dict(base).replace(plain(config))
    name = f"train-{tune.get_context().get_trial_id()}"
    build_trainer(cfg, name, Path(train_storage), callbacks=[TuneReportCallback()]).fit()


def budget(cfg: Config) -> int:
    """Epochs on the scheduler's clock: the part of the run after the stage switch."""
    return cfg.schedule.epochs - int(math.ceil(cfg.schedule.stage1_fraction * cfg.schedule.epochs))


def build_search(cfg: Config):
    """(search_alg, scheduler) for ``cfg.sweep.algorithm``; all use the same fidelity (budget epochs).

    Metric and mode are given once, to ``TuneConfig``; Tune refuses them twice.
    """
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, HyperBandForBOHB
    from ray.tune.search.basic_variant import BasicVariantGenerator

    sw = cfg.sweep
    max_t = budget(cfg)
    # A generator ignores TuneConfig.max_concurrent_trials, so it gets the limit itself.
    variants = BasicVariantGenerator(random_state=sw.seed, max_concurrent=sw.max_concurrent)
    if sw.algorithm == "bohb":
        from ray.tune.search.bohb import TuneBOHB

        return (TuneBOHB(seed=sw.seed),
                HyperBandForBOHB(time_attr=BUDGET_ATTR, max_t=max_t, reduction_factor=sw.reduction_factor))
    if sw.algorithm == "asha":
        scheduler = ASHAScheduler(time_attr=BUDGET_ATTR, max_t=max_t, grace_period=min(sw.grace_epochs, max_t),
                                  reduction_factor=sw.reduction_factor)
        return (_optuna(sw.seed) if sw.suggest == "optuna" else variants), scheduler
    if sw.algorithm == "optuna":
        return _optuna(sw.seed), FIFOScheduler()
    return variants, FIFOScheduler()  # random and grid


def _optuna(seed: int):
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    return OptunaSearch(sampler=optuna.samplers.TPESampler(seed=seed))


def _callbacks(cfg: Config, experiment_dir: Path) -> list:
    callbacks = []
    if cfg.sweep.mlflow:
        # A local SQLite store (MLflow 3 no longer accepts a plain ./mlruns folder by default).
        callbacks.append(_mlflow_callback_class()(tracking_uri=mlflow_uri(experiment_dir),
                                                  experiment_name=experiment_dir.name, save_artifact=False))
    if cfg.sweep.wandb:
        from ray.air.integrations.wandb import WandbLoggerCallback

        callbacks.append(WandbLoggerCallback(project="raymcn", group=experiment_dir.name, mode="offline"))
    return callbacks


@functools.cache
def _mlflow_callback_class():
    """Built on first use: importing Ray's MLflow integration imports mlflow (an optional extra)."""
    from ray.air.integrations.mlflow import MLflowLoggerCallback

    class MLflowCallback(MLflowLoggerCallback):
        """MLflow rejects '@' in metric names: ``text_to_video_R@10`` is logged as ``text_to_video_R_at_10``."""

        def log_trial_result(self, iteration: int, trial, result: dict) -> None:
            super().log_trial_result(iteration, trial, {k.replace("@", "_at_"): v for k, v in result.items()})

    return MLflowCallback


def mlflow_uri(experiment_dir: Path) -> str:
    return f"sqlite:///{experiment_dir / 'mlflow.db'}"


def _trainable(cfg: Config, experiment_dir: Path):
    fn = tune.with_parameters(trial_fn, base=cfg.to_dict(), train_storage=str(experiment_dir / "train"))
    return tune.with_resources(fn, TRIAL_DRIVER_RESOURCES)


def default_experiment_dir(cfg: Config) -> Path:
    import datetime

    storage_path = Path(default_storage_path(cfg)).expanduser().resolve()
    return storage_path / (cfg.run.name or f"sweep-{cfg.sweep.algorithm}-{datetime.datetime.now():%Y%m%d-%H%M%S}")


def run_sweep(cfg: Config, name: str | None = None, storage_path: Path | None = None) -> SweepResult:
    """Run ``cfg.sweep`` to completion and return the best trial (by the primary metric)."""
    default = default_experiment_dir(cfg)
    storage_path = Path(storage_path or default.parent).expanduser().resolve()
    experiment_dir = storage_path / (name or default.name)
    experiment_dir.mkdir(parents=True, exist_ok=True)
    cfg.dump(experiment_dir / SWEEP_CONFIG_FILE)
    search_alg, scheduler = build_search(cfg)
    from ray.tune.search.basic_variant import BasicVariantGenerator

    # A variant generator carries its own concurrency limit; Searchers get it from TuneConfig.
    limit = None if isinstance(search_alg, BasicVariantGenerator) else cfg.sweep.max_concurrent
    samples = cfg.sweep.num_samples
    tuner = tune.Tuner(
        _trainable(cfg, experiment_dir),
        param_space=param_space(cfg.sweep),
        tune_config=tune.TuneConfig(metric=PRIMARY_METRIC, mode=PRIMARY_MODE, num_samples=samples,
                                    max_concurrent_trials=limit,
                                    search_alg=search_alg, scheduler=scheduler,
                                    trial_dirname_creator=trial_dirname_creator),
        run_config=tune.RunConfig(name=experiment_dir.name, storage_path=str(storage_path),
                                  callbacks=_callbacks(cfg, experiment_dir)),
    )
    return _summarise(tuner.fit(), experiment_dir)


def resume_sweep(experiment_dir: str | Path) -> SweepResult:
    """Restore an interrupted sweep: finished trials are kept, unfinished ones resume from their
    Train checkpoints (in the stage they were in), errored ones are retried."""
    from raymcn.config import load_config

    experiment_dir = Path(experiment_dir).expanduser().resolve()
    cfg = load_config(experiment_dir / SWEEP_CONFIG_FILE)
    if not tune.Tuner.can_restore(str(experiment_dir)):
        raise FileNotFoundError(f"{experiment_dir} holds no restorable Tune experiment state")
    tuner = tune.Tuner.restore(str(experiment_dir), trainable=_trainable(cfg, experiment_dir),
                               resume_unfinished=True, resume_errored=True)
    return _summarise(tuner.fit(), experiment_dir)


def _summarise(grid, experiment_dir: Path) -> SweepResult:
    ok = [r for r in grid if r.error is None and r.metrics and PRIMARY_METRIC in r.metrics]
    best = grid.get_best_result(metric=PRIMARY_METRIC, mode=PRIMARY_MODE, scope="all") if ok else None
    best_metrics = {k: v for k, v in (best.metrics or {}).items() if isinstance(v, (int, float))} if best else {}
    # ResultGrid exposes no trial status; an early-stopped trial is TERMINATED, an interrupted one is not.
    trials = grid._experiment_analysis.trials
    finished = sum(1 for t in trials if t.status in ("TERMINATED", "ERROR")) - len(grid.errors)
    return SweepResult(experiment_dir=experiment_dir, best_config=plain(best.config) if best else {},
                       best_metrics=best_metrics, num_trials=len(grid), num_errors=len(grid.errors),
                       num_unfinished=len(grid) - finished - len(grid.errors))
