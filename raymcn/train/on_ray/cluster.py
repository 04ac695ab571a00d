"""The driver's Ray cluster: connect to it (or start a local one), and check what a run asks of it.

Every command that needs Ray connects the same way (:func:`ray_session`): to the given address,
else ``RAY_ADDRESS``, else the cluster this machine belongs to, else a new local instance.

Pinned to its own cluster: a local instance raymcn starts hands every one of its processes (the
driver, Tune's trial drivers, Train's controller and its placement-group cleaner, the workers, the
read tasks) the address of its own dashboard in ``RAY_API_SERVER_ADDRESS``, the variable Ray's
State API reads first. Without it, Train's cleaner, which asks the State API whether a stopped
run's controller is gone before it frees the run's CPUs, looks for "the" cluster on the machine;
with a second Ray instance there (a test suite, a colleague's run) it finds two, fails, retries
forever, and the next trial waits for CPUs that are never freed. A cluster started by ``ray
start`` is pinned the same way by its start commands (``cluster.yaml``).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import ray

from raymcn.config import Config, ConfigError

# Read by the daemons of an instance this process starts (a running cluster keeps its own); a value
# already in the environment wins. Ray keeps as many idle worker processes as a node has CPUs and
# ends the others after 1 s idle, so on a small machine every epoch's read tasks and every trial
# paid a new Python process and its imports; idle for up to a minute, they serve the next ones.
LOCAL_RAY_ENV = {"RAY_idle_worker_killing_time_threshold_ms": "60000"}
# Ray Train on an instance this process started (Train passes these on to its controller and
# workers): one machine has no other node to go on with when it is drained, so the preemption
# watcher's actor per run would only cost a process start, and with it off the ranks never ask
# about a drain (on_ray/preemption.py; a cluster's runs keep Ray's default, on); polling the
# workers every 0.5 s instead of 2 s notices a run's end (and each report) sooner.
LOCAL_TRAIN_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
API_SERVER_ENV = "RAY_API_SERVER_ADDRESS"  # Ray's State API client reads it before RAY_ADDRESS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_instance_env(dashboard_port: int) -> dict[str, str]:
    """What every process of a local instance with its dashboard on ``dashboard_port`` is given:
    its own API server address (module doc), Train's local settings and the daemons' settings."""
    return {**LOCAL_RAY_ENV, **LOCAL_TRAIN_ENV, API_SERVER_ENV: f"http://127.0.0.1:{dashboard_port}"}


@contextlib.contextmanager
def scoped_env(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` for the block (a value already set there wins), then removed."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


@contextlib.contextmanager
def ray_session(address: str | None, variables: dict[str, str] | None = None, **init_kwargs) -> Iterator[bool]:
    """Ray for one command (module doc); yields True when this call started a local instance,
    which is shut down at the end. Already connected (a test, a caller's own ``ray.init``): that
    connection, left alone.

    ``variables`` (the command's ``RAYMCN_*`` settings, ``Environment.variables``) go into the job's
    runtime environment, so every process of the command's job sees them at its start: Tune's trial
    drivers, Train's controllers and workers, the read tasks. On a cluster those processes are
    started by raylets that never saw this command's environment.

    Raises:
        ConfigError: no address was given and several Ray instances run on this machine.
    """
    if ray.is_initialized():
        yield False
        return
    variables = dict(variables or {})
    if _connect(address or os.environ.get("RAY_ADDRESS") or None,
                {**init_kwargs, **({"runtime_env": {"env_vars": variables}} if variables else {})}):
        yield False
        return
    port = free_port()
    env = local_instance_env(port)
    with scoped_env(env):  # the daemons read it at their start; this driver (Train's settings) for the block
        ray.init(address="local", dashboard_host="127.0.0.1", dashboard_port=port, include_dashboard=True,
                 log_to_driver=True, runtime_env={"env_vars": {**variables, **env}}, **init_kwargs)
        try:
            yield True
        finally:
            ray.shutdown()


def _connect(address: str | None, init_kwargs: dict) -> bool:
    """Connect to ``address``, or (None) to the cluster this machine belongs to; False when a new
    local instance is asked for ("local") or no cluster runs here."""
    if address == "local":
        return False
    try:
        ray.init(address=address or "auto", log_to_driver=True, **init_kwargs)
    except ConnectionError as e:
        if address is not None:
            raise
        if "multiple" in str(e).lower():
            raise ConfigError([f"several Ray instances run on this machine ({e}); say which one with --address "
                               "or RAY_ADDRESS (e.g. the cluster's HEAD_IP:6379), or 'local' for a new one"]) from None
        return False  # none runs here
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


def worker_resources(cfg: Config) -> dict[str, float]:
    """What one Train worker reserves: ``scale.cpus_per_worker`` CPUs, and one GPU with ``scale.use_gpu``
    (one GPU per worker: DDP, never DataParallel)."""
    return {"CPU": cfg.scale.cpus_per_worker, **({"GPU": 1} if cfg.scale.use_gpu else {})}


def placement_strategy(cfg: Config, nodes: list[dict[str, float]]) -> str:
    """``"STRICT_PACK"`` when the largest worker group ``cfg`` can ask for (``scale.num_workers``, the
    maximum of an elastic range) fits on one of ``nodes`` (each node's total resources, as
    ``ray.nodes()`` lists them), else ``"PACK"``. A trial's DDP ranks then share one server and its
    NVLink instead of being split over two servers when both have a few GPUs free; a group no node can
    hold may still spread (Ray's default, PACK)."""
    need = {k: v * cfg.scale.max_workers for k, v in worker_resources(cfg).items()}
    fits = any(all(node.get(k, 0) >= v for k, v in need.items()) for node in nodes)
    return "STRICT_PACK" if fits and cfg.scale.max_workers > 1 else "PACK"


def node_resources() -> list[dict[str, float]]:
    """Every live node's total resources (empty before ``ray.init``, where nothing can be placed yet)."""
    if not ray.is_initialized():
        return []
    return [n["Resources"] for n in ray.nodes() if n.get("Alive")]
