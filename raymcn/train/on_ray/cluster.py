"""The driver's Ray cluster: connect to it (or start a local one), and check what a run asks of it.

Every command that needs Ray connects the same way: to the given address, else ``RAY_ADDRESS``,
else the cluster this machine belongs to, else a local instance for the embedded default.
"""

from __future__ import annotations

import ray

from raymcn.config import Config


def start_ray(address: str | None) -> bool:
    """Connect to ``address`` (None: as the module doc says) or start a local instance; returns
    True if this call started Ray in this process (the caller then shuts it down)."""
    if ray.is_initialized():
        return False
    ray.init(address=address, log_to_driver=True)
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
