"""A sweep's two phases end to end: the search, then its confirmation (``sweep.confirm``).

``raymcn sweep`` and ``raymcn doctor --rehearse`` run this one flow. The search is Tune's
(``sweep.tuner``); which configurations the confirmation trains again is decided from the
search's folder (``results.confirmation``), so the flow sits above both.
"""

from __future__ import annotations

from raymcn import storage
from raymcn.config import Config, ConfigError, default_cache_dir, objective
from raymcn.environment import Environment
from raymcn.results import confirmation
from raymcn.results.experiment import load_experiment
from raymcn.sweep import tuner
from raymcn.sweep.tuner import SweepResult
from raymcn.train.inputs import RunInputs
from raymcn.train.monitor.console import Console


def search_then_confirm(cfg: Config, experiment_dir: str, console: Console, inputs: RunInputs,
                        callbacks: tuple = (), env: Environment | None = None) -> SweepResult:
    """The search of ``cfg`` in ``experiment_dir``, then its confirmation when it asks for one and
    the search ended with every trial finished. ``callbacks``: more Tune callbacks for the search;
    ``env``: the driver's settings, for every trial (``tuner.run_sweep``)."""
    result = tuner.run_sweep(cfg, experiment_dir, console=console, inputs=inputs, callbacks=callbacks, env=env)
    return confirm(cfg, experiment_dir, console, inputs, after=result, env=env)


def resume(experiment_dir: str, console: Console, inputs: RunInputs, env: Environment | None = None):
    """Continue whichever phase was interrupted: the confirmation once it has started, else the
    search, then its confirmation (when the sweep has one)."""
    if tuner.confirmation_started(experiment_dir):
        return tuner.resume_sweep(tuner.confirm_dir(experiment_dir), console=console, inputs=inputs, env=env)
    result = tuner.resume_sweep(experiment_dir, console=console, inputs=inputs, env=env)
    return confirm(tuner.sweep_config(experiment_dir, "--resume"), experiment_dir, console, inputs, after=result,
                   env=env)


def confirm(cfg: Config, experiment_dir: str, console: Console, inputs: RunInputs, after=None,
            env: Environment | None = None):
    """The confirmation phase of ``experiment_dir`` (``results.confirmation``). ``after``: the
    search's result; the phase starts only when the search ended with no trial unfinished (and
    then only when ``sweep.confirm`` asks for it), else ``after`` is returned as it is. Without
    ``after`` (``--confirm EXP``) an empty ``sweep.confirm`` means: per stage order, 5 seeds."""
    if after is not None and (after.num_unfinished or not cfg.sweep.confirm):
        return after
    if tuner.confirmation_started(experiment_dir):  # --confirm on a sweep whose confirmation began
        return tuner.resume_sweep(tuner.confirm_dir(experiment_dir), console=console, inputs=inputs, env=env)
    local = storage.local_copy(experiment_dir, default_cache_dir(cfg) / "experiments", skip=storage.CHECKPOINTS)
    trials, _ = load_experiment(local)
    unfinished = int((trials["status"] == "running").sum())
    if unfinished:
        raise ConfigError([f"--confirm {experiment_dir}: the search has {unfinished} unfinished trial(s); finish it "
                           f"first (raymcn sweep --resume {experiment_dir}), then confirm"])
    settings, target = confirmation.settings(cfg, swept=list(trials.columns)), objective(cfg.sweep.metric)
    if settings is None:
        raise ConfigError([f"--confirm {experiment_dir}: say what to compare, e.g. --set "
                           "'sweep.confirm={per: schedule.stage_order, repeats: 5}' (the stage order was not swept)"])
    try:
        candidates = confirmation.select_candidates(trials, settings, cfg.schedule.epochs, target)
    except confirmation.NothingToConfirm as e:
        raise ConfigError([f"cannot confirm {experiment_dir}: {e}"]) from None
    seeds = confirmation.confirmation_seeds(cfg, settings.repeats)
    console.say(f"confirmation: {settings.what} per {settings.per}, each over seeds "
                f"{', '.join(map(str, seeds))} at the full budget ({cfg.schedule.epochs} epochs):")
    for c in candidates:
        keys = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in c.config.items()
                         if k != settings.per)
        console.say(f"  {c.label}: {keys or 'the base config'} (search: {c.score:{target.metric.spec}} over "
                    f"{c.trials} trial(s) at the {c.basis})")
    return tuner.run_confirmation(cfg, experiment_dir, confirmation.trial_configs(candidates, seeds),
                                  confirmation.plan_text(settings, candidates, seeds), console, inputs, env=env)


def describe(cfg: Config) -> str:
    """Algorithm, trials, epochs and what is swept (the start of a sweep's console); the
    confirmation, if any, on a line of its own (each line well under 160 characters)."""
    sw = cfg.sweep
    keys = " x ".join(sw.space) or "nothing"
    trials = tuner.search_trials(cfg)
    repeats = f" ({sw.repeats} seeds per configuration, run.seed {cfg.run.seed}..)" if sw.repeats > 1 else ""
    c = sw.confirm
    confirm = (f";\n  then the best {c.get('top', 1)} per {c['per']} again over {c['repeats']} fresh seeds"
               if c else "")
    return (f"{sw.algorithm} over {keys}, {trials} trials{repeats}, {cfg.schedule.epochs} epochs each, "
            f"{cfg.scale.workers_text} worker(s) per trial{confirm}")


def summary(experiment_dir: str) -> str:
    """The end of a sweep on one screen (``results.summary``); the wide tables: ``raymcn table``."""
    from raymcn.results.summary import sweep_summary

    local = experiment_dir
    if storage.is_uri(experiment_dir):  # read (and the plots and CSVs written) through a local copy
        local = str(storage.local_copy(experiment_dir, default_cache_dir(Config()) / "experiments", skip=storage.CHECKPOINTS))
    return sweep_summary(local)
