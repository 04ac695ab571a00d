"""A sweep's folder as Ray Tune's own ``ResultGrid``, each trial's result holding its Train run's
checkpoints: :func:`result_grid`.

A trial is a Ray Train run (``EXP/train/train-<trial id>/``) whose checkpoints Tune never sees:
reporting them to Tune (``tune.report(checkpoint=...)``) would copy each into the trial's folder
(Ray 2.60's ``persist_current_checkpoint`` copies the files), 2.7 GB a copy at the paper's size
with Adam's state, every epoch of every trial. So Tune's own results carry only their path: each
epoch's result holds Ray's ``checkpoint_path``, that epoch's Train checkpoint, and
``Result.checkpoint`` is None. :func:`result_grid` reads the same folder and fills in what
Tune's results would hold had Tune kept the checkpoints, pointing at the Train run's own folders
(nothing is copied):

* ``Result.checkpoint``: the checkpoint of the last epoch the result reports (``Result.metrics``'s
  epoch), the newest kept epoch end at or before it when that one is gone;
* ``Result.best_checkpoints``: every epoch-end checkpoint the Train run keeps (the latest and the
  ``run.checkpoints_to_keep`` best by ``sweep.metric``'s metric), with that epoch's metrics, by
  epoch; so ``Result.get_best_checkpoint(metric, mode)`` gives the trial's best epoch's.

A mid-epoch checkpoint (``run.checkpoint_every``) is not an epoch's result and is in neither.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath

from ray import tune
from ray.tune import ResultGrid

from raymcn import storage
from raymcn.config import MID_EPOCH_KEY, objective
from raymcn.sweep.tuner import sweep_config, train_run_dir
from raymcn.train.checkpoints import payload


def epoch_checkpoints(run_dir: str) -> list[tuple[tune.Checkpoint, dict]]:
    """(checkpoint, the metrics its epoch reported) of every epoch-end checkpoint the Train run in
    ``run_dir`` (a path or URI) keeps, oldest first; a folder without its metrics (written before
    they were kept beside it, or still being written) is left out."""
    fs, path = storage.filesystem(storage.normalize(run_dir))
    out = []
    for folder in storage.subfolders(fs, path, prefix="checkpoint_"):
        try:
            metrics = json.loads(storage.read_text(storage.join(run_dir, posixpath.basename(folder),
                                                                payload.METRICS_META_FILE)))
        except (FileNotFoundError, ValueError):
            continue
        if isinstance(metrics, dict) and "epoch" in metrics and not metrics.get(MID_EPOCH_KEY):
            out.append((tune.Checkpoint(folder, filesystem=fs), metrics))
    return sorted(out, key=lambda kept: (float(kept[1]["epoch"]), kept[0].path))


class SweepResultGrid(ResultGrid):
    """Tune's ``ResultGrid`` of a raymcn sweep, its results holding the Train runs' checkpoints (the
    module doc). Built by :func:`result_grid`."""

    def __init__(self, experiment_analysis, experiment_dir: str):
        self._sweep_dir = experiment_dir  # before ResultGrid builds its results
        super().__init__(experiment_analysis)

    def _trial_to_result(self, trial):  # (Ray 2.60's one place that turns a trial into its Result)
        result = super()._trial_to_result(trial)
        kept = epoch_checkpoints(train_run_dir(self._sweep_dir, trial.trial_id))
        last = float((result.metrics or {}).get("epoch", 0))
        reported = posixpath.basename(str((result.metrics or {}).get("checkpoint_path") or ""))
        reached = [(c, m) for c, m in kept if float(m["epoch"]) <= last]
        chosen = next((c for c, _ in reached if posixpath.basename(c.path) == reported),
                      reached[-1][0] if reached else None)
        return dataclasses.replace(result, checkpoint=chosen, best_checkpoints=reached)


def result_grid(experiment_dir: str) -> SweepResultGrid:
    """Ray Tune's ``ResultGrid`` of the search in ``experiment_dir`` (a sweep's folder, a path or
    URI), or of its confirmation (``EXP/confirm``), read from its files as
    ``ray.tune.ExperimentAnalysis`` reads them; no Ray instance is needed. Its default metric and
    mode are the sweep's ``sweep.metric`` and its direction, so ``get_best_result()`` picks the
    trial the sweep's tables rank first by that metric (a ``best_`` one included: every epoch reports
    the best so far). Each result holds its trial's Train checkpoints (the module doc).

    Raises:
        ConfigError: the folder holds no ``raymcn_sweep.yaml``.
    """
    experiment_dir = storage.normalize(experiment_dir)
    target = objective(sweep_config(experiment_dir, "result_grid").sweep.metric)
    analysis = tune.ExperimentAnalysis(experiment_dir, default_metric=target.name, default_mode=target.mode)
    return SweepResultGrid(analysis, experiment_dir)


__all__ = ["SweepResultGrid", "epoch_checkpoints", "result_grid"]
