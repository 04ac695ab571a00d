"""A single run's per-epoch metrics in the trackers the lab asks for (``run.trackers``).

``metrics.csv`` (``history``) is always written; ``run.trackers`` (default ``tensorboard``) adds:

* ``tensorboard``: event files in ``<run folder>/tensorboard`` (``tensorboard --logdir RUN``),
  written by tensorboardX (Ray Tune's own writer, installed with it; the viewer is the
  ``raymcn[tensorboard]`` extra), one point per epoch.
* ``mlflow``: a local SQLite store ``mlflow.db`` in the run folder (MLflow 3 no longer accepts a
  plain ``./mlruns`` folder by default), experiment ``raymcn``, one MLflow run per raymcn run (its
  id kept in ``mlflow_run_id.txt``, so a resumed run continues it).
* ``wandb``: Weights & Biases, ``run.wandb_project`` / ``run.wandb_entity`` / ``run.wandb_mode``
  (default offline: ``wandb sync`` uploads later); the W&B run id is the raymcn run's name, so a
  resumed run continues it.

MLflow and TensorBoard show every value under its reported name (``metrics.csv``'s column, the
results table's) spelled by ``config.tracker_name``: MLflow refuses ``@`` and tensorboardX turns it
into ``_``, so ``text_to_video_R@10`` is ``text_to_video_R_at_10`` there, in runs and sweeps alike
(``sweep/trackers.py``).

Written after every epoch from rank 0's report (:class:`EpochReports`) by Ray Train's controller, on
the driver's node; the config goes in as parameters, and what made the run's numbers (its provenance
record, ``raymcn.provenance``) as MLflow's own tags (``mlflow.source.git.commit`` and the like, the
rest as ``raymcn.*``), W&B's config (``provenance/...``) and TensorBoard's text (``raymcn/provenance``). For a run stored in a bucket the files go to
the driver's local cache (``<cache>/trackers/<run name>``) instead: SQLite and event files need a
local file. A tracker that fails (not installed, a full disk) prints a
warning once and is dropped: a convenience is never worth ending a week-long run for.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any, Callable

from raymcn import storage
from raymcn.config import MID_EPOCH_KEY, TRACKERS, Config, default_cache_dir, reason, tracker_name
from raymcn.provenance import record
from raymcn.provenance.describe import flat, markdown, mlflow_tags

EXTRAS = {"mlflow": "mlflow", "wandb": "wandb", "tensorboard": "tensorboard"}  # pip install "raymcn[...]"
PROVENANCE_TAG = "raymcn/provenance"  # TensorBoard's text: what made the run's numbers


def local_folder(cfg: Config, run_dir: str) -> Path:
    """Where the trackers' files go: the run folder, or for a bucket run a folder in the cache."""
    if storage.is_uri(run_dir):
        return default_cache_dir(cfg) / "trackers" / storage.basename(run_dir)
    return Path(run_dir)


def event_file_suffix() -> str:
    """A TensorBoard event file's name ends in this: tensorboardX names a file by the second and the
    host only, and a writer opened in the same second as an earlier one (a resumed run, a trial
    resumed after a pause) would overwrite its file."""
    return f".{os.getpid()}.{secrets.token_hex(4)}"


class Trackers:
    """The trackers of ``cfg.run.trackers`` for the run in ``run_dir``; :meth:`log` once per epoch.
    Each opens on first use, so a ``Trackers`` not yet logged to can be pickled."""

    def __init__(self, cfg: Config, run_dir: str, say: Callable[[str], None] = print):
        self.cfg, self.run_dir, self.say = cfg, run_dir, say
        self.names = [t for t in cfg.run.trackers.split(",") if t]
        self.folder = local_folder(cfg, run_dir)
        self._open: dict[str, Any] = {}
        self._entries: list[dict] | None = None  # the run's record, read when a tracker first opens

    def log(self, epoch: int, metrics: dict[str, float]) -> None:
        """Log one epoch's ``metrics`` (scalars) to every tracker, opening each on first use."""
        for name in list(self.names):
            try:
                if name not in self._open:
                    self._open[name] = getattr(self, f"_open_{name}")()
                getattr(self, f"_log_{name}")(self._open[name], epoch, metrics)
            except Exception as e:  # noqa: BLE001 - see the module doc
                self.say(f"warning: run.trackers: {name} dropped for this run ({reason(e)}); "
                         f"is it installed? pip install 'raymcn[{EXTRAS[name]}]'")
                self.names.remove(name)

    def close(self) -> None:
        for name, handle in self._open.items():
            try:
                getattr(self, f"_close_{name}")(handle)
            except Exception as e:  # noqa: BLE001 - closing is best effort: said, never raised
                self.say(f"warning: run.trackers: {name} did not close cleanly ({reason(e)})")
        self._open.clear()

    def _record(self) -> list[dict]:
        """The run's provenance record (``raymcn.provenance``), as its driver and ranks wrote it so far
        ([] when it cannot be read, said once: the trackers go on without it; the record stays the run's)."""
        if self._entries is None:
            try:
                self._entries = record.read(self.run_dir)
            except OSError as e:
                self.say(f"warning: run.trackers: the run's record ({record.path_of(self.run_dir)}) could not be "
                         f"read ({reason(e)}); the trackers go on without it")
                self._entries = []
        return self._entries

    # --- mlflow ------------------------------------------------------------------------------------
    def _open_mlflow(self):
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        self.folder.mkdir(parents=True, exist_ok=True)
        client = MlflowClient(tracking_uri=f"sqlite:///{self.folder / 'mlflow.db'}")
        id_file = self.folder / "mlflow_run_id.txt"
        tags = [RunTag(k, v) for k, v in mlflow_tags(self._record(), record.path_of(self.run_dir)).items()]
        if id_file.exists():  # a resumed run: its tags say what it runs with now (the record keeps each)
            run_id = id_file.read_text().strip()
            client.log_batch(run_id, tags=tags)
            return client, run_id
        found = client.get_experiment_by_name("raymcn")
        experiment = found.experiment_id if found else client.create_experiment("raymcn")
        run = client.create_run(experiment, run_name=storage.basename(self.run_dir))
        client.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in self.cfg.to_flat().items()], tags=tags)
        id_file.write_text(run.info.run_id)
        return client, run.info.run_id

    @staticmethod
    def _log_mlflow(handle, epoch: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        client, run_id = handle
        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(tracker_name(k), float(v), now, epoch) for k, v in metrics.items()])

    @staticmethod
    def _close_mlflow(handle) -> None:
        client, run_id = handle
        client.set_terminated(run_id)

    # --- wandb -------------------------------------------------------------------------------------
    def _open_wandb(self):
        import wandb

        self.folder.mkdir(parents=True, exist_ok=True)
        r = self.cfg.run
        return wandb.init(project=r.wandb_project, entity=r.wandb_entity or None, mode=r.wandb_mode,
                          name=storage.basename(self.run_dir), id=storage.basename(self.run_dir), resume="allow",
                          dir=str(self.folder), config={**self.cfg.to_flat(), **flat(self._record())})

    @staticmethod
    def _log_wandb(run, epoch: int, metrics: dict[str, float]) -> None:
        run.log({k: float(v) for k, v in metrics.items()}, step=epoch)

    @staticmethod
    def _close_wandb(run) -> None:
        run.finish()

    # --- tensorboard -------------------------------------------------------------------------------
    def _open_tensorboard(self):
        from tensorboardX import SummaryWriter

        writer = SummaryWriter(str(self.folder / "tensorboard"), filename_suffix=event_file_suffix())
        entries = self._record()  # the text plugin's tab: one text per start and resume
        writer.add_text(PROVENANCE_TAG, markdown(entries, record.path_of(self.run_dir)),
                        global_step=len(record.drivers(entries)))
        return writer

    @staticmethod
    def _log_tensorboard(writer, epoch: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            writer.add_scalar(tracker_name(key), float(value), global_step=epoch)
        writer.flush()

    @staticmethod
    def _close_tensorboard(writer) -> None:
        writer.close()


class EpochReports:
    """A run's reports, as ``ray.train.report`` sends them, to its trackers: each epoch's metrics
    logged once it ends, a mid-epoch checkpoint's report skipped, the trackers closed after epoch
    ``epochs``. Built where the run starts, which decides the folder (:func:`local_folder`: the
    driver's cache for a bucket run); the trackers open where it is fed: on Ray Train's controller
    (``on_ray/launch.py``), or by the in-process rank of a run without workers (Ray Train's local
    mode calls no callback). A worker group restarted from a checkpoint reports its epochs again,
    and they are logged again, as the run's history shows them."""

    def __init__(self, cfg: Config, run_dir: str, epochs: int, say: Callable[[str], None] = print):
        self.tracked, self.epochs = Trackers(cfg, run_dir, say=say), epochs

    def report(self, metrics: dict[str, float]) -> None:
        if MID_EPOCH_KEY in metrics or "epoch" not in metrics:  # a mid-epoch checkpoint's report
            return
        epoch = int(metrics["epoch"])
        self.tracked.log(epoch, metrics)
        if epoch == self.epochs:
            self.tracked.close()


__all__ = ["TRACKERS", "EpochReports", "Trackers", "event_file_suffix", "local_folder"]
