"""The sweep's duration, from a step time and the config: the trials, their epochs and steps, the
early-stopping rungs, the confirmation runs and how many trials the cluster runs at once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from raymcn.config import Config


# --- the duration -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    """A sweep's expected duration (module doc); seconds are trial-seconds unless named wall."""

    search_trials: int
    confirm_runs: int
    epochs: int
    steps_per_epoch: int
    workers: int  # per trial (GPUs per trial on GPU runs)
    concurrent: int  # trials at once on this cluster
    step_s: float
    eval_s: float
    trial_overhead_s: float
    search_epochs: tuple[float, float]  # (with early stopping at its most, without) per search trial
    search_s: tuple[float, float]
    confirm_s: float

    @property
    def wall_s(self) -> tuple[float, float]:
        return tuple((s + self.confirm_s) / self.concurrent for s in self.search_s)

    @property
    def worker_hours(self) -> tuple[float, float]:
        return tuple((s + self.confirm_s) * self.workers / 3600 for s in self.search_s)

    def lines(self, use_gpu: bool) -> list[str]:
        low, high = self.wall_s
        wh_low, wh_high = self.worker_hours
        unit = "GPU-hours" if use_gpu else "worker-hours"
        span = (lambda a, b, f: f(a) if math.isclose(a, b) else f"{f(a)} to {f(b)}")
        return [f"estimate: {self.search_trials} search trials"
                + (f" (early stopping: {self.search_epochs[0]:.1f} to {self.search_epochs[1]:g} epochs each)"
                   if self.search_epochs[0] < self.search_epochs[1] else f" of {self.epochs} epochs")
                + (f", then {self.confirm_runs} confirmation runs of {self.epochs} epochs" if self.confirm_runs else "")
                + f"; {self.steps_per_epoch} steps per epoch at {self.step_s:.3g} s, evaluation {self.eval_s:.3g} s "
                f"per epoch, {self.trial_overhead_s:g} s to start and stop a trial; {self.concurrent} trial(s) at "
                f"once, {self.workers} worker(s) each",
                f"estimate: {span(wh_low, wh_high, lambda h: f'{h:.3g}')} {unit}, wall time "
                f"{span(low, high, _hours)} (an estimate: restarts, stragglers and slower reads under load "
                "are not in it)"]


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def rung_epochs(cfg: Config) -> float:
    """Expected epochs of an asha/bohb search trial when every rung stops all but 1 in
    ``sweep.reduction_factor`` (the most early stopping can save): the stage-1 epochs, then the
    rungs at ``grace``, ``grace·η``, ... budget epochs, a share η^-k of the trials reaching rung k."""
    sw, epochs, max_t = cfg.sweep, cfg.schedule.epochs, cfg.budget_epochs
    if sw.algorithm not in ("asha", "bohb"):
        return float(epochs)
    rungs, r = [], min(sw.grace_epochs, max_t)
    while r < max_t:
        rungs.append(r)
        r *= sw.reduction_factor
    bounds = [0, *rungs, max_t]
    return epochs - max_t + sum((b - a) * sw.reduction_factor ** -k for k, (a, b) in enumerate(zip(bounds, bounds[1:])))


def estimate(cfg: Config, steps_per_epoch: int, step_s: float, eval_s: float, cluster: dict[str, float],
             trial_overhead_s: float) -> Estimate:
    """The sweep of ``cfg`` on a cluster of ``cluster`` resources (Ray's CPU and GPU counts)."""
    from raymcn.sweep.tuner import confirmation_runs, search_trials

    workers = max(1, cfg.scale.min_workers)
    if cfg.scale.use_gpu:
        fit = int(cluster.get("GPU", 0) // workers)
    else:
        fit = int(cluster.get("CPU", 0) // (workers * cfg.scale.cpus_per_worker))
    concurrent = max(1, min(cfg.sweep.max_concurrent, fit))

    def trial(epochs: float) -> float:
        return trial_overhead_s + epochs * (steps_per_epoch * step_s + eval_s)

    trials, epochs = search_trials(cfg), cfg.schedule.epochs
    stopped = rung_epochs(cfg)
    return Estimate(search_trials=trials, confirm_runs=confirmation_runs(cfg), epochs=epochs,
                    steps_per_epoch=steps_per_epoch, workers=workers, concurrent=concurrent, step_s=step_s,
                    eval_s=eval_s, trial_overhead_s=trial_overhead_s, search_epochs=(stopped, float(epochs)),
                    search_s=(trials * trial(stopped), trials * trial(epochs)),
                    confirm_s=confirmation_runs(cfg) * trial(epochs))
