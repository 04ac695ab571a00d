"""Search, then confirm: the best configuration of each group trained again over fresh seeds.

The best trial of a search is an optimistic estimate: it is the maximum of noisy values. So when a
sweep sets ``sweep.confirm: {per: KEY, top: 1, repeats: 5}`` and its search has ended:

1. :func:`select_candidates` takes, per value of KEY (e.g. per stage order), its ``top`` best
   configurations by the mean of the sweep's metric (``sweep.metric``, in its direction) over
   their trials **at the full budget** (every epoch of ``schedule.epochs``). A group none of whose
   trials ran the full budget (ASHA or BOHB stopped them all) is judged at the longest budget its
   trials reached, and the plan says so.
2. :func:`confirmation_seeds`: ``repeats`` seeds that the search never used, the same list for
   every group, so every confirmation comparison is paired on the seed.
3. Every candidate x seed is one trial of a second Tune experiment, ``EXP/confirm/``, at the full
   budget with no early stopping (``sweep.confirm``). The plan (candidates, how each was selected,
   the seeds) is written first, to ``EXP/confirm/confirm_plan.yaml``; an interrupted confirmation
   resumes from Tune's state there and reruns no finished trial.

This module is the reading side (selection, the plan, labels; files only, no Ray): the tables read
both phases, the search table (labelled as the search) and the confirmation table, whose
statistics pair on ``run.seed`` alone (each group runs its own configuration).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from raymcn.config import CONFIRM_DIR, CONFIRM_PLAN_FILE, SWEEP_CONFIG_FILE, Config, Objective
from raymcn.results.columns import SEED_KEY, STAGE_KEY, is_config_key
from raymcn.results.experiment import ExperimentError, load_experiment, sweep_objective
from raymcn.results.origins import RunOrigin, run_origins

CANDIDATE = "candidate"  # the confirmation table's group column when top > 1
DEFAULT_REPEATS = 5


@dataclass(frozen=True)
class ConfirmSettings:
    per: str
    top: int
    repeats: int

    @property
    def what(self) -> str:
        """"the best configuration" or "the best 2 configurations" (for the console and the table)."""
        return "the best configuration" if self.top == 1 else f"the best {self.top} configurations"

    @property
    def group_column(self) -> str:
        """What the confirmation table groups by: the key itself, or one candidate each when top > 1."""
        return self.per if self.top == 1 else CANDIDATE


def settings(cfg: Config, swept: list[str] | None = None) -> ConfirmSettings | None:
    """``cfg.sweep.confirm`` as settings, or None when the sweep has no confirmation phase. With
    ``swept`` (the keys of a finished search, for ``raymcn sweep --confirm``) an empty section
    means: per stage order when it was swept, the top configuration, 5 seeds."""
    c = cfg.sweep.confirm
    if not c:
        if swept is None or STAGE_KEY not in swept:
            return None
        c = {"per": STAGE_KEY}
    return ConfirmSettings(per=c["per"], top=int(c.get("top", 1)), repeats=int(c.get("repeats", DEFAULT_REPEATS)))


def confirmation_seeds(cfg: Config, repeats: int) -> list[int]:
    """``repeats`` seeds after every seed the search used (``run.seed`` .. ``run.seed + sweep.repeats
    - 1``, and any ``run.seed`` values in the space), so no confirmation run repeats a search run."""
    used = [cfg.run.seed + i for i in range(cfg.sweep.repeats)]
    spec = cfg.sweep.space.get(SEED_KEY) or {}
    for domain, values in spec.items():
        used += [int(v) for v in values] if domain in ("choice", "grid", "randint") else []
    first = max(used) + 1
    return list(range(first, first + repeats))


@dataclass(frozen=True)
class Candidate:
    """One configuration to confirm: ``label`` names it in the tables (the group value, with
    `` #2`` etc. when top > 1); ``config`` holds its swept keys without the seed; ``score`` is the
    mean of the sweep's metric over its search trials at the budget ``basis`` names."""

    label: str
    group: Any
    rank: int
    config: dict[str, Any]
    score: float
    trials: int
    basis: str


class NothingToConfirm(ValueError):
    """No group of the search has a trial with a value; the message says what the search holds."""


def select_candidates(trials: pd.DataFrame, s: ConfirmSettings, epochs: int, target: Objective) -> list[Candidate]:
    """The ``s.top`` best configurations per value of ``s.per`` (module doc, step 1), by the
    sweep's metric ``target`` in its direction.

    ``trials``: the search's table (``results.experiment.load_experiment``): ``status``,
    ``epochs``, the swept keys and ``target.column``. A configuration is the tuple of swept keys
    other than ``run.seed`` (its seed repeats are averaged). Errored trials never count.

    Raises:
        NothingToConfirm: no trial of any group has a value.
    """
    if s.per not in trials:
        raise NothingToConfirm(f"sweep.confirm.per={s.per!r} is not a column of the search's table")
    keys = [c for c in trials.columns if is_config_key(c) and c != SEED_KEY]
    column = target.column
    usable = trials[(trials["status"] != "error") & trials[column].notna()]
    out: list[Candidate] = []
    for group, part in usable.groupby(s.per, sort=False):
        full = part[part["status"] == "done"]
        if len(full):
            basis, pool = f"full budget ({epochs} epochs)", full
        else:
            reached = int(part["epochs"].max())
            basis = f"longest budget reached: {reached} of {epochs} epochs (no trial ran the full budget)"
            pool = part[part["epochs"] == reached]
        scored = pool.groupby(keys, dropna=False, sort=False)[column].agg(["mean", "size"])
        scored = scored.sort_values("mean", ascending=target.mode == "min", kind="stable").head(s.top)
        for rank, (values, row) in enumerate(scored.iterrows(), start=1):
            values = values if isinstance(values, tuple) else (values,)
            config = {k: _plain(v) for k, v in zip(keys, values) if not _missing(v)}
            label = str(group) if s.top == 1 else f"{group} #{rank}"
            out.append(Candidate(label, _plain(group), rank, config, float(row["mean"]), int(row["size"]), basis))
    if not out:
        raise NothingToConfirm(f"no trial of the search has a {column} value to select by "
                               f"({len(trials)} trials, statuses: {trials['status'].value_counts().to_dict()})")
    return sorted(out, key=lambda c: (str(c.group), c.rank))


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _plain(v: Any) -> Any:
    """numpy scalars as Python values (YAML and Tune's params.json take those)."""
    return v.item() if hasattr(v, "item") else v


def trial_configs(candidates: list[Candidate], seeds: list[int]) -> list[dict[str, Any]]:
    """Every candidate once per seed, seed by seed: an interrupted confirmation has the first seeds
    of every group, so what ran so far is already paired."""
    return [{**c.config, SEED_KEY: seed} for seed in seeds for c in candidates]


# --- the plan on disk ------------------------------------------------------------------------------
def plan_text(s: ConfirmSettings, candidates: list[Candidate], seeds: list[int]) -> str:
    """The plan as YAML (``EXP/confirm/confirm_plan.yaml``, written before the first trial)."""
    plan = {"per": s.per, "top": s.top, "repeats": s.repeats, "seeds": seeds,
            "candidates": [asdict(c) for c in candidates]}
    return yaml.safe_dump(plan, sort_keys=False, allow_unicode=True)


def read_plan(experiment_dir: str | Path) -> tuple[ConfirmSettings, list[Candidate], list[int]] | None:
    """The plan of the sweep in ``experiment_dir`` (a local folder), or None when it has none."""
    path = Path(experiment_dir) / CONFIRM_DIR / CONFIRM_PLAN_FILE
    if not path.exists():
        return None
    plan = yaml.safe_load(path.read_text())
    return (ConfirmSettings(plan["per"], int(plan["top"]), int(plan["repeats"])),
            [Candidate(**c) for c in plan["candidates"]], [int(x) for x in plan["seeds"]])


def label_trials(trials: pd.DataFrame, candidates: list[Candidate]) -> pd.DataFrame:
    """``trials`` (the confirmation's table) with a ``candidate`` column: the label of the
    candidate whose every swept key the trial carries."""
    def label(row: pd.Series) -> str | None:
        for c in candidates:
            if all(k in row and not _missing(row[k]) and _same(row[k], v) for k, v in c.config.items()):
                return c.label
        return None

    return trials.assign(**{CANDIDATE: trials.apply(label, axis=1) if len(trials) else []})


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-12)
        except (TypeError, ValueError):
            return False
    return a == b


@dataclass
class Confirmation:
    """A sweep's confirmation phase as read from disk: its plan and its trials so far (``trials``
    with the ``candidate`` column of :func:`label_trials`; empty frames before its first trial),
    and what the sweep optimizes (``objective``, the search's ``sweep.metric``)."""

    settings: ConfirmSettings
    candidates: list[Candidate]
    seeds: list[int]
    trials: pd.DataFrame
    curves: pd.DataFrame
    objective: Objective
    origins: dict[str, RunOrigin | None] = field(default_factory=dict)  # trial -> its run's (``origins``)

    @property
    def planned(self) -> int:
        return len(self.candidates) * len(self.seeds)


def load_confirmation(experiment_dir: str | Path) -> Confirmation | None:
    """The confirmation of the sweep in ``experiment_dir`` (a local folder), or None when the sweep
    has none (no plan)."""
    plan = read_plan(experiment_dir)
    if plan is None:
        return None
    s, candidates, seeds = plan
    where = Path(experiment_dir) / CONFIRM_DIR
    # its own sweep file names the metric it selected and runs by (the search's, unless `raymcn
    # sweep --confirm EXP --set sweep.metric=...` chose another); written right after the plan
    target = sweep_objective(where if (where / SWEEP_CONFIG_FILE).exists() else experiment_dir)
    try:
        trials, curves = load_experiment(where)
    except ExperimentError:  # planned, no trial started yet
        trials = pd.DataFrame(columns=["trial", "status", "epochs", s.per, SEED_KEY, target.column])
        curves = pd.DataFrame(columns=["trial", "epoch"])
    return Confirmation(s, candidates, seeds, label_trials(trials, candidates), curves, target,
                        run_origins(where, trials["trial"]))
