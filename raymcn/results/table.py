"""A Tune experiment directory -> one row per trial -> Markdown / CSV (and, via ``plots``, PNGs).

Reads files only (no Ray import), so it works on a finished, interrupted or still running sweep,
on a copy of the directory, and in the default test tier. Layout read (Ray 2.x function trainables)::

    EXP_DIR/raymcn_sweep.yaml            base config (Config.to_dict() shape): schedule.epochs
    EXP_DIR/experiment_state-*.json      optional, best effort: Tune's trial statuses
    EXP_DIR/<trial_dir>/params.json      the trial's sampled config, dotted keys ("optim.lr")
    EXP_DIR/<trial_dir>/result.json      JSON lines, one per reported epoch (may end mid-line)
    EXP_DIR/<trial_dir>/error.txt        present when the trial errored

Column names are the metric and loss names of the training loop (``config.RETRIEVAL_METRICS``,
``*_loss``), so the table, the ``--json`` output and Tune's results agree.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd
import yaml

from raymcn.config import PRIMARY_METRIC, PRIMARY_MODE, RETRIEVAL_METRICS

SWEEP_CONFIG_FILE = "raymcn_sweep.yaml"  # = sweep.tuner.SWEEP_CONFIG_FILE; not imported: tuner imports Ray
STAGE_KEY = "schedule.stage_order"
LR_KEY = "optim.lr"
EPOCHS_KEY = "schedule.epochs"
PRIMARY_BEST = f"best_{PRIMARY_METRIC}"
# Tune's own clocks look like our step timings (time_*_s) but are not per-step means.
_TUNE_TIMES = {"time_total_s", "time_this_iter_s", "time_since_restore"}
# Tune statuses meaning "not finished yet": PENDING also covers trials that were running when the
# state was saved (Tune writes RUNNING as PENDING), PAUSED covers BOHB's paused trials.
_UNFINISHED = {"RUNNING", "PENDING", "PAUSED"}
STATUSES = ("done", "stopped", "running", "error")


class ExperimentError(FileNotFoundError):
    """The experiment directory is missing or holds no trials; the message names the path."""


def metric_mode(metric: str) -> str:
    """``"min"`` for MedR (lower is better), ``"max"`` for R@K."""
    return "min" if metric.endswith("MedR") else "max"


# --- reading -------------------------------------------------------------------------------------
def _read_rows(path: Path) -> list[dict[str, Any]]:
    """result.json rows, scalar values only. A running trial's file may end in a half-written
    line, so undecodable lines are skipped instead of failing the whole table."""
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


def _base_epochs(exp_dir: Path) -> int | None:
    """schedule.epochs of the base config, or None when the sweep YAML is absent or unreadable."""
    try:
        cfg = yaml.safe_load((exp_dir / SWEEP_CONFIG_FILE).read_text())
        return int(cfg["schedule"]["epochs"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return None


def _tune_states(exp_dir: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Best effort read of the newest ``experiment_state-*.json``: (trial_id -> Tune status,
    trial dir name -> trial_id). Its format is Tune-internal, so any surprise yields empty maps."""
    statuses: dict[str, str] = {}
    dirs: dict[str, str] = {}
    files = sorted(exp_dir.glob("experiment_state-*.json"), key=lambda p: p.stat().st_mtime)
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
    except Exception:  # noqa: BLE001 - internal format; the table must not depend on it
        return {}, {}
    return statuses, dirs


def _trial_dirs(exp_dir: Path) -> list[Path]:
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
            tune_status: str) -> str:
    if (trial_dir / "error.txt").exists() or tune_status == "ERROR":
        return "error"
    if tid in running:
        return "running"
    if target is not None and epochs >= target:
        return "done"
    # Without a Tune state we cannot tell running from stopped; stopped is the safe default for
    # the finished sweeps this table is mostly read on.
    return "running" if tune_status in _UNFINISHED else "stopped"


def _summary(curve: pd.DataFrame) -> dict[str, Any]:
    """final_/best_ retrieval metrics, final *_loss, step timings and wall time of one curve."""
    out: dict[str, Any] = {}
    last = curve.iloc[-1] if len(curve) else pd.Series(dtype=object)
    for m in RETRIEVAL_METRICS:
        values = pd.to_numeric(curve[m], errors="coerce") if m in curve else pd.Series(dtype=float)
        out[f"final_{m}"] = _num(last.get(m))
        best = values.min() if metric_mode(m) == "min" else values.max()
        out[f"best_{m}"] = float(best) if pd.notna(best) else math.nan
    # "final" = the last epoch's row for every column, so all final_* values describe one epoch;
    # a loss term absent from that row is NaN rather than a stale value from an earlier stage.
    for k in curve.columns:
        if k.endswith("_loss") or k == "samples_per_s" or (
                k.startswith("time_") and k.endswith("_s") and k not in _TUNE_TIMES):
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
            final_<metric>, best_<metric>`` (for each of RETRIEVAL_METRICS; best = max for R@K,
            min for MedR), ``<name>_loss`` (last epoch's value), step timings ``time_*_s`` and
            ``samples_per_s`` (the last epoch's per-step means), ``wall_s`` (Tune's time_total_s).
            Sorted by ``best_<PRIMARY_METRIC>``, best first; trials that never reported come last.
        curves: one row per (trial, epoch) with every scalar the trial reported.

    ``status``: ``error`` (error.txt), ``running`` (in ``running_trial_ids`` or unfinished in
    Tune's saved state, which includes an interrupted sweep that can be resumed), ``done``
    (reached schedule.epochs), else ``stopped`` (early-stopped by the scheduler).

    Raises:
        ExperimentError: the directory does not exist or holds no trial directory.
    """
    exp_dir = Path(getattr(exp_dir, "experiment_path", exp_dir)).expanduser()
    dirs = _trial_dirs(exp_dir)
    running = {str(t) for t in (running_trial_ids or ())}
    base_epochs = _base_epochs(exp_dir)
    tune_status, dir_ids = _tune_states(exp_dir)
    records, curves, config_keys = [], [], []
    for d in dirs:
        params, rows = _read_params(d), _read_rows(d / "result.json")
        tid = str(next((r["trial_id"] for r in rows if r.get("trial_id")), dir_ids.get(d.name, d.name)))
        curve = _curve(rows)
        epochs = int(curve["epoch"].max()) if len(curve) else 0
        target = int(params[EPOCHS_KEY]) if EPOCHS_KEY in params else base_epochs
        config_keys += [k for k in params if k not in config_keys]
        records.append({"trial": tid, "epochs": epochs, **params, **_summary(curve),
                        "status": _status(d, tid, epochs, target, running, tune_status.get(tid, ""))})
        curves.append(curve.assign(trial=tid))
    if base_epochs is None:  # no sweep YAML: the longest trial defines "done"
        _infer_done(records)
    trials = _order_columns(pd.DataFrame(records), config_keys)
    return _sort(trials), _curves_frame(curves)


def _infer_done(records: list[dict[str, Any]]) -> None:
    longest = max(r["epochs"] for r in records)
    for r in records:
        if r["status"] == "stopped" and r["epochs"] == longest and longest > 0:
            r["status"] = "done"


def _order_columns(df: pd.DataFrame, config_keys: list[str]) -> pd.DataFrame:
    metrics = [f"{p}_{m}" for m in RETRIEVAL_METRICS for p in ("final", "best")]
    losses = sorted((c for c in df if c.endswith("_loss")), key=lambda c: (c != "total_loss", c))
    timing = sorted(c for c in df if c.startswith("time_") and c.endswith("_s")) + [
        c for c in ("samples_per_s",) if c in df]
    cols = ["trial", "status", "epochs", *config_keys, *metrics, *losses, *timing, "wall_s"]
    return df.reindex(columns=cols)


def _sort(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values([PRIMARY_BEST, "trial"], ascending=[PRIMARY_MODE == "min", True],
                          na_position="last", kind="stable").reset_index(drop=True)


def _curves_frame(curves: list[pd.DataFrame]) -> pd.DataFrame:
    df = pd.concat(curves, ignore_index=True) if curves else pd.DataFrame()
    front = ["trial", "epoch"]
    return df[front + [c for c in df.columns if c not in front]]


# --- public: grouping ----------------------------------------------------------------------------
def _is_result_column(col: str) -> bool:
    if "." in col:  # a swept config key, not a result
        return False
    return col.startswith(("final_", "best_")) or col.endswith(("_loss", "_s")) or col == "epochs"


def group_table(df: pd.DataFrame, by: str = STAGE_KEY) -> pd.DataFrame:
    """Mean and sample std (``ddof=1``; NaN for a group of one) of every result column per value
    of ``by``: columns ``by, n, n_reported, <col>_mean, <col>_std``. ``n`` counts the group's
    trials (any status); trials without a value (NaN, e.g. errored before their first report) are
    left out of that column's mean/std; ``n_reported`` counts the trials with a best primary
    metric. Groups are sorted by the mean best primary metric, best first.

    Raises:
        KeyError: ``by`` is not a column (e.g. it was not swept); the message lists the swept keys.
    """
    if by not in df.columns:
        swept = [c for c in df.columns if "." in c]
        raise KeyError(f"cannot group by '{by}': not a column of the table (swept keys: {', '.join(swept) or 'none'})")
    cols = [c for c in df.columns if _is_result_column(c) and c != by]
    g = df.groupby(by, sort=False, dropna=False)
    out = g.size().rename("n").to_frame()
    if PRIMARY_BEST in df:  # how many of the n trials the mean/std of the primary metric rests on
        out["n_reported"] = g[PRIMARY_BEST].count()
    for c in cols:
        values = g[c]
        out[f"{c}_mean"] = values.mean()
        out[f"{c}_std"] = values.std(ddof=1)
    out = out.reset_index()
    key = f"{PRIMARY_BEST}_mean"
    if key in out:
        out = out.sort_values(key, ascending=PRIMARY_MODE == "min", na_position="last", kind="stable")
    return out.reset_index(drop=True)


# --- public: formatting --------------------------------------------------------------------------
def _spec(col: str) -> str:
    """Format spec by column name: R@K in percent points, losses to 4 significant digits."""
    if "R@" in col:
        return ".2f"
    if col.endswith("MedR"):
        return ".1f"
    if col.endswith("_loss"):
        return ".4g"
    if col in ("samples_per_s", "wall_s"):
        return ".1f"
    if col.startswith("time_"):
        return ".3g"
    return ".4g"


def _cell(col: str, v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, (bool, np.bool_)):
        return str(bool(v))
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        return format(float(v), _spec(col))
    return str(v).replace("|", "\\|")  # a pipe would split the Markdown cell


def _md_columns(df: pd.DataFrame) -> list[tuple[str, list[str], bool]]:
    """(header, cells, numeric) per displayed column; ``X_mean``/``X_std`` pairs become one
    ``X`` column rendered as "mean ± std"."""
    out = []
    for col in df.columns:
        if col.endswith("_std") and f"{col[:-4]}_mean" in df:
            continue
        numeric = pd.api.types.is_numeric_dtype(df[col]) and not pd.api.types.is_bool_dtype(df[col])
        if col.endswith("_mean") and f"{col[:-5]}_std" in df:
            base = col[:-5]
            cells = [f"{_cell(base, m)} ± {_cell(base, s)}" for m, s in zip(df[col], df[f"{base}_std"])]
            out.append((base, cells, True))
        else:
            out.append((col, [_cell(col, v) for v in df[col].tolist()], numeric))
    return out


def format_table(df: pd.DataFrame, fmt: str = "md") -> str:
    """``md``: a Markdown pipe table, numbers right-aligned and rounded per column kind (R@K 2
    decimals, MedR 1, losses 4 significant digits), missing values as ``-``, mean/std pairs as
    "12.34 ± 1.20". ``csv``: every column at full precision (mean and std stay separate)."""
    if fmt == "csv":
        return df.to_csv(index=False)
    if fmt != "md":
        raise ValueError(f"unknown table format {fmt!r}: allowed md, csv")
    cols = _md_columns(df)
    lines = ["| " + " | ".join(h for h, _, _ in cols) + " |",
             "|" + "|".join("---:" if num else "---" for _, _, num in cols) + "|"]
    lines += ["| " + " | ".join(cells[i] for _, cells, _ in cols) + " |" for i in range(len(df))]
    return "\n".join(lines) + "\n"


# --- command line ------------------------------------------------------------------------------------
def add_table_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of ``raymcn table``; returns ``parser`` so callers can chain ``.parse_args``."""
    parser.add_argument("experiment_dir", help="Tune experiment directory (holds raymcn_sweep.yaml and trial dirs)")
    parser.add_argument("--format", choices=("md", "csv"), default="md", help="table format (default md)")
    parser.add_argument("--group-by", metavar="KEY", default=None,
                        help=f"also print mean ± std per value of KEY (md default: {STAGE_KEY} when swept; "
                             "with --format csv only the grouped table is printed)")
    parser.add_argument("--no-plots", action="store_true", help="do not write PNG plots into the experiment dir")
    parser.add_argument("--timing", action="store_true",
                        help="md: add the per-step timing columns (time_*_s, samples_per_s); csv always has them")
    return parser


def without_timing(df: pd.DataFrame) -> pd.DataFrame:
    """Drop the step-timing columns (kept in CSV; shown in Markdown with --timing)."""
    return df[[c for c in df.columns if not ((c.startswith("time_") and "_s" in c) or c.startswith("samples_per_s"))]]


def run_table(args: argparse.Namespace) -> int:
    """Print the table (and grouped table), write plots; 0 on success, 2 on a bad directory or key."""
    try:
        trials, curves = load_experiment(args.experiment_dir)
    except ExperimentError as e:
        print(f"raymcn table: {e}", file=sys.stderr)
        return 2
    by = args.group_by or (STAGE_KEY if args.format == "md" and STAGE_KEY in trials else None)
    try:
        grouped = group_table(trials, by) if by else None
    except KeyError as e:
        print(f"raymcn table: {e.args[0]}", file=sys.stderr)
        return 2
    # csv goes to a file or a pipe: print exactly one table and keep notes on stderr.
    notes = sys.stderr if args.format == "csv" else sys.stdout
    if args.format == "csv":
        print(format_table(grouped if args.group_by else trials, "csv"), end="")
    else:
        shown = (lambda df: df) if getattr(args, "timing", False) else without_timing
        print(format_table(shown(trials), "md"))
        if grouped is not None:
            print(f"mean ± std (ddof=1) over trials, grouped by {by}:\n")
            print(format_table(shown(grouped), "md"))
    if not args.no_plots:
        from raymcn.results.plots import write_plots  # matplotlib only when plots are wanted

        skipped = lambda msg: print(f"skipped {msg}", file=notes)  # noqa: E731
        for path in write_plots(Path(args.experiment_dir).expanduser(), trials, curves, on_skip=skipped):
            print(f"plot: {path}", file=notes)
    return 0


def main_table(argv: list[str] | None = None) -> int:
    """``raymcn table EXPERIMENT_DIR [--format md|csv] [--group-by KEY] [--no-plots]``."""
    parser = add_table_arguments(argparse.ArgumentParser(prog="raymcn table", description=__doc__.splitlines()[0]))
    return run_table(parser.parse_args(argv))
