"""Names what a run or sweep waits for when Ray cannot place a worker group.

Ray Train asks for a trial's workers as one placement group and waits, silently, until the cluster
can hold it (``scale.worker_start_timeout_s``, then again). A group that never fits, because a
finished trial's group was never freed or another run holds the CPUs or GPUs, would leave the
console quiet for as long as the sweep lives. While a command runs, :func:`watched` looks at the
cluster's placement groups through Ray's State API and, once a group has waited for
``run.stall_timeout_s``, prints what it asks for, what is free, and which groups hold the rest.
Groups that jobs which have ended left holding resources are freed then, and named.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from raymcn.config import reason

WAITING = ("PENDING", "RESCHEDULING")


def _since_s(pg: dict[str, Any], now_s: float) -> float | None:
    """Seconds since Ray received ``pg``'s creation request (None when its stats do not say)."""
    stats = pg.get("stats") or {}
    ns = stats.get("creation_request_received_ns") or stats.get("creationRequestReceivedNs")
    return None if not ns else now_s - int(ns) / 1e9


def _waited(pg: dict[str, Any], now_s: float, limit_s: float) -> bool:
    """``pg`` is still waiting for its resources and has waited ``limit_s`` or longer."""
    since = _since_s(pg, now_s)
    return pg.get("state") in WAITING and since is not None and since >= limit_s


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
        key = f"{pg.get('creator_job_id')}:{_bundles(pg)}"
        if _waited(pg, now_s, limit_s) and now_s - told.get(key, float("-inf")) >= repeat_s:
            late.append((pg, _since_s(pg, now_s)))
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


ENDED = ("SUCCEEDED", "FAILED", "STOPPED")  # a job whose driver is gone (the State API's job status)


def left_behind(pgs: list[dict[str, Any]], ended_jobs: set[str]) -> list[dict[str, Any]]:
    """The placement groups in ``pgs`` that still hold resources although the job that made them has
    ended: not detached, created by a job in ``ended_jobs``. Ray frees them when the job's actors
    die; measured on a cluster (the launcher tier), a group of a sweep whose driver was SIGKILLed
    stayed held for good, its Ray Train placement-group cleaner alive but idle, and the resumed
    sweep waited forever for its CPUs."""
    return [pg for pg in pgs if pg.get("state") == "CREATED" and not pg.get("is_detached")
            and pg.get("creator_job_id") in ended_jobs]


def _look(limit_s: float, told: dict[str, float]) -> list[str]:
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group
    from ray.util.state import list_jobs, list_placement_groups

    def groups() -> list[dict[str, Any]]:
        return [pg if isinstance(pg, dict) else pg.__dict__
                for pg in list_placement_groups(detail=True, limit=1000, raise_on_missing_output=False)]

    pgs, now, lines = groups(), time.time(), []
    if any(_waited(pg, now, limit_s) for pg in pgs):
        ended = {j.job_id for j in list_jobs(limit=1000, raise_on_missing_output=False)
                 if getattr(j.status, "value", j.status) in ENDED}
        stale = left_behind(pgs, ended)
        for pg in stale:  # what Ray should have freed when their job ended: freed, so the waiting group fits
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg["placement_group_id"]))))
        if stale:
            lines.append(f"FREED {len(stale)} placement group(s) left by ended jobs: "
                         + "; ".join(f"{_name(pg)} {_bundles(pg)}" for pg in stale))
            pgs = groups()
    line = waiting_line(pgs, ray.available_resources(), ray.cluster_resources(), now, limit_s, told)
    return [*lines, *([line] if line else [])]


def naming_limit_s(stall_timeout_s: float, worker_start_timeout_s: float) -> float:
    """How long a group may wait before it is named: the stall limit, but at most half the group's
    start timeout (after which Ray Train asks again with a new group, whose wait starts at 0)."""
    return min(stall_timeout_s, worker_start_timeout_s / 2)


@contextlib.contextmanager
def watched(limit_s: float, say: Callable[[str], None], every_s: float | None = None) -> Iterator[None]:
    """While the block runs (Ray connected), checks every ``every_s`` (default: a quarter of
    ``limit_s``, at most 15 s) for placement groups waiting ``limit_s`` or longer: frees the groups
    ended jobs left behind (:func:`left_behind`) and ``say``s a line naming them, and one naming
    what still waits (:func:`waiting_line`). A look that fails (the State API down: no dashboard)
    is said once, with its error, and the watch goes on looking; the run never depends on it."""
    stop = threading.Event()
    every_s = every_s or min(15.0, limit_s / 4)

    def watch() -> None:
        told: dict[str, float] = {}
        failing = ""  # the failed look already said (said again only when the failure changes)
        while not stop.wait(every_s):
            try:
                lines = _look(limit_s, told)
            except Exception as e:  # noqa: BLE001 - said, not raised: the run goes on without the watch
                if reason(e) != failing:
                    failing = reason(e)
                    say(f"note: cannot look at what Ray waits to place ({failing}); a worker group that Ray "
                        "cannot place will not be named until the look works again")
                continue
            failing = ""
            for line in lines:
                say(line)

    thread = threading.Thread(target=watch, name="raymcn-resource-waits", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
