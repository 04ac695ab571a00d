"""What differs between two entries of a record, or between the nodes of one run, said as people read it:
``facet: old -> new``."""

from __future__ import annotations

from typing import Any

from raymcn.provenance.describe import NODE_FACETS, facets, node_facets, package_changes
from raymcn.provenance.record import drivers


def compare(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(facet, old value, new value) of every facet of two driver entries that differs (the code,
    the environment, the host, the data, the seeds), then the other packages in one line."""
    a, b = facets(old), facets(new)
    out = [(k, a.get(k, "none"), b.get(k, "none")) for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
    packages = package_changes((old.get("environment") or {}).get("packages") or {},
                               (new.get("environment") or {}).get("packages") or {})
    if packages:
        out.append(("other packages", "", packages))
    return out


def _said(changes: list[tuple[str, str, str]]) -> list[str]:
    return [f"  {k}: {new}" if not old else f"  {k}: {old} -> {new}" for k, old, new in changes]


def resume_notes(entries: list[dict[str, Any]], new: dict[str, Any], what: str, where: str) -> list[str]:
    """The lines a resumed ``what`` (a run, a sweep) prints first when ``new`` (its driver entry now)
    differs from the record's first driver entry or its latest: each facet with both values, and
    where the record keeps both. [] for a first start, or a resume on the same code, environment,
    host, data and seeds."""
    found = drivers(entries)
    if not found:
        return []
    first, latest = found[0], found[-1]
    since_start = compare(first, new)
    since_latest = compare(latest, new) if latest is not first else []
    if not since_start and not since_latest:
        return []
    lines = [f"note: this {what} continues with other code, environment or data than it had; its record keeps "
             f"both ({where}):"]
    if since_start:
        lines += [f"since its start ({first.get('time', '?')}):", *_said(since_start)]
    if since_latest and since_latest != since_start:
        lines += [f"since it was last resumed ({latest.get('time', '?')}):", *_said(since_latest)]
    return lines


def node_disagreements(driver: dict[str, Any] | None, nodes: list[dict[str, Any]]) -> list[str]:
    """For every facet the nodes of one run must share (:data:`NODE_FACETS`: raymcn's sources, Python,
    torch, its CUDA build, Ray), the values it takes when they differ, each with where: the driver
    (``driver``'s entry, which carries the commit) and every node by its host and ranks."""
    parts = []
    if driver is not None:
        seen = facets(driver)
        parts.append((f"the driver on {seen['host']}", {k: seen[k] for k in NODE_FACETS}))
    for node in nodes:
        ranks = node.get("ranks") or []
        parts.append((f"{node.get('host')} (rank{'s' if len(ranks) > 1 else ''} "
                      f"{', '.join(map(str, ranks))})", node_facets(node)))
    lines = []
    for key in NODE_FACETS:
        where: dict[str, list[str]] = {}
        for label, values in parts:
            where.setdefault(values[key], []).append(label)
        if len(where) > 1:
            lines.append(f"  {key}: " + "; ".join(f"{value} on {', '.join(labels)}" for value, labels in where.items()))
    return lines
