"""Writes Tune experiment directories the way Tune 2.x does for a function trainable, for the
results tests (no Ray): the sweep YAML, per trial ``params.json`` (dotted keys), ``result.json``
(one JSON object per reported epoch, Tune's bookkeeping keys and nested ``config`` included),
``progress.csv`` and, for an errored trial, ``error.txt``."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import yaml

from raymcn.config import BEST, best_values, metric_table
from raymcn.config.metrics import MAX

R10 = "text_to_video_R@10"


def write_sweep_yaml(exp: Path, epochs: int, stage_order: str = "joint", stage1_fraction: float = 0.5) -> None:
    exp.mkdir(parents=True, exist_ok=True)
    (exp / "raymcn_sweep.yaml").write_text(yaml.safe_dump(
        {"schedule": {"epochs": epochs, "stage_order": stage_order, "stage1_fraction": stage1_fraction},
         "sweep": {"space": {}}}))


def metrics_for(r10: float) -> dict[str, float]:
    """Every metric of the table (``config/metrics.py``, in its order) as a function of R@10, so that
    expected values are easy to recompute and one epoch is a trial's best by all of them: the
    i-th higher-is-better metric is ``min(100, r10 * (i + 1) / 3)`` (R@10, the third, is ``r10``),
    the i-th lower-is-better one ``(i + 2) * (50 - r10 / 2)``, falling as R@10 rises."""
    out, higher, lower = {}, 0, 0
    for m in metric_table():
        if m.direction == MAX:
            out[m.name] = r10 if m.name == R10 else min(100.0, r10 * (higher + 1) / 3)
            higher += 1
        else:
            out[m.name] = (lower + 2) * (50 - r10 / 2)
            lower += 1
    return out


def tune_row(trial_id: str, epoch: int, r10: float, config: dict[str, Any], best: dict[str, float] | None = None,
             **extra: Any) -> dict[str, Any]:
    """One reported epoch as Tune writes it into result.json; ``best``: the epochs' before (the
    ``best_`` values every epoch reports, ``config.best_values``)."""
    metrics = metrics_for(r10)
    return {"epoch": epoch, **metrics, **best_values(best or {}, metrics), "total_loss": 5.0 / epoch,
            "samples_per_s": 100.0, "trial_id": trial_id, "time_total_s": 60.0 * epoch, "time_this_iter_s": 60.0,
            "training_iteration": epoch, "done": False, "timestamp": 1_700_000_000 + epoch,
            "config": config, **extra}


def write_trial(exp: Path, dirname: str, trial_id: str, params: dict[str, Any], r10s: list[float],
                error: bool = False, partial_line: bool = False, extra: dict[str, Any] | None = None) -> Path:
    """A trial directory with one result row per value of ``r10s``; ``partial_line`` appends the
    half-written line a running trial's file can end in; ``extra``: more metrics in every row."""
    d = exp / dirname
    d.mkdir(parents=True, exist_ok=True)
    (d / "params.json").write_text(json.dumps(params))
    rows: list[dict[str, Any]] = []
    for e, r in enumerate(r10s, start=1):
        before = {k: v for k, v in (rows[-1] if rows else {}).items() if k.startswith(BEST)}
        rows.append(tune_row(trial_id, e, r, params, before, **(extra or {})))
    text = "".join(json.dumps(r) + "\n" for r in rows) + ('{"epoch": 9, "text_to' if partial_line else "")
    (d / "result.json").write_text(text)
    with open(d / "progress.csv", "w", newline="") as f:
        if rows:
            flat = [{k: v for k, v in r.items() if k != "config"} for r in rows]
            w = csv.DictWriter(f, fieldnames=list(flat[0]))
            w.writeheader()
            w.writerows(flat)
    if error:
        (d / "error.txt").write_text("RuntimeError: boom")
    return d


def curve(final: float, epochs: int, switch: int | None) -> list[float]:
    """A plausible R@10 curve: near chance before ``switch`` (a staged order has no text yet),
    then rising towards ``final``."""
    out = []
    for e in range(1, epochs + 1):
        if switch is not None and e <= switch:
            out.append(1.0 + 0.2 * e)
        else:
            start = switch or 0
            out.append(final * (e - start) / (epochs - start))
    return out


# --- reading what a real sweep wrote (the Ray tests) ---------------------------------------------------
def _saved_trials(exp_dir: Path) -> list[tuple[dict, dict]]:
    """(trial, run metadata) per trial of the newest experiment_state file: what a restore reads
    (empty while none is readable)."""
    states = sorted(exp_dir.glob("experiment_state-*.json"))
    if not states:
        return []
    try:
        data = json.loads(states[-1].read_text())
    except ValueError:  # being rewritten
        return []
    return [(json.loads(t[0]), json.loads(t[1])) for t in data["trial_data"]]


def trial_statuses(exp_dir: Path) -> dict[str, str]:
    """Trial id -> Tune status, from the newest experiment_state file (empty while none is readable)."""
    return {trial["trial_id"]: trial["status"] for trial, _ in _saved_trials(exp_dir)}


def saved_checkpoint_epochs(exp_dir: Path) -> dict[str, int]:
    """Trial id -> the epoch reported with the latest checkpoint Tune's saved state holds for it (0:
    none yet): where a restore continues. Tune pickles its checkpoint manager into that state; its
    own decoder reads it back (the state of a sweep the test itself ran)."""
    from ray.tune.utils.serialization import TuneFunctionDecoder

    decode = TuneFunctionDecoder(allow_cloudpickle=True).object_hook
    out = {}
    for trial, meta in _saved_trials(exp_dir):
        manager = meta.get("checkpoint_manager")
        latest = decode(manager).latest_checkpoint_result if manager else None
        out[trial["trial_id"]] = int(latest.metrics["epoch"]) if latest else 0
    return out


def result_rows(exp_dir: Path) -> dict[str, list[int]]:
    """Trial id -> the epochs its result.json reports, in order."""
    rows = {}
    for f in exp_dir.glob("*/result.json"):  # trial dirs are named by sweep.names.trial_dirname
        lines = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        if lines:
            rows[lines[0]["trial_id"]] = [int(r["epoch"]) for r in lines]
    return rows
