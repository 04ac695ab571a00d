"""What a rehearsed sweep went through, judged from its folder alone (no Ray): the checks of
``raymcn doctor --rehearse`` and of the suite's rehearsals of the shipped files.

Read: the search's and the confirmation's trial folders (``results.experiment``), the scheduler's
decisions (``EXP/raymcn_decisions.jsonl``, written by ``sweep.tuner.DecisionLog``) and every
trial's ``result.json`` rows in the order Tune wrote them (a restarted trial's rows follow its
earlier ones).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raymcn.config import CONFIRM_DIR, DECISIONS_FILE, Config
from raymcn.results.confirmation import read_plan
from raymcn.results.experiment import load_experiment, read_result_rows, trial_dirs
from raymcn.results.summary import sweep_summary


@dataclass(frozen=True)
class Check:
    """One line of the verdict: ``ok`` None where the check does not apply to the sweep."""

    name: str
    ok: bool | None
    detail: str


def reported_epochs(exp_dir: Path) -> dict[str, list[int]]:
    """Trial id -> the epochs it reported (``results.experiment.read_result_rows``)."""
    out: dict[str, list[int]] = {}
    for d in trial_dirs(exp_dir):
        rows = [r for r in read_result_rows(d) if "epoch" in r and r.get("trial_id")]
        if rows:
            out[str(rows[0]["trial_id"])] = [int(r["epoch"]) for r in rows]
    return out


def decisions(exp_dir: Path) -> list[dict[str, Any]]:
    """What the sweep's early-stopping scheduler decided after stage 1, in order (``sweep.tuner.DecisionLog``)."""
    path = Path(exp_dir) / DECISIONS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def rehearsal_checks(exp_dir: str | Path, cfg: Config, search_trials: int,
                     killed: dict[str, int] | None = None) -> list[Check]:
    """The verdict on the rehearsed sweep in ``exp_dir`` of config ``cfg`` (its miniature).

    Args:
        search_trials: the trials the search should have run (``sweep.tuner.search_trials``); the
            confirmation's runs are those its plan lists (one group per value the search tried).
        killed: trial id -> the epochs it had reported when its driver was killed, for each
            trial the rehearsal killed.
    """
    exp_dir = Path(exp_dir)
    trials, _ = load_experiment(exp_dir)
    epochs = reported_epochs(exp_dir)
    checks = [_search_check(trials, search_trials), *_scheduler_checks(cfg, decisions(exp_dir), epochs)]
    if killed:
        checks.append(_killed_check(killed, epochs, trials))
    if cfg.sweep.confirm:
        checks.append(_confirmation_check(exp_dir))
    summary = sweep_summary(exp_dir)
    answer = next((line for line in summary.splitlines() if line.startswith("Answer: ")), "")
    checks.append(Check("answer line", bool(answer) or not cfg.sweep.confirm,
                        answer[:120] or ("no confirmation asked for: the search's table ends the sweep"
                                         if not cfg.sweep.confirm else "the end of the sweep printed no answer")))
    return checks


def _search_check(trials, expected: int) -> Check:
    counts = trials["status"].value_counts().to_dict()
    ok = len(trials) == expected and not counts.get("running") and not counts.get("error")
    return Check("search: every trial ended", ok, f"{len(trials)} of {expected} trials: " + ", ".join(
        f"{n} {status}" for status, n in sorted(counts.items())))


def _scheduler_checks(cfg: Config, logged: list[dict[str, Any]], epochs: dict[str, list[int]]) -> list[Check]:
    """The rungs were judged after stage 1 only, and (BOHB) a paused trial resumed at its next epoch."""
    sw = cfg.sweep
    if sw.algorithm not in ("asha", "bohb"):
        return [Check("early stopping at the rungs", None, f"{sw.algorithm}: no early stopping")]
    first = min(sw.grace_epochs, cfg.budget_epochs)
    at_first = {d["trial"] for d in logged if d["budget_epoch"] == first}
    ended = [d for d in logged if d["decision"] != "CONTINUE"]
    offset = cfg.stage1_epochs
    misplaced = [d for d in ended if d["budget_epoch"] < first or d["epoch"] != offset + d["budget_epoch"]]
    counts = {k: sum(d["decision"] == k for d in ended) for k in ("PAUSE", "STOP")}
    checks = [Check("early stopping at the rungs", len(at_first) >= 2 and not misplaced,
                    f"{len(at_first)} trials judged at the first rung (epoch {offset + first}); "
                    f"{counts['PAUSE']} paused, {counts['STOP']} stopped"
                    + (f"; {len(misplaced)} decisions off a rung: {misplaced[:2]}" if misplaced else ""))]
    if sw.algorithm == "bohb":
        paused = [d for d in ended if d["decision"] == "PAUSE"]
        resumed = [d for d in paused if _continued(epochs.get(d["trial"], []), d["epoch"])]
        checks.append(Check("BOHB: a paused trial resumed at its next epoch", bool(resumed),
                            f"{len(paused)} paused, {len(resumed)} resumed from their checkpoint"
                            + (f" (trial {resumed[0]['trial']} after epoch {resumed[0]['epoch']})" if resumed else "")))
    return checks


def _continued(reported: list[int], after: int) -> bool:
    """The trial reported ``after`` and then ``after + 1``: resumed after its pause."""
    return after in reported and after + 1 in reported


def _killed_check(killed: dict[str, int], epochs: dict[str, list[int]], trials) -> Check:
    """Each killed trial ended, with every epoch up to its last reported (its Train run resumed
    from its checkpoint: ``results.experiment`` fills from the run's metrics.csv what its dead
    driver never passed on)."""
    status = dict(zip(trials["trial"], trials["status"]))
    bad = {t for t in killed if status.get(t) not in ("done", "stopped")
           or sorted(set(epochs.get(t, []))) != list(range(1, max(epochs.get(t, [0])) + 1))}
    detail = "; ".join(f"trial {t} killed after epoch {n}, then ended at epoch {max(epochs.get(t, [0]))} "
                       f"({status.get(t, 'no status')})" for t, n in killed.items())
    return Check("a killed trial driver resumed", not bad, detail)


def _confirmation_check(exp_dir: Path) -> Check:
    plan = read_plan(exp_dir)
    if plan is None or not (exp_dir / CONFIRM_DIR).is_dir():
        return Check("confirmation: every run ended", False, f"{exp_dir / CONFIRM_DIR} holds no confirmation plan")
    _, candidates, seeds = plan
    runs, _ = load_experiment(exp_dir / CONFIRM_DIR)
    expected, done = len(candidates) * len(seeds), int((runs["status"] == "done").sum())
    return Check("confirmation: every run ended", done == expected == len(runs),
                 f"{done} of {expected} runs trained the full budget ({len(candidates)} groups x {len(seeds)} seeds)")
