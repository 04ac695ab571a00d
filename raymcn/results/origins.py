"""Where a sweep's numbers come from: every run's record (``raymcn.provenance``), read as files.

Each trial's Train run keeps its record in ``EXP/train/train-<trial id>/`` (a confirmation's in
``EXP/confirm/train/...``): the code (commit, uncommitted changes, sources), the environment, the
nodes and the data each run had, over all its resumes. The tables name them once when every run
agrees (:func:`made_by`), and where the runs one comparison rests on differ in code, data or
environment, the answer says so beside its statistics (:func:`confound`): such a difference is a
confound the comparison cannot separate from the effect it measures.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from raymcn.config import RECORD_FILE
from raymcn.provenance.describe import code_label, data_label, environment_label, host_label
from raymcn.provenance.record import all_nodes, drivers, read

NOT_RECORDED = "not recorded"
FACETS = ("code", "environment", "data")  # what every run of a comparison must share
# how each line of :func:`made_by` starts (a wrapped one continues indented)
LINE_STARTS = (*(f"{facet}:" for facet in FACETS), "hosts:", ", ".join(FACETS) + ":")


@dataclass(frozen=True)
class RunOrigin:
    """One run's code, environment and data as labels (joined by `` then `` where a resume changed
    one), and the hosts its ranks ran on."""

    code: str
    environment: str
    data: str
    hosts: tuple[str, ...]


def run_origin(entries: list[dict]) -> RunOrigin | None:
    """A run's origin from its record's entries; None without a driver entry."""
    found = drivers(entries)
    if not found:
        return None

    def joined(labels: Iterable[str]) -> str:
        return " then ".join(dict.fromkeys(labels))

    code = joined(code_label(e.get("code") or {}) for e in found)
    nodes = all_nodes(entries)
    sources = {str(n.get("source_digest", ""))[:12] for n in nodes} | {
        str((e.get("code") or {}).get("source_digest", ""))[:12] for e in found}
    if len(sources) > 1:
        code += f" (its driver and nodes ran {len(sources)} different sources: {', '.join(sorted(sources))})"
    hosts = [host_label(str(n.get("host")), n.get("gpus") or [], n.get("gpu_driver")) for n in nodes] or [
        host_label(str((e.get("host") or {}).get("name")), (e.get("host") or {}).get("gpus") or [],
                   (e.get("host") or {}).get("gpu_driver")) for e in found]
    return RunOrigin(code, joined(environment_label(e.get("environment") or {}) for e in found),
                     joined(data_label(e.get("data") or {}) for e in found), tuple(dict.fromkeys(hosts)))


def run_origins(experiment_dir: str | Path, trial_ids: Iterable[str]) -> dict[str, RunOrigin | None]:
    """Trial id -> the origin of its Train run in ``experiment_dir`` (a local folder; None where the
    run kept no record: a run from before raymcn kept one, or one that never started)."""
    where = Path(experiment_dir) / "train"
    return {str(t): run_origin(read(str(where / f"train-{t}"))) for t in trial_ids}


def _counted(values: Mapping[str, int]) -> str:
    return ", ".join(f"{group} {n}" for group, n in values.items())


def _spread(origins: Mapping[str, RunOrigin | None], groups: Mapping[str, str], facet: str) -> dict[str, dict[str, int]]:
    """facet value -> {group: runs}, over the runs of ``origins`` (a run without a record: not recorded)."""
    spread: dict[str, dict[str, int]] = {}
    for trial, origin in origins.items():
        value = getattr(origin, facet) if origin is not None else NOT_RECORDED
        per_group = spread.setdefault(value, {})
        per_group[groups.get(trial, "")] = per_group.get(groups.get(trial, ""), 0) + 1
    return spread


def made_by(phases: Mapping[str, Mapping[str, RunOrigin | None]]) -> list[str]:
    """The lines that say once what made a sweep's numbers: per facet (code, environment, data) its
    value when every run of every phase (``phases``: phase -> trial -> origin) agrees, else each value
    with how many runs of each phase had it; then the hosts. Wrapped at 100 characters."""
    origins = {f"{phase}\0{t}": o for phase, runs in phases.items() for t, o in runs.items()}
    if not origins:
        return []
    if all(o is None for o in origins.values()):
        return [f"code, environment, data: {NOT_RECORDED} (the runs kept no {RECORD_FILE})"]
    groups = {key: key.split("\0")[0] for key in origins}
    lines = []
    for facet in FACETS:
        spread = _spread(origins, groups, facet)
        if len(spread) == 1:
            lines.append(f"{facet}: {next(iter(spread))}")
        else:
            lines.append(f"{facet}: {len(spread)} among the runs: " + "; ".join(
                f"{value} ({_counted(per)} runs)" for value, per in spread.items()))
    hosts = dict.fromkeys(h for o in origins.values() if o is not None for h in o.hosts)
    lines.append(f"hosts: {', '.join(hosts)}")
    return [w for line in lines for w in textwrap.wrap(line, 100, subsequent_indent="  ", break_long_words=False,
                                                        break_on_hyphens=False)]


def confound(origins: Mapping[str, RunOrigin | None], groups: Mapping[str, str]) -> str:
    """What the runs one comparison rests on (``origins``, each run's group in ``groups``) differ in,
    with which groups' runs had which: "" when they agree in code, environment and data."""
    said = []
    for facet in FACETS:
        spread = _spread(origins, groups, facet)
        if len(spread) > 1:
            said.append(f"{len(spread)} {'codes' if facet == 'code' else facet + 's'} (" + "; ".join(
                f"{value}: {_counted(per)}" for value, per in spread.items()) + ")")
    if not said:
        return ""
    return ("Caution: the runs compared ran on " + " and ".join(said) + "; a difference in code or data is a "
            "confound the statistics cannot separate from the groups' effect.")
