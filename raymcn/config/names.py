"""Names declared once: the modalities, stage orders and the metrics' prefix, the files and folders
raymcn writes, and where the embedded presets and the drain marks are. Stdlib only."""

from __future__ import annotations

import tempfile
from importlib import resources
from pathlib import Path

MODALITIES = ("video", "audio", "text")
STAGE_ORDERS = ("AV_T", "VT_A", "AT_V", "joint")
SEARCH_ALGORITHMS = ("bohb", "asha", "optuna", "random", "grid")
METRIC_PREFIX = "text_to_video"  # the retrieval direction every metric of config/metrics.py measures
TRACKERS = ("mlflow", "wandb", "tensorboard")  # run.trackers
SEARCH_DOMAINS = ("loguniform", "uniform", "choice", "randint", "grid")
EVAL_SET_KINDS = ("synthetic", "youcook", "msrvtt")
RUN_CONFIG_FILE = "raymcn_config.yaml"  # the resolved config beside a run's checkpoints or an imported checkpoint
SWEEP_CONFIG_FILE = "raymcn_sweep.yaml"  # the resolved base config in a sweep's folder
CONFIRM_DIR = "confirm"  # in a sweep's folder: the confirmation phase's own Tune experiment (sweep.confirm)
CONFIRM_PLAN_FILE = "confirm_plan.yaml"  # in CONFIRM_DIR: what is confirmed and why, written before its first trial
TRIAL_ERRORS_DIR = "raymcn_trial_errors"  # in a sweep's folder: <trial id>.txt for a trial ended by a permanent error
CONSOLE_LOG_FILE = "raymcn_console.log"  # in a run's or sweep's folder: everything Ray printed (train/monitor/console.py)
PROGRESS_FILE = "raymcn_progress.json"  # in a run's folder: rank 0's latest in-epoch progress (train/monitor/in_epoch.py)
METRICS_FILE = "metrics.csv"  # in a run's folder: one row per epoch of every reported metric (train/monitor/history.py)
# In a sweep's folder, written by raymcn, never by Tune: a ".json" name there would be replaced by
# the driver's older copy when a restored sweep's Tune uploads what it synced down at the restore.
DECISIONS_FILE = "raymcn_decisions.jsonl"  # what an early-stopping scheduler decided, and when
# Every trial's status as a Tune run of the sweep ended: Tune's own saved state still calls a trial
# that HyperBand stopped while it was paused PAUSED.
TRIAL_STATUS_FILE = "raymcn_trial_status.jsonl"
# In a run's or sweep's folder: what made its numbers (code, environment, data, seeds), an entry a line,
# appended at each start and resume and by each worker group, never rewritten (raymcn/provenance/)
RECORD_FILE = "raymcn_provenance.jsonl"
# In a run's or sweep's folder: it was rehearsed (`--rehearse`, `raymcn doctor --rehearse`), so neither
# `--resume latest` nor a boot continues it (`--resume DIR` does). The doctor's rehearsals are named
# REHEARSAL_PREFIX-<date> too, marked or not.
REHEARSAL_FILE = "raymcn_rehearsal"
REHEARSAL_PREFIX = "rehearsal"
# In a machine's temp folder: <pid> for each Ray Train worker there whose drain checkpoint is registered,
# JSON {"step", "rank", "time"} (train/checkpoints/policy.py writes it; `raymcn drain` reads it to
# reboot then, not at the deadline)
DRAIN_MARKS_DIR = "raymcn-drained"
MID_EPOCH_KEY = "mid_epoch"  # in the metrics of a mid-epoch checkpoint's report; such reports are not Tune results
# The process group's timeout (run.collective_timeout_s) against the watchdogs' limit (run.stall_timeout_s):
# its default, and the least it may be, in multiples of the watchdogs' limit (docs/faults.md, "Stalls")
COLLECTIVE_TIMEOUT_FACTOR = 2
COLLECTIVE_TIMEOUT_MIN_FACTOR = 1.5
DEFAULT_PRESET = "default.yaml"  # the embedded default: a few minutes on 2 CPUs, on the synthetic corpus


def preset_path(name: str = DEFAULT_PRESET) -> Path:
    """The embedded preset ``name`` (``raymcn/presets/``)."""
    return Path(str(resources.files("raymcn") / "presets" / name))


def drain_marks_dir() -> Path:
    """This machine's folder of drain marks (``DRAIN_MARKS_DIR``)."""
    return Path(tempfile.gettempdir()) / DRAIN_MARKS_DIR
