"""The driver's Ray cluster: connect to it (or start a local one), and check what a run asks of it.

Every command that needs Ray connects the same way: to the given address, else ``RAY_ADDRESS``,
else the cluster this machine belongs to, else a local instance for the embedded default.
"""

from __future__ import annotations

import os

import ray

from raymcn.config import Config


# Read by the daemons of an instance this process starts (a running cluster keeps its own); a value
# already in the environment wins. Ray keeps as many idle worker processes as a node has CPUs and
# ends the others after 1 s idle, so on a small machine every epoch's read tasks and every trial
# paid a new Python process and its imports; idle for up to a minute, they serve the next ones.
LOCAL_RAY_ENV = {"RAY_idle_worker_killing_time_threshold_ms": "60000"}
# Ray Train on an instance this process started (Train passes these on to its controller): one
# machine is never preempted, so the preemption watcher's actor per run only costs a process start;
# polling the workers every 0.5 s instead of 2 s notices a run's end (and each report) sooner.
LOCAL_TRAIN_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}


def start_ray(address: str | None) -> bool:
    """Connect to ``address`` (None: as the module doc says) or start a local instance; returns
    True if this call started Ray in this process (the caller then shuts it down)."""
    if ray.is_initialized():
        return False
    added = {k: v for k, v in LOCAL_RAY_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        ray.init(address=address, log_to_driver=True)
    finally:  # the new instance's daemons have read them; a later one in this process decides anew
        for key in added:
            del os.environ[key]
    if getattr(ray._private.worker._global_node, "head", False):  # started here, not connected to
        for key, value in LOCAL_TRAIN_ENV.items():
            os.environ.setdefault(key, value)
    return True


def cluster_problems(cfg: Config, concurrent_runs: int = 1) -> list[str]:
    """The preflight's last check, right after ``ray.init``: the request against
    ``ray.cluster_resources()`` (Ray would otherwise wait forever for what is not there)."""
    have = ray.cluster_resources()
    # an elastic group must be able to start with its minimum (it grows when more is free)
    workers = max(1, cfg.scale.min_workers) * concurrent_runs
    need_cpu = cfg.scale.cpus_per_worker * workers
    problems = []
    if cfg.scale.max_workers and need_cpu + 0.05 > have.get("CPU", 0):
        problems.append(f"scale.num_workers={cfg.scale.workers_text} x scale.cpus_per_worker="
                        f"{cfg.scale.cpus_per_worker} x {concurrent_runs} concurrent run(s) reserves {need_cpu:g} CPUs "
                        f"and Ray Data needs some left; the cluster has {have.get('CPU', 0):g} (Ray would wait "
                        "forever): lower scale.cpus_per_worker or scale.num_workers")
    if cfg.scale.use_gpu and workers > have.get("GPU", 0):
        problems.append(f"scale.use_gpu=true with scale.num_workers={cfg.scale.workers_text} needs {workers} GPUs; "
                        f"the cluster has {have.get('GPU', 0):g}")
    return problems
