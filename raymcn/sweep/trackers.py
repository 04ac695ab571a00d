"""A sweep's trials in the trackers of ``run.trackers``, through Tune's callbacks, under the names a
single run's trackers use (``train/monitor/trackers.py``): every reported value by its name in the
results table, spelled by ``config.tracker_name`` (``text_to_video_R@10`` is
``text_to_video_R_at_10`` in MLflow and TensorBoard), one point per epoch (``epoch`` is the step,
not Tune's ``training_iteration``, which starts again after a BOHB pause or a restore).

* ``tensorboard`` (the default): each trial's event files in its folder (``tensorboard --logdir
  EXP``). Tune adds a TensorBoard logger of its own (tags ``ray/tune/...``, ``@`` turned into
  ``_``) unless it is given one; it is always given this one, which writes nothing when
  ``run.trackers`` leaves tensorboard out.
* ``mlflow``: one MLflow run per trial in the sweep's SQLite store (:func:`mlflow_uri`).
* ``wandb``: Ray's W&B callback, one W&B run per trial, grouped by the sweep.

Each trial also gets what made the sweep's numbers, from the sweep's provenance record (written by
its driver before the trials start): MLflow's own tags (``mlflow.source.git.commit`` ...), W&B's
config (``provenance/...``), TensorBoard's text (``raymcn/provenance``). Each trial's own record
(beside its checkpoints) adds the nodes it ran on.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

from ray.air.constants import TRAINING_ITERATION
from ray.tune.logger import TBXLoggerCallback

from raymcn import storage
from raymcn.config import CONFIRM_DIR, Config, tracker_name
from raymcn.provenance import record
from raymcn.provenance.describe import flat, markdown, mlflow_tags
from raymcn.train.monitor.trackers import PROVENANCE_TAG, event_file_suffix, local_folder

# Tune's own bookkeeping in every result, not an epoch's value (Tune's TensorBoard logger leaves them out too)
NOT_LOGGED = frozenset({"config", "pid", "timestamp", "time_total_s", TRAINING_ITERATION})


def epoch_values(result: dict[str, Any]) -> dict[str, float]:
    """The numbers of a trial's result, by the names MLflow and TensorBoard show (``tracker_name``):
    the epoch's metrics and Tune's counters, without Tune's bookkeeping, flags and strings."""
    return {tracker_name(k): float(v) for k, v in result.items()
            if k not in NOT_LOGGED and isinstance(v, (int, float)) and not isinstance(v, bool)}


def epoch_step(result: dict[str, Any]) -> int:
    """A result's step in MLflow and TensorBoard: its epoch (a run's step too), else Tune's iteration."""
    return int(result["epoch"]) if "epoch" in result else int(result[TRAINING_ITERATION])


class TensorBoardCallback(TBXLoggerCallback):
    """Tune's TensorBoard logger (tensorboardX, one writer per trial in the trial's folder, the
    trial's settings as hparams at its end), each result written as a run writes its epochs:
    :func:`epoch_values` at :func:`epoch_step`. NaN values are left out, as Tune leaves them out.
    ``provenance``: what made the sweep's numbers (Markdown), each trial's text (``PROVENANCE_TAG``)."""

    def __init__(self, provenance: str = ""):
        super().__init__()
        self.provenance = provenance

    def log_trial_start(self, trial) -> None:  # Tune's, its event file named apart (event_file_suffix)
        if trial in self._trial_writer:
            self._trial_writer[trial].close()
        trial.init_local_path()
        self._trial_writer[trial] = self._summary_writer_cls(trial.local_path, flush_secs=30,
                                                             filename_suffix=event_file_suffix())
        if self.provenance:
            self._trial_writer[trial].add_text(PROVENANCE_TAG, self.provenance, global_step=0)
        self._trial_result[trial] = {}

    def log_trial_result(self, iteration: int, trial, result: dict) -> None:
        if trial not in self._trial_writer:
            self.log_trial_start(trial)
        writer, step = self._trial_writer[trial], epoch_step(result)
        values = {k: v for k, v in epoch_values(result).items() if not math.isnan(v)}
        for tag, value in values.items():
            writer.add_scalar(tag, value, global_step=step)
        self._trial_result[trial] = values  # the hparams' metrics at the trial's end
        writer.flush()


class NoTensorBoard(TBXLoggerCallback):
    """A TensorBoard logger that writes nothing: given to Tune when ``run.trackers`` leaves
    tensorboard out, so that Tune adds none of its own."""

    def __init__(self) -> None:  # (Tune's opens tensorboardX here)
        pass

    def log_trial_start(self, trial) -> None:
        pass

    def log_trial_result(self, iteration: int, trial, result: dict) -> None:
        pass

    def log_trial_end(self, trial, failed: bool = False) -> None:
        pass


def sweep_record(experiment_dir: str) -> tuple[list[dict[str, Any]], str]:
    """(the entries, the path) of the provenance record of the sweep in ``experiment_dir`` (its
    confirmation's folder: the sweep's), as its driver wrote it before the trials started."""
    where = experiment_dir
    if not record.drivers(record.read(where)) and storage.basename(where) == CONFIRM_DIR:
        where = storage.parent(where)
    return record.read(where), record.path_of(where)


def sweep_callbacks(cfg: Config, experiment_dir: str) -> list:
    """Tune's callbacks for ``cfg.run.trackers`` of the sweep in ``experiment_dir``; each trial gets
    what made the sweep's numbers (its record) as MLflow's tags, W&B's config and TensorBoard's text."""
    trackers = cfg.run.trackers.split(",")
    entries, where = sweep_record(experiment_dir)
    text = markdown(entries, where) if entries else ""
    callbacks: list = [TensorBoardCallback(text) if "tensorboard" in trackers else NoTensorBoard()]
    if "mlflow" in trackers:
        callbacks.append(_mlflow_callback_class()(tracking_uri=mlflow_uri(experiment_dir, cfg),
                                                  experiment_name=storage.basename(experiment_dir),
                                                  save_artifact=False, tags=mlflow_tags(entries, where)))
    if "wandb" in trackers:
        r = cfg.run
        callbacks.append(_wandb_callback_class()(flat(entries), project=r.wandb_project,
                                                 entity=r.wandb_entity or None, group=storage.basename(experiment_dir),
                                                 mode=r.wandb_mode))
    return callbacks


@functools.cache
def _wandb_callback_class():
    """Built on first use: Ray's W&B integration needs wandb (an optional extra)."""
    from ray.air.integrations.wandb import WandbLoggerCallback

    class WandbCallback(WandbLoggerCallback):
        """Ray's W&B logger, each trial's config with the sweep's provenance (``provenance/...`` keys)
        beside its settings: Ray passes its ``kwargs`` to ``wandb.init`` over the trial's own config,
        so the config given there is the trial's plus the provenance."""

        def __init__(self, provenance: dict[str, str], **kwargs):
            super().__init__(**kwargs)
            self.provenance = provenance

        def log_trial_start(self, trial) -> None:
            given = self.kwargs
            settings = {k: v for k, v in trial.config.items() if k != "callbacks"}
            self.kwargs = {**given, "config": {**settings, **self.provenance}}
            try:
                super().log_trial_start(trial)
            finally:
                self.kwargs = given

    return WandbCallback


@functools.cache
def _mlflow_callback_class():
    """Built on first use: importing Ray's MLflow integration imports mlflow (an optional extra)."""
    from ray.air.integrations.mlflow import MLflowLoggerCallback

    class MLflowCallback(MLflowLoggerCallback):
        """Ray's MLflow logger (a run per trial, its settings as parameters at its end), each result
        logged as a run logs its epochs: :func:`epoch_values` at :func:`epoch_step`."""

        def log_trial_result(self, iteration: int, trial, result: dict) -> None:
            self.mlflow_util.log_metrics(run_id=self._trial_runs[trial], metrics_to_log=epoch_values(result),
                                         step=epoch_step(result))

    return MLflowCallback


def mlflow_uri(experiment_dir: str | Path, cfg: Config | None = None) -> str:
    """A local SQLite store (MLflow 3 no longer accepts a plain ./mlruns folder by default): in the
    experiment folder, or in the cache when that is a bucket (the folder a single run's trackers
    use, ``train.monitor.trackers.local_folder``)."""
    where = local_folder(cfg or Config(), str(experiment_dir))
    where.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{where / 'mlflow.db'}"
