"""Names what a run or sweep waits for when Ray cannot place a worker group.

Ray Train asks for a trial's workers as one placement group and waits, silently, until the cluster
can hold it (``scale.worker_start_timeout_s``, then again). A group that never fits, because a
finished trial's group was never freed or another run holds the CPUs or GPUs, would leave the
console quiet for as long as the sweep lives. While a command runs, :func:`watched` looks at the
cluster's placement groups through Ray's State API and, once a group has waited for
``run.stall_timeout_s``, prints what it asks for, what is free, and which groups hold the rest.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

WAITING = ("PENDING", "RESCHEDULING")


def _since_s(pg: dict[str, Any], now_s: float) -> float | None:
    """Seconds since Ray received ``pg``'s creation request (None when its stats do not say)."""
    stats = pg.get("stats") or {}
    ns = stats.get("creation_request_received_ns") or stats.get("creationRequestReceivedNs")
    return None if not ns else now_s - int(ns) / 1e9


def _bundles(pg: dict[str, Any]) -> str:
    """``{CPU: 1} x 2`` for a group of two equal bundles (Ray's bundles: [{"bundle_id":..,
    "unit_resources": {...}}, ...])."""
    shapes = [", ".join(f"{k}: {v:g}" for k, v in sorted((b.get("unit_resources") or {}).items()))
              for b in pg.get("bundles") or []]
    if not shapes:
        return "{}"
    if len(set(shapes)) == 1:
        return f"{{{shapes[0]}}}" + (f" x {len(shapes)}" if len(shapes) > 1 else "")
    return " + ".join(f"{{{s}}}" for s in shapes)


def _name(pg: dict[str, Any]) -> str:
    label = pg.get("name") or pg["placement_group_id"][:12]
    return f"{label} (job {pg.get('creator_job_id', '?')})"


def waiting_line(pgs: list[dict[str, Any]], free: dict[str, float], total: dict[str, float],
                 now_s: float, limit_s: float, told: dict[str, float], repeat_s: float = 300.0) -> str | None:
    """One console line for the placement groups in ``pgs`` (the State API's, detailed) that have
    waited ``limit_s`` or longer; None if none has. Names what each asks for, the free and total
    resources, and the groups holding resources. ``told``: when each request (its job and bundles:
    Ray Train makes a new group for the same request after each start timeout) was last named; one
    named less than ``repeat_s`` ago is not named again."""
    late = []
    for pg in pgs:
        since, key = _since_s(pg, now_s), f"{pg.get('creator_job_id')}:{_bundles(pg)}"
        waited = pg.get("state") in WAITING and since is not None and since >= limit_s
        if waited and now_s - told.get(key, float("-inf")) >= repeat_s:
            late.append((pg, since))
            told[key] = now_s
    if not late:
        return None
    asks = "; ".join(f"{_name(pg)} asks for {_bundles(pg)}, waiting {s:.0f} s" for pg, s in late)
    res = ", ".join(f"{k} {free.get(k, 0.0):g} of {total[k]:g}" for k in sorted(total)
                    if k in ("CPU", "GPU") or k.startswith("accelerator"))
    held = [pg for pg in pgs if pg.get("state") == "CREATED"]
    holders = "; ".join(f"{_name(pg)} {_bundles(pg)}" for pg in held) or "no placement group (single actors or tasks)"
    return (f"WAITING for resources: {asks}. Free: {res}. Held by {len(held)} placement group(s): {holders}. "
            "A group of a finished trial that is still held, or another run on the cluster, keeps this one "
            "waiting; `ray status` shows the same.")


def _look(limit_s: float, told: dict[str, float]) -> str | None:
    import ray
    from ray.util.state import list_placement_groups

    pgs = [pg if isinstance(pg, dict) else pg.__dict__
           for pg in list_placement_groups(detail=True, limit=1000, raise_on_missing_output=False)]
    return waiting_line(pgs, ray.available_resources(), ray.cluster_resources(), time.time(), limit_s, told)


def limit_s(stall_timeout_s: float, worker_start_timeout_s: float) -> float:
    """How long a group may wait before it is named: the stall limit, but at most half the group's
    start timeout (after which Ray Train asks again with a new group, whose wait starts at 0)."""
    return min(stall_timeout_s, worker_start_timeout_s / 2)


@contextlib.contextmanager
def watched(limit_s: float, say: Callable[[str], None], every_s: float | None = None) -> Iterator[None]:
    """While the block runs (Ray connected), checks every ``every_s`` (default: a quarter of
    ``limit_s``, at most 15 s) for placement groups waiting ``limit_s`` or longer and ``say``s
    a line naming them (:func:`waiting_line`). The State API failing (no dashboard) silences the watch, not the run."""
    stop = threading.Event()
    every_s = every_s or min(15.0, limit_s / 4)

    def watch() -> None:
        told: dict[str, float] = {}
        while not stop.wait(every_s):
            try:
                line = _look(limit_s, told)
            except Exception:  # noqa: BLE001, S112 - a watch that cannot look stays quiet
                continue
            if line:
                say(line)

    thread = threading.Thread(target=watch, name="raymcn-resource-waits", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
