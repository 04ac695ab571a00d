"""A Tune experiment directory -> one row per trial (and one row per trial-epoch).

Reads files only (no Ray import), so it works on a finished, interrupted or still running sweep,
on a copy of the directory, and in the default test tier. Layout read (Ray 2.x function trainables)::

    EXP_DIR/raymcn_sweep.yaml            base config (Config.to_dict() shape): schedule.*
    EXP_DIR/experiment_state-*.json      optional, best effort: Tune's trial statuses
    EXP_DIR/<trial_dir>/params.json      the trial's sampled config, dotted keys ("optim.lr")
    EXP_DIR/<trial_dir>/result.json      JSON lines, one per reported epoch (may end mid-line)
    EXP_DIR/train/train-<id>/metrics.csv rank 0's row per epoch of the trial's Train run (fills the
                                         epochs result.json lacks after a driver's reboot)
    EXP_DIR/<trial_dir>/error.txt        present when the trial errored

``<trial_dir>`` is any name (Tune's default or ``sweep.names.trial_dirname``); the trial id comes
from the rows, Tune's state, or else the directory name. Column names are the metric and loss
names of the training loop (the table of metrics, ``config/metrics.py``; ``*_loss``), so the
table, the ``--json`` output and Tune's results agree. What the sweep optimizes is its
``sweep.metric`` (:func:`sweep_objective`); a sweep saved before that setting existed optimized
the default, each trial's best R@10.
"""

from __future__ import annotations

import csv
import io
import json
import math
import warnings
from pathlib import Path
from typing import Any, Iterable

import pandas as pd
import yaml

from raymcn.config import (
    METRICS_FILE,
    TRIAL_ERRORS_DIR,
    TRIAL_STATUS_FILE,
    Objective,
    ScheduleConfig,
    SweepConfig,
    metric_table,
    objective,
    reason,
)
from raymcn.results.columns import (
    EPOCHS_KEY,
    FRACTION_KEY,
    STAGE_KEY,
    SWEEP_CONFIG_FILE,
    SWITCH_EPOCH,
    TUNE_TIMES,
)

# Tune statuses meaning "not finished yet": PENDING also covers trials that were running when the
# state was saved (Tune writes RUNNING as PENDING), PAUSED covers BOHB's paused trials.
_UNFINISHED = {"RUNNING", "PENDING", "PAUSED"}
STATUSES = ("done", "stopped", "running", "error")


class ExperimentError(FileNotFoundError):
    """The experiment directory is missing or holds no trials; the message names the path."""


# --- reading -------------------------------------------------------------------------------------
def read_result_rows(trial_dir: Path) -> list[dict[str, Any]]:
    """A trial's reported epochs, scalar values only: ``result.json``'s rows, after the rows of
    its Train run's ``metrics.csv`` (``EXP/train/train-<trial id>/``) for the epochs Tune's file
    lacks. Tune copies its result files into the sweep's folder only every so often, and a
    restored sweep uploads a resumed trial's new file over the old one, so after a reboot of the
    driver result.json may start late or skip an epoch; rank 0 rewrites metrics.csv whole at every
    epoch end, in the sweep's storage. A running trial's file may end in a half-written line, so
    undecodable lines are skipped instead of failing the whole table."""
    rows = _rows(trial_dir / "result.json")
    tid = next((str(r["trial_id"]) for r in rows if r.get("trial_id")), trial_dir.name.rsplit("-", 1)[-1])
    have = {r.get("epoch") for r in rows}
    table = trial_dir.parent / "train" / f"train-{tid}" / METRICS_FILE
    kept = _csv_rows(table) if table.exists() else []
    return [{**r, "trial_id": tid} for r in kept if r.get("epoch") not in have] + rows


def _csv_rows(path: Path) -> list[dict[str, Any]]:
    try:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in
                csv.DictReader(io.StringIO(path.read_text(errors="replace")))]
    except (OSError, ValueError):
        return []


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append({k: v for k, v in row.items() if v is None or isinstance(v, (int, float, str, bool))})
    return rows


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys whatever the nesting (params.json is flat for raymcn, nested for other sweeps)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v if v is None or isinstance(v, (int, float, str, bool)) else str(v)
    return out


def _read_params(trial_dir: Path) -> dict[str, Any]:
    path = trial_dir / "params.json"
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # a trial that died before Tune wrote its params still gets a row
    return _flatten(loaded) if isinstance(loaded, dict) else {}


def _base_config(exp_dir: Path) -> dict[str, Any] | None:
    """The sweep's base config as dotted keys, or None when the sweep YAML is absent or unreadable."""
    try:
        cfg = yaml.safe_load((exp_dir / SWEEP_CONFIG_FILE).read_text())
    except (OSError, yaml.YAMLError):
        return None
    return _flatten(cfg) if isinstance(cfg, dict) else None


def sweep_objective(exp_dir: str | Path) -> Objective:
    """What the sweep in ``exp_dir`` optimizes: the ``sweep.metric`` of its ``raymcn_sweep.yaml``;
    the setting's default when the file is absent or was saved before the setting existed.

    Raises:
        ExperimentError: the file names a metric the table does not list (the message lists them).
    """
    exp_dir = Path(exp_dir).expanduser()
    name = (_base_config(exp_dir) or {}).get("sweep.metric", SweepConfig().metric)
    try:
        return objective(str(name))
    except ValueError as e:
        raise ExperimentError(f"{exp_dir / SWEEP_CONFIG_FILE}: {e}") from None


def _int(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def switch_epoch(order: Any, fraction: Any, epochs: Any) -> float:
    """Epochs of training before a staged order adds its third modality: ``stage1_fraction ×
    epochs`` (``train.stages.switch_step`` rounds the same fraction up to a whole step, i.e. to
    within one step of this). NaN for ``joint`` (one stage) or when a value is unknown."""
    try:
        value = float(fraction) * float(epochs)
    except (TypeError, ValueError):
        return math.nan
    return math.nan if order == "joint" or order is None or not math.isfinite(value) else value


def _tune_states(exp_dir: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Best effort read of the newest ``experiment_state-*.json``: (trial_id -> Tune status,
    trial dir name -> trial_id). Its format is Tune-internal, so any surprise yields empty maps."""
    statuses: dict[str, str] = {}
    dirs: dict[str, str] = {}
    # newest by the time in its name: a restored sweep uploads the older files again at its end
    files = sorted(exp_dir.glob("experiment_state-*.json"))
    if not files:
        return statuses, dirs
    try:
        for entry in json.loads(files[-1].read_text()).get("trial_data", []):
            state = entry[0] if isinstance(entry, (list, tuple)) else entry
            state = json.loads(state) if isinstance(state, str) else state
            tid = str(state["trial_id"])
            statuses[tid] = str(state.get("status", ""))
            if state.get("relative_logdir"):
                dirs[Path(str(state["relative_logdir"])).name] = tid
    except Exception as e:  # noqa: BLE001 - internal format; the table must not depend on it
        warnings.warn(f"{files[-1]}: Tune's trial statuses unreadable ({reason(e)}); the table goes on without them",
                      stacklevel=2)
        return {}, {}
    try:  # raymcn's record of how that Tune run ended corrects a trial stopped while paused
        for line in (exp_dir / TRIAL_STATUS_FILE).read_text().splitlines():
            ended = json.loads(line)
            if ended["tune_state"] == files[-1].name:
                statuses[str(ended["trial"])] = str(ended["status"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return statuses, dirs


def trial_dirs(exp_dir: Path) -> list[Path]:
    """Sub-directories that look like Tune trials (the sweep's ``train/`` storage does not)."""
    if not exp_dir.is_dir():
        raise ExperimentError(f"experiment directory {exp_dir} does not exist")
    dirs = sorted(d for d in exp_dir.iterdir()
                  if d.is_dir() and ((d / "params.json").exists() or (d / "result.json").exists()))
    if not dirs:
        raise ExperimentError(f"no trials in {exp_dir}: no sub-directory holds a params.json or result.json "
                              "(pass the Tune experiment directory, the one holding raymcn_sweep.yaml)")
    return dirs


def _curve(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per epoch, sorted. A restored trial re-reports epochs from its checkpoint: the
    later report wins. Rows without an epoch (Tune's bookkeeping rows) are dropped."""
    df = pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame({"epoch": pd.Series(dtype=int)})
    if "epoch" not in df and "training_iteration" in df:
        df["epoch"] = df["training_iteration"]
    if "epoch" not in df:
        return pd.DataFrame({"epoch": pd.Series(dtype=int)})
    df = df[pd.to_numeric(df["epoch"], errors="coerce").notna()].copy()
    df["epoch"] = df["epoch"].astype(float).astype(int)
    return df.drop_duplicates("epoch", keep="last").sort_values("epoch").reset_index(drop=True)


# --- one trial -> one row --------------------------------------------------------------------------
def _status(trial_dir: Path, tid: str, epochs: int, target: int | None, running: set[str],
            tune_status: str, failed: set[str]) -> str:
    # Tune writes error.txt at every failure, also of a trial it then retried to its end
    if tune_status == "ERROR" or tid in failed or ((trial_dir / "error.txt").exists() and tune_status != "TERMINATED"):
        return "error"
    if tid in running:
        return "running"
    if target is not None and epochs >= target:
        return "done"
    # Without a Tune state we cannot tell running from stopped; stopped is the safe default for
    # the finished sweeps this table is mostly read on.
    return "running" if tune_status in _UNFINISHED else "stopped"


def _summary(curve: pd.DataFrame) -> dict[str, Any]:
    """final_/best_ retrieval metrics (best by each metric's direction), final *_loss, step timings
    and wall time of one curve."""
    out: dict[str, Any] = {}
    last = curve.iloc[-1] if len(curve) else pd.Series(dtype=object)
    for m in metric_table():
        values = pd.to_numeric(curve[m.name], errors="coerce") if m.name in curve else pd.Series(dtype=float)
        out[f"final_{m.name}"] = _num(last.get(m.name))
        best = (values * m.sign).max() * m.sign
        out[f"best_{m.name}"] = float(best) if pd.notna(best) else math.nan
    # "final" = the last epoch's row for every column, so all final_* values describe one epoch;
    # a loss term absent from that row is NaN rather than a stale value from an earlier stage.
    for k in curve.columns:
        if k.endswith("_loss") or k == "samples_per_s" or (
                k.startswith("time_") and k.endswith("_s") and k not in TUNE_TIMES):
            out[k] = _num(last.get(k))
    out["wall_s"] = _num(last.get("time_total_s"))
    return out


def _num(v: Any) -> float:
    try:
        return float(v) if v is not None else math.nan
    except (TypeError, ValueError):
        return math.nan


# --- public: load ------------------------------------------------------------------------------------
def load_experiment(exp_dir: str | Path | Any,
                    running_trial_ids: Iterable[str] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Read a Tune experiment directory (or anything with an ``experiment_path``, e.g. a ResultGrid).

    Returns:
        trials: one row per trial, columns ``trial, status, epochs, <swept dotted keys>,
            final_<metric>, best_<metric>`` (for each metric of the table; best by its direction:
            the highest R@K, the lowest rank), ``<name>_loss`` (last epoch's value), step timings
            ``time_*_s`` and ``samples_per_s`` (the last epoch's per-step means), ``wall_s``
            (Tune's time_total_s), ``switch_epoch`` (:func:`switch_epoch` of the trial's order; NaN
            for joint). Sorted by the sweep's ``sweep.metric`` (:func:`sweep_objective`), best
            first; trials that never reported come last.
        curves: one row per (trial, epoch) with every scalar the trial reported.

    ``status``: ``error`` (error.txt, or the trial's file in ``TRIAL_ERRORS_DIR``), ``running`` (in ``running_trial_ids`` or unfinished in
    Tune's saved state, which includes an interrupted sweep that can be resumed), ``done``
    (reached schedule.epochs), else ``stopped`` (early-stopped by the scheduler).

    Raises:
        ExperimentError: the directory does not exist or holds no trial directory, or its sweep
            file names a metric the table does not list.
    """
    exp_dir = Path(getattr(exp_dir, "experiment_path", exp_dir)).expanduser()
    dirs = trial_dirs(exp_dir)
    ranked_by = sweep_objective(exp_dir)
    running = {str(t) for t in (running_trial_ids or ())}
    base = _base_config(exp_dir)
    base_epochs = _int((base or {}).get(EPOCHS_KEY))
    tune_status, dir_ids = _tune_states(exp_dir)
    # trials ended by a permanent error (sweep.tuner.trial_fn): Tune saw them finish normally
    failed = {p.stem for p in (exp_dir / TRIAL_ERRORS_DIR).glob("*.txt")}
    records, curves, config_keys = [], [], []
    for d in dirs:
        params, rows = _read_params(d), read_result_rows(d)
        tid = str(next((r["trial_id"] for r in rows if r.get("trial_id")), dir_ids.get(d.name, d.name)))
        curve = _curve(rows)
        epochs = int(curve["epoch"].max()) if len(curve) else 0
        target = _int(params[EPOCHS_KEY]) if EPOCHS_KEY in params else base_epochs
        config_keys += [k for k in params if k not in config_keys]
        records.append({"trial": tid, "epochs": epochs, **params, **_summary(curve),
                        SWITCH_EPOCH: _trial_switch(params, base),
                        "status": _status(d, tid, epochs, target, running, tune_status.get(tid, ""), failed)})
        curves.append(curve.assign(trial=tid))
    if base_epochs is None:  # no sweep YAML: the longest trial defines "done"
        _infer_done(records)
    trials = _order_columns(pd.DataFrame(records), config_keys)
    return _sort(trials, ranked_by), _curves_frame(curves)


def _trial_switch(params: dict[str, Any], base: dict[str, Any] | None) -> float:
    """The trial's switch epoch from its own keys, else the sweep's base config, else (fraction
    only) the config default; no base config leaves the order and the epochs unknown (NaN)."""
    def get(key: str, default: Any = None) -> Any:
        return params.get(key, (base or {}).get(key, default))

    return switch_epoch(get(STAGE_KEY), get(FRACTION_KEY, ScheduleConfig().stage1_fraction), get(EPOCHS_KEY))


def _infer_done(records: list[dict[str, Any]]) -> None:
    longest = max(r["epochs"] for r in records)
    for r in records:
        if r["status"] == "stopped" and r["epochs"] == longest and longest > 0:
            r["status"] = "done"


def _order_columns(df: pd.DataFrame, config_keys: list[str]) -> pd.DataFrame:
    values = [f"{p}_{m.name}" for m in metric_table() for p in ("final", "best")]
    losses = sorted((c for c in df if c.endswith("_loss")), key=lambda c: (c != "total_loss", c))
    timing = sorted(c for c in df if c.startswith("time_") and c.endswith("_s")) + [
        c for c in ("samples_per_s",) if c in df]
    cols = ["trial", "status", "epochs", *config_keys, *values, *losses, *timing, "wall_s", SWITCH_EPOCH]
    return df.reindex(columns=cols)


def _sort(df: pd.DataFrame, ranked_by: Objective) -> pd.DataFrame:
    return df.sort_values([ranked_by.column, "trial"], ascending=[ranked_by.mode == "min", True],
                          na_position="last", kind="stable").reset_index(drop=True)


def _curves_frame(curves: list[pd.DataFrame]) -> pd.DataFrame:
    df = pd.concat(curves, ignore_index=True) if curves else pd.DataFrame()
    front = ["trial", "epoch"]
    return df[front + [c for c in df.columns if c not in front]]
