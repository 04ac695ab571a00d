"""The record file of a run or sweep folder (``RECORD_FILE``): one JSON object a line, an *entry*.

A driver entry is written where a run or sweep starts (``start``), each time it is resumed
(``resume``) and when a finished search is confirmed (``confirm``): the command, the code, the
environment, the host, the data and the seeds (``train/run_record.py`` builds it). A ``nodes`` entry
is written by a run's rank 0 after its worker group started: every node that runs a rank, with its
ranks. Entries are only ever added; each write replaces the whole file at once
(``storage.replace_text``), so a reader sees the old file or the new one, never part of a line.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from raymcn import storage
from raymcn.config import RECORD_FILE

DRIVER_KINDS = ("start", "resume", "confirm")
NODES = "nodes"
# what describes a node's ranks, besides the host: folded into one node when equal
NODE_KEYS = ("host", "cpu", "cpus", "gpus", "gpu_driver", "python", "torch", "cuda", "ray", "numpy", "source_digest")


def path_of(folder: str) -> str:
    return storage.join(folder, RECORD_FILE)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def read(folder: str) -> list[dict[str, Any]]:
    """The entries of ``folder``'s record, oldest first ([] without one)."""
    return parse(_text(folder))


def _text(folder: str) -> str:
    try:
        return storage.read_text(path_of(folder))
    except FileNotFoundError:
        return ""


def parse(text: str) -> list[dict[str, Any]]:
    """The entries of a record's text (a line that is not a JSON object, which raymcn never writes, skipped)."""
    entries = []
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


def append(folder: str, entry: dict[str, Any], kind: str | None = None) -> dict[str, Any]:
    """``entry`` added to ``folder``'s record, stamped with its ``entry`` kind (``kind``; by default
    ``start`` for the first driver entry, ``resume`` after one) and ``time``; returns it as written."""
    before = _text(folder)
    if kind is None:
        kind = "resume" if drivers(parse(before)) else "start"
    written = {"entry": kind, "time": now(), **{k: v for k, v in entry.items() if k not in ("entry", "time")}}
    if before and not before.endswith("\n"):
        before += "\n"
    storage.replace_text(path_of(folder), before + json.dumps(written, default=str) + "\n")
    return written


def drivers(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The driver entries (a start, resumes, a confirmation), oldest first."""
    return [e for e in entries if e.get("entry") in DRIVER_KINDS]


def nodes_since_driver(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The nodes of the newest ``nodes`` entry written after the newest driver entry ([] when none)."""
    for entry in reversed(entries):
        if entry.get("entry") in DRIVER_KINDS:
            return []
        if entry.get("entry") == NODES:
            return list(entry.get("nodes", []))
    return []


def all_nodes(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every node any worker group of the record ran on, in the order first seen."""
    return [n for e in entries if e.get("entry") == NODES for n in e.get("nodes", [])]


def fold_ranks(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's part (``rank``, ``device`` and :data:`NODE_KEYS`) as nodes: the ranks whose parts
    agree in :data:`NODE_KEYS` form one node, with their ``ranks`` and ``devices`` in rank order."""
    nodes: dict[str, dict[str, Any]] = {}
    for part in sorted(parts, key=lambda p: p["rank"]):
        same = {k: part.get(k) for k in NODE_KEYS}
        node = nodes.setdefault(json.dumps(same, sort_keys=True, default=str), {**same, "ranks": [], "devices": []})
        node["ranks"].append(part["rank"])
        node["devices"].append(part.get("device", ""))
    return list(nodes.values())
