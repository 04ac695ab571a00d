"""Runs a sweep: searchers and schedulers, the trial function, restore after interruption.

Three layers, as the Train V2 docs lay them out: ``Tuner`` -> ``trial_fn`` (one Tune trial builds
and fits one ``TorchTrainer``) -> ``worker.train_func_per_worker``. ``Tuner(trainer)`` no longer
works under Train V2.

The schedulers' clock is the reported ``budget_epoch`` (epochs since every stage order has all
three modalities), never Tune's ``training_iteration``: BOHB pauses trials, and a resumed trial's
iteration count restarts while its Train run resumes from its checkpoint.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import tune
from ray.tune.integration.ray_train import CHECKPOINT_PATH_KEY
from ray.tune.experiment import Trial
from ray.tune.schedulers import ASHAScheduler, HyperBandForBOHB

from raymcn import storage
from raymcn.config import (
    CONFIRM_DIR,
    CONFIRM_PLAN_FILE,
    DECISIONS_FILE,
    MID_EPOCH_KEY,
    SWEEP_CONFIG_FILE,
    TRIAL_ERRORS_DIR,
    TRIAL_STATUS_FILE,
    Config,
    ConfigError,
    Objective,
    default_storage_path,
    doctor_hint,
    is_storage_error,
    load_config_text,
    objective,
    permanent_cause,
)
from raymcn.environment import Environment
from raymcn.sweep.confirm import FixedConfigs, confirm_config
from raymcn.sweep.full_storage import StopWhenStorageFull
from raymcn.sweep.names import trial_dirname, trial_dirname_creator
from raymcn.sweep.repeats import SEED_KEY, RandomSearcher, SeedRepeater, seed_axis, seeds
from raymcn.sweep.search_space import param_space, plain
from raymcn.sweep.trackers import sweep_callbacks
from raymcn.train import run_record
from raymcn.train.checkpoints import space
from raymcn.train.inputs import INPUT_KEYS, RunInputs, resolve_inputs
from raymcn.train.monitor import timeline
from raymcn.train.monitor.console import Console
from raymcn.train.on_ray.launch import finished_metrics, fit, newest_checkpoint
from raymcn.train.run_plan import plan_of

BUDGET_ATTR = "budget_epoch"
TRIAL_DRIVER_RESOURCES = {"cpu": 0.01}  # the trial only drives its Train run; 0 is rejected by Tune
# Tune runs the next trial in a finished trial's driver process (reuse_actors: Tune's reset_config
# for function trainables), so a trial starts no new process and imports Tune, Train and torch no
# second time. Each trial still builds its own TorchTrainer, whose controller and workers are new.
# Only where every trial runs to its end: the reset waits 2 s for the previous trial's thread, and
# a trial that early stopping stopped or paused is still inside its Train run then, so Tune fails
# the next trial (and a BOHB sweep with a paused trial was seen to hang).


def reuse_trial_drivers(scheduler) -> bool:
    """Whether trials may share driver processes: under a scheduler that never stops or pauses one."""
    from ray.tune.schedulers import FIFOScheduler

    return type(scheduler) is FIFOScheduler


@dataclass
class SweepResult:
    experiment_dir: str  # a path or a URI
    best_config: dict[str, Any]
    best_metrics: dict[str, float]
    num_trials: int
    num_errors: int
    num_unfinished: int  # not terminated (e.g. after Ctrl-C): `raymcn sweep --resume` continues them
    stopped: str = ""  # the storage error that stopped the sweep (full_storage.py); "" otherwise


def trial_fn(config: dict[str, Any], base: dict[str, Any], experiment_dir: str, inputs: RunInputs,
             variables: dict[str, str] | None = None) -> None:
    """One Tune trial = one Ray Train run. Its name is stable per trial, so a paused (BOHB) or
    restored trial resumes its Train run from the latest checkpoint instead of starting over.

    The sweep's driver resolved ``inputs`` once for every trial; a trial only makes its own plan
    from them (arithmetic on its configuration: nothing is read again, on any node). A trial
    whose Train run already ended (its driver rebooted before Tune saved that) reports the run's
    last epoch again instead of starting a run with nothing left to train.

    A trial whose driver or node is lost raises, and Tune retries it (``tune.FailureConfig``). A
    trial whose run failed with a permanent error (non-finite loss past the limit, a bad input)
    would fail the same way again: it ends here, its error written to ``TRIAL_ERRORS_DIR``, which
    the results table shows as its status, instead of being retried. A storage that cannot take
    what the run writes (``config.StorageError``) would fail every trial: it is raised, and the
    sweep's driver stops the sweep, resumable (``full_storage.py``).

    ``variables``: the sweep driver's ``RAYMCN_*`` settings, over this process's own (its job's
    runtime environment holds them too, except where the sweep joined a Ray already connected).
    """
    # The sweep logs every trial to run.trackers through Tune's callbacks; the trial's Train run
    # does not log a second time.
    cfg = Config.from_dict(base).replace({**plain(config), "run.trackers": ""})
    trial_id = tune.get_context().get_trial_id()
    # this trial driver's start: its RAYMCN_* settings, handed on to its workers
    env = Environment.read({**os.environ, **(variables or {})})
    timeline.start(env.timeline)
    timeline.mark("trial: driver entered", trial=trial_id, process_started=timeline.process_started())
    try:
        timeline.mark("trial: plan started")
        plan = plan_of(cfg, inputs)
        timeline.mark("trial: plan done")
        run_dir = train_run_dir(experiment_dir, trial_id)
        done = finished_metrics(run_dir, plan.epochs)
        if done is not None:  # its run ended before Tune saved that (restored after a reboot): say so again
            tune.report({**done, CHECKPOINT_PATH_KEY: newest_checkpoint(run_dir)})  # as its Train run told it
            return
        timeline.mark("trial: fit started")
        # its record: the commit and patch the sweep's driver recorded, where this node has no checkout
        entry = run_record.driver_entry(cfg, inputs, carried=run_record.carried_from(experiment_dir), trial=trial_id)
        fit(cfg, run_dir, plan=plan, callbacks=[_epoch_report_callback()()], label=trial_dirname(plain(config), trial_id),
            env=env, entry=entry)
        timeline.mark("trial: fit done")
    except Exception as e:
        cause = permanent_cause(e)
        if cause is None:
            raise
        if is_storage_error(cause):  # every trial would fail so: the driver stops the sweep (full_storage.py)
            raise space.storage_error(cause, train_run_dir(experiment_dir, trial_id), cfg) from None
        hint = doctor_hint(cause)
        storage.write_text(storage.join(experiment_dir, TRIAL_ERRORS_DIR, f"{trial_id}.txt"),
                           f"{type(cause).__name__}: {cause}\n" + (f"({hint})\n" if hint else ""))
    finally:
        timeline.mark("trial: driver done", trial=trial_id)


def train_run_dir(experiment_dir: str, trial_id: str) -> str:
    """Where the trial ``trial_id`` of the sweep (or confirmation) in ``experiment_dir`` keeps its
    Train run: its checkpoints, ``metrics.csv`` and console log."""
    return storage.join(experiment_dir, "train", f"train-{trial_id}")


@functools.cache
def _epoch_report_callback():
    """Ray's ``TuneReportCallback`` that forwards epoch results only (built on first use: it needs a
    Tune session). A mid-epoch checkpoint's report (``MID_EPOCH_KEY``) stays Train's: the schedulers
    see one result per epoch whatever ``run.checkpoint_every`` is, and a paused or restored trial
    still resumes from its newest checkpoint, which its Train run finds by name."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class EpochReportCallback(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint) -> None:
            if metrics and metrics[0].get(MID_EPOCH_KEY):
                return
            super().after_report(run_context, metrics, checkpoint)

    return EpochReportCallback


class DecisionLog:
    """A Tune scheduler that also writes what it decided after stage 1 (every result whose clock
    is past 0: continue, pause or stop) to ``EXP/raymcn_decisions.jsonl``, one JSON line each,
    rewritten whole at each decision so a bucket can hold it: which trials were compared at which rung, which BOHB paused
    and which it stopped. A trial stopped while paused (its bracket filled without it) appears as
    paused only. ``experiment_dir`` is set by the sweep before it starts (and kept across a
    restore: Tune pickles its scheduler)."""

    experiment_dir = ""

    def on_trial_result(self, tune_controller, trial, result):
        decision = super().on_trial_result(tune_controller, trial, result)
        if self.experiment_dir and result.get(BUDGET_ATTR, 0) > 0:
            path = storage.join(self.experiment_dir, DECISIONS_FILE)
            if not hasattr(self, "_decisions"):  # a restored sweep continues the file
                try:
                    self._decisions = storage.read_text(path)
                except FileNotFoundError:
                    self._decisions = ""
            self._decisions += json.dumps({"trial": trial.trial_id, "epoch": int(result["epoch"]),
                                           BUDGET_ATTR: int(result[BUDGET_ATTR]), "decision": decision}) + "\n"
            storage.write_text(path, self._decisions)
        return decision

    def __getstate__(self):  # the list is the file's; a restored driver reads it again
        return {k: v for k, v in self.__dict__.items() if k != "_decisions"}


class SweepASHA(DecisionLog, ASHAScheduler):
    """Tune's ASHA, its decisions logged (:class:`DecisionLog`).

    On restore (``raymcn sweep --resume``) Tune starts from the scheduler as it was before the
    first trial (it saves no scheduler state): the rung records are empty, so the trials that
    report after the restore are compared only with each other. Fewer trials are stopped early;
    the confirmation still decides the answer at the full budget."""


class SweepBOHB(DecisionLog, HyperBandForBOHB):
    """Tune's HyperBand for BOHB, its decisions logged (:class:`DecisionLog`), and safe to restore.

    On restore Tune starts from the scheduler as it was before the first trial and adds every
    trial again, finished ones included. A finished trial put into a bracket never reports, so its
    bracket never completes a rung, its paused trials are never promoted, and the sweep ends with
    them paused. Here a finished trial is not put into a bracket; the unfinished ones restart in
    new brackets from their Train checkpoints (a trial past a rung is judged at the next one it
    reaches). The brackets' earlier comparisons are lost; the confirmation still decides the
    answer at the full budget."""

    def on_trial_add(self, tune_controller, trial) -> None:
        if trial.status == Trial.TERMINATED:  # restored after it finished: nothing left to schedule
            return
        super().on_trial_add(tune_controller, trial)


def build_search(cfg: Config):
    """(search_alg, scheduler) for ``cfg.sweep.algorithm``; all use the same fidelity (budget epochs).

    Metric and mode are given once, to ``TuneConfig``; Tune refuses them twice.
    """
    from ray.tune.schedulers import FIFOScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    sw = cfg.sweep
    max_t = cfg.budget_epochs
    # A generator ignores TuneConfig.max_concurrent_trials, so it gets the limit itself. With
    # repeats, random search is a Searcher, which SeedRepeater can wrap (grid repeats are a grid axis).
    variants = BasicVariantGenerator(random_state=sw.seed, max_concurrent=sw.max_concurrent)
    if sw.repeats > 1 and sw.algorithm != "grid":
        variants = RandomSearcher(sw.seed)
    if sw.algorithm == "bohb":
        search, scheduler = bohb_searcher_class()(seed=sw.seed), first_rung_hyperband(SweepBOHB(
            time_attr=BUDGET_ATTR, max_t=max_t, reduction_factor=sw.reduction_factor), max_t, sw.grace_epochs)
    elif sw.algorithm == "asha":
        scheduler = SweepASHA(time_attr=BUDGET_ATTR, max_t=max_t, grace_period=min(sw.grace_epochs, max_t),
                                  reduction_factor=sw.reduction_factor)
        search = _optuna(sw.seed) if sw.suggest == "optuna" else variants
    elif sw.algorithm == "optuna":
        search, scheduler = _optuna(sw.seed), FIFOScheduler()
    else:
        search, scheduler = variants, FIFOScheduler()  # random and grid
    if sw.repeats > 1 and sw.algorithm != "grid":
        search = SeedRepeater(search, seeds(cfg.run.seed, sw.repeats))
    return search, scheduler


def search_space(cfg: Config) -> dict[str, Any]:
    """Tune's param space of ``cfg``: the swept keys, plus ``run.seed`` as a grid axis when a grid
    sweep repeats its cells (``sweep.repeats``)."""
    space = param_space(cfg.sweep)
    if cfg.sweep.repeats > 1 and cfg.sweep.algorithm == "grid":
        space[SEED_KEY] = seed_axis(cfg.run.seed, cfg.sweep.repeats)
    return space


def num_samples(cfg: Config) -> int:
    """Tune's ``num_samples``: ``sweep.num_samples`` configurations, each ``sweep.repeats`` times
    (a grid's seed axis multiplies its cells by itself)."""
    sw = cfg.sweep
    return sw.num_samples if sw.algorithm == "grid" else sw.num_samples * sw.repeats


def search_trials(cfg: Config) -> int:
    """Trials the search runs: ``num_samples`` (x ``repeats``); a grid: every combination of its
    listed values, per sample and seed."""
    sw = cfg.sweep
    trials = num_samples(cfg)
    if sw.algorithm == "grid":
        trials *= math.prod(len(v) for spec in sw.space.values() for d, v in spec.items() if d in ("choice", "grid"))
        trials *= sw.repeats
    return trials


def confirmation_runs(cfg: Config) -> int:
    """Runs the confirmation phase trains (``sweep.confirm``): top x repeats for every value of
    its ``per`` key (the values the space lists; 1 group when it lists none); 0 without one."""
    c = cfg.sweep.confirm
    if not c:
        return 0
    spec = cfg.sweep.space.get(c["per"], {})
    groups = next((len(v) for d, v in spec.items() if d in ("choice", "grid")), 1)
    return groups * int(c.get("top", 1)) * int(c["repeats"])


def first_rung_hyperband(scheduler, max_t: int, first_rung: int):
    """``scheduler`` (a HyperBand scheduler over ``max_t``) without the brackets whose first rung
    lies before ``first_rung`` budget epochs, so no HyperBand bracket compares trials earlier than
    ``sweep.grace_epochs`` (ASHA's ``grace_period``). HyperBand's bracket s starts at
    ⌊max_t·η^−s⌋ for s < s_max; the number of brackets is capped at those starting at or after the
    first rung (at least one: the full-length bracket). Ray exposes no option for this; the count
    is its ``_s_max_1`` (Ray 2.60, pinned in pyproject; ``tests/test_fidelity.py`` checks it)."""
    eta = scheduler._eta
    keep = sum(1 for s in range(scheduler._s_max_1) if int(max_t * eta ** (-s)) >= min(first_rung, max_t))
    scheduler._s_max_1 = max(1, keep)
    return scheduler


@functools.cache
def bohb_searcher_class():
    """Ray's ``TuneBOHB``, letting go of a trial it has already completed (built on first use: it
    imports BOHB's libraries). Tune saves a trial that HyperBand stopped while it was paused as
    PAUSED, but TuneBOHB's saved state no longer holds it; after a restore (``--resume`` after a
    reboot) HyperBand runs and stops that trial again, and TuneBOHB's lookups of it raise KeyError,
    which ends the resumed sweep (Ray 2.60). Its results reached BOHB's model before the kill; the
    repeat is left out."""
    from ray.tune.search.bohb import TuneBOHB

    class SweepTuneBOHB(TuneBOHB):
        def on_trial_result(self, trial_id: str, result: dict) -> None:
            if trial_id in self.trial_to_params:
                super().on_trial_result(trial_id, result)

        def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
            if trial_id in self.trial_to_params:
                super().on_trial_complete(trial_id, result=result, error=error)
            self.paused.discard(trial_id)
            self.running.discard(trial_id)

    return SweepTuneBOHB


def _optuna(seed: int):
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    return OptunaSearch(sampler=optuna.samplers.TPESampler(seed=seed))


def _callbacks(cfg: Config, experiment_dir: str, console: Console | None, stop: StopWhenStorageFull) -> list:
    callbacks: list = [stop]
    if console is not None:
        from raymcn.sweep.trial_lines import SweepProgress

        callbacks.append(SweepProgress(console, cfg, experiment_dir, cfg.sweep.status_every))
    return callbacks + sweep_callbacks(cfg, experiment_dir)  # run.trackers (sweep/trackers.py)


def _storage_stop(experiment_dir: str, console: Console | None) -> StopWhenStorageFull:
    return StopWhenStorageFull(experiment_dir, console.say if console is not None else None)


def _trainable(cfg: Config, experiment_dir: str, inputs: RunInputs, env: Environment | None):
    fn = tune.with_parameters(trial_fn, base=cfg.to_dict(), experiment_dir=experiment_dir, inputs=inputs,
                              variables=env.variables() if env is not None else {})
    return tune.with_resources(fn, TRIAL_DRIVER_RESOURCES)


def default_experiment_dir(cfg: Config) -> str:
    import datetime

    return storage.join(default_storage_path(cfg),
                        cfg.run.name or f"sweep-{cfg.sweep.algorithm}-{datetime.datetime.now():%Y%m%d-%H%M%S}")


def _failure_config(cfg: Config):
    # A trial whose driver or node died restarts from its Train checkpoint; permanent errors end
    # the trial in trial_fn without a retry.
    return tune.FailureConfig(max_failures=cfg.sweep.max_trial_failures)


def swept_input_problems(cfg: Config) -> list[str]:
    """A sweep reads one corpus and one eval set for all its trials (resolved once): the settings
    that would change them cannot be swept."""
    return [f"sweep.space: {key} cannot be swept: a sweep reads one corpus and one eval set (its inputs are "
            "resolved once for every trial); run one sweep per corpus" for key in cfg.sweep.space if key in INPUT_KEYS]


def run_sweep(cfg: Config, experiment_dir: str | None = None, console: Console | None = None,
              inputs: RunInputs | None = None, callbacks: tuple = (), env: Environment | None = None) -> SweepResult:
    """Run ``cfg.sweep`` to completion in ``experiment_dir`` (default: :func:`default_experiment_dir`)
    and return the best trial (by ``sweep.metric``). ``console``: where the per-trial lines go
    (:class:`~raymcn.sweep.trial_lines.SweepProgress`); ``inputs``: the sweep's, when the caller resolved
    them (its preflight did), else resolved here, once for every trial; ``callbacks``: Tune
    callbacks besides the console's and the trackers'; ``env``: the driver's settings, handed to
    every trial driver (``trial_fn``)."""
    problems = swept_input_problems(cfg)
    if problems:
        raise ConfigError(problems)
    experiment_dir = storage.normalize(experiment_dir or default_experiment_dir(cfg))
    inputs = inputs or resolve_inputs(cfg)
    storage.write_text(storage.join(experiment_dir, SWEEP_CONFIG_FILE), cfg.dump_text())
    search_alg, scheduler = build_search(cfg)
    if isinstance(scheduler, DecisionLog):
        scheduler.experiment_dir = experiment_dir
    from ray.tune.search.basic_variant import BasicVariantGenerator

    # A variant generator carries its own concurrency limit; Searchers get it from TuneConfig.
    limit = None if isinstance(search_alg, BasicVariantGenerator) else cfg.sweep.max_concurrent
    target = objective(cfg.sweep.metric)
    stop = _storage_stop(experiment_dir, console)
    tuner = tune.Tuner(
        _trainable(cfg, experiment_dir, inputs, env),
        param_space=search_space(cfg),
        tune_config=tune.TuneConfig(metric=target.reported, mode=target.mode, num_samples=num_samples(cfg),
                                    max_concurrent_trials=limit,
                                    search_alg=search_alg, scheduler=scheduler,
                                    trial_dirname_creator=trial_dirname_creator,
                                    reuse_actors=reuse_trial_drivers(scheduler)),
        run_config=tune.RunConfig(name=storage.basename(experiment_dir), storage_path=storage.parent(experiment_dir),
                                  callbacks=_callbacks(cfg, experiment_dir, console, stop) + list(callbacks),
                                  failure_config=_failure_config(cfg)),
    )
    return _summarise(tuner.fit(), experiment_dir, target, stop)


def sweep_config(experiment_dir: str, option: str) -> Config:
    """The config a sweep ran with (its ``raymcn_sweep.yaml``); ``option`` names the command-line
    option in the error when the folder holds none."""
    source = storage.join(experiment_dir, SWEEP_CONFIG_FILE)
    try:
        return load_config_text(storage.read_text(source), source=source)
    except FileNotFoundError:
        raise ConfigError([f"{option} {experiment_dir}: no {SWEEP_CONFIG_FILE} there; is it a raymcn sweep?"]) from None


def resume_sweep(experiment_dir: str, console: Console | None = None, inputs: RunInputs | None = None,
                 env: Environment | None = None) -> SweepResult:
    """Restore an interrupted sweep (a path or URI): finished trials are kept, unfinished ones resume
    from their Train checkpoints (in the stage they were in), errored ones are retried; a search
    stopped before Tune saved its state starts again. ``inputs``, ``env``:
    as :func:`run_sweep`'s (the inputs resolved here from the sweep's config when not given)."""
    experiment_dir = storage.normalize(experiment_dir)
    cfg = sweep_config(experiment_dir, "--resume")
    if not tune_state_saved(experiment_dir):
        if CONFIRM_PLAN_FILE in storage.files(experiment_dir):
            raise ConfigError([f"--resume {experiment_dir}: this confirmation was stopped before it saved its "
                               f"state; resume its sweep ({storage.parent(experiment_dir)}), which starts it again"])
        # stopped before Tune saved its first state: no trial has trained, so the search starts again
        return run_sweep(cfg, experiment_dir, console=console, inputs=inputs, env=env)
    inputs = inputs or resolve_inputs(cfg)
    tuner = tune.Tuner.restore(experiment_dir, trainable=_trainable(cfg, experiment_dir, inputs, env),
                               resume_unfinished=True, resume_errored=True)
    # The restored RunConfig holds the interrupted driver's progress and storage callbacks, pickled
    # without its console (a terminal is not picklable); Tuner.restore takes no callbacks, so the
    # restored list gets this driver's instead.
    from raymcn.sweep.trial_lines import SweepProgress

    stop = _storage_stop(experiment_dir, console)
    run_config = tuner._local_tuner.get_run_config()
    restored = run_config.callbacks or []
    run_config.callbacks = [c for c in restored if not isinstance(c, (SweepProgress, StopWhenStorageFull))]
    run_config.callbacks.append(stop)
    if console is not None:
        run_config.callbacks.append(SweepProgress(console, cfg, experiment_dir, cfg.sweep.status_every))
    return _summarise(tuner.fit(), experiment_dir, objective(cfg.sweep.metric), stop)


def confirm_dir(experiment_dir: str) -> str:
    """The confirmation phase's experiment folder, inside the sweep's."""
    return storage.join(experiment_dir, CONFIRM_DIR)


def tune_states(experiment_dir: str) -> list[str]:
    """The names of the experiment states Tune saved in ``experiment_dir``
    (``experiment_state-<time>.json``), oldest first."""
    return [n for n in storage.files(experiment_dir) if n.startswith("experiment_state-") and n.endswith(".json")]


def tune_state_saved(experiment_dir: str) -> bool:
    """Whether Tune has saved the experiment's state. Tune writes its ``tuner.pkl`` first, and Ray
    2.60's restore of a folder holding only that logs an error and runs on with a broken experiment
    (a confirmation killed in its first second, resumed, trained one of its runs and ended as if done)."""
    return bool(tune_states(experiment_dir))


def confirmation_started(experiment_dir: str) -> bool:
    """Whether the sweep's confirmation phase has started: Tune saved its state (before that it
    has trained nothing, and starts again)."""
    return tune_state_saved(confirm_dir(experiment_dir))


def run_confirmation(cfg: Config, experiment_dir: str, configs: list[dict[str, Any]], plan: str,
                     console: Console | None = None, inputs: RunInputs | None = None,
                     env: Environment | None = None) -> SweepResult:
    """The confirmation phase of the sweep in ``experiment_dir`` (module doc of
    ``results.confirmation``): writes ``plan``, then trains every config of ``configs`` (swept keys
    and ``run.seed``) once at the full budget, no early stopping, in ``EXP/confirm/``. An
    interrupted one continues with ``resume_sweep(confirm_dir(EXP))``: its folder holds its own
    ``raymcn_sweep.yaml``."""
    where, base = confirm_dir(experiment_dir), confirm_config(cfg)
    inputs = inputs or resolve_inputs(cfg)
    storage.write_text(storage.join(where, CONFIRM_PLAN_FILE), plan)
    storage.write_text(storage.join(where, SWEEP_CONFIG_FILE), base.dump_text())
    target = objective(base.sweep.metric)
    stop = _storage_stop(experiment_dir, console)  # (a confirmation is resumed with its sweep's folder)
    tuner = tune.Tuner(
        _trainable(base, where, inputs, env),
        tune_config=tune.TuneConfig(metric=target.reported, mode=target.mode, num_samples=len(configs),
                                    max_concurrent_trials=cfg.sweep.max_concurrent, search_alg=FixedConfigs(configs),
                                    trial_dirname_creator=trial_dirname_creator, reuse_actors=True),
        run_config=tune.RunConfig(name=CONFIRM_DIR, storage_path=experiment_dir,
                                  callbacks=_callbacks(base, where, console, stop),
                                  failure_config=_failure_config(cfg)))
    return _summarise(tuner.fit(), where, target, stop)


def trial_errors(experiment_dir: str) -> dict[str, str]:
    """Trial id -> the permanent error that ended it (written by :func:`trial_fn`)."""
    where = storage.join(experiment_dir, TRIAL_ERRORS_DIR)
    return {Path(name).stem: storage.read_text(storage.join(where, name)).strip() for name in storage.files(where)}


def _summarise(grid, experiment_dir: str, target: Objective, stop: StopWhenStorageFull) -> SweepResult:
    """The sweep's result; its best trial by ``target`` (the sweep's :class:`~raymcn.config.Objective`);
    ``stop``: why it was stopped, if its storage could not take what it writes."""
    failed = trial_errors(experiment_dir)
    name, sign = target.reported, target.metric.sign
    ok = [r for r in grid if r.error is None and r.metrics and name in r.metrics
          and r.metrics.get("trial_id") not in failed]

    def score(r) -> float:  # the trial's best epoch (Tune's scope="all") or its last (scope="last")
        history = r.metrics_dataframe  # a restored trial that reported nothing since holds none
        if target.scope == "last" or history is None or name not in history:
            return r.metrics[name]
        return sign * (history[name] * sign).max()

    best = max(ok, key=lambda r: sign * score(r)) if ok else None
    best_metrics = {k: v for k, v in (best.metrics or {}).items() if isinstance(v, (int, float))} if best else {}
    # ResultGrid exposes no trial status; an early-stopped trial is TERMINATED, an interrupted one is not.
    trials = grid._experiment_analysis.trials
    _write_statuses(experiment_dir, {t.trial_id: t.status for t in trials})
    finished = sum(1 for t in trials if t.status in ("TERMINATED", "ERROR")) - len(grid.errors)
    return SweepResult(experiment_dir=experiment_dir, best_config=plain(best.config) if best else {},
                       best_metrics=best_metrics, num_trials=len(grid), num_errors=len(grid.errors) + len(failed),
                       num_unfinished=len(grid) - finished - len(grid.errors), stopped=stop.reason)


def _write_statuses(experiment_dir: str, statuses: dict[str, str]) -> None:
    """``TRIAL_STATUS_FILE``: a JSON line per trial with its status as this Tune run ended and the
    name of the experiment state Tune saved last (``results.experiment`` trusts them while that
    state is the newest; a later restore writes its own)."""
    saved = tune_states(experiment_dir)
    state = saved[-1] if saved else ""
    storage.write_text(storage.join(experiment_dir, TRIAL_STATUS_FILE), "".join(
        json.dumps({"trial": trial, "status": status, "tune_state": state}) + "\n" for trial, status in statuses.items()))
