"""The driver's Ray cluster: connect to it (or start a local one), and check what a run asks of it.

Every command that needs Ray connects the same way (:func:`ray_session`). A run on a shared machine
is its own: it joins a running Ray instance only when told to, by ``--address`` or ``RAY_ADDRESS``
(``HOST:PORT``; ``auto``: the Ray instance running on this machine, of several the one ``ray
start`` last recorded, which is how a cluster's servers are told: ``cluster.yaml`` writes
``RAY_ADDRESS=auto`` into their ``~/.raymcn_env``); ``local`` or neither starts a new local
instance, which this command alone uses and stops at its end. Instances of other people (a
colleague's run, a test suite, a hung leftover) are never joined, and never stopped: no advice
says ``ray stop``, which stops every Ray instance of the account.

Never silent at the connection, and never without an end. The console first says which instance
and why, or that a new local instance starts and why. Ray's own connect retries for over ten
minutes against a GCS that does not answer (a leftover of a stopped cluster, a hung head), and a
driver whose raylet does not answer is ended by Ray after 30 s, both saying so only in Ray's log.
So the instance's GCS, then its raylet on this machine, must first complete a gRPC handshake (with
the cluster's TLS settings where ``RAY_USE_TLS`` is on), each within :data:`CONNECT_LIMIT_S`; then
``ray.init`` within :data:`CONNECT_LIMIT_S`, or a local instance's start within
:data:`LOCAL_START_LIMIT_S` (:func:`bounded`). Every wait that has lasted
:data:`CONNECT_NAMED_AFTER_S` is named on the console with what to do. Every such end, and Ray
failing to start or connect, is :class:`RayUnavailable`, never a run's failure.

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
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import ray

from raymcn.config import Config, ConfigError, RayUnavailable, reason

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
CONNECT_NAMED_AFTER_S = 30.0  # a wait of the connection this long is named on the console, with what to do
CONNECT_LIMIT_S = 60.0  # the GCS's, then the raylet's handshake, then ray.init: each ends after this long
# A new local instance's start ends after this long: it takes seconds, and Ray's own waits inside it
# (its GCS, its raylet) are shorter, so only a start that hangs reaches it.
LOCAL_START_LIMIT_S = 120.0
# What a user can do when the instance chosen does not answer: never `ray stop` (it stops every Ray
# instance of the account, a colleague's run included, and the instance may not be the user's at all).
ADVICE = ("see `ray status` and Ray's logs on that instance's head (stop nothing that may not be yours); for a run "
          "of its own on this machine, pass --address local or give neither --address nor RAY_ADDRESS; for another "
          "cluster, pass --address HOST:PORT")
OWN_INSTANCE = "local"  # --address / RAY_ADDRESS: a new local instance, this command's alone
THIS_MACHINES = "auto"  # --address / RAY_ADDRESS: the Ray instance running on this machine (a cluster's server)
TLS_FILES = ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")  # Ray's TLS settings, as Ray reads them


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
def ray_session(address: str | None, variables: dict[str, str] | None = None, say: Callable[[str], None] = print,
                **init_kwargs) -> Iterator[bool]:
    """Ray for one command (module doc); yields True when this call started a local instance,
    which is shut down at the end. Already connected (a test, a caller's own ``ray.init``): that
    connection, left alone.

    ``variables`` (the command's ``RAYMCN_*`` settings, ``Environment.variables``) go into the job's
    runtime environment, so every process of the command's job sees them at its start: Tune's trial
    drivers, Train's controllers and workers, the read tasks. On a cluster those processes are
    started by raylets that never saw this command's environment. ``say``: the console's lines.

    Raises:
        ConfigError: ``auto`` (given or from ``RAY_ADDRESS``) and several Ray instances run on this
            machine, none of them the one ``ray start`` last recorded.
        RayUnavailable: ``auto`` and none runs here; the instance chosen did not answer, or Ray did not
            start or connect, within the module's limits (its error named).
    """
    if ray.is_initialized():
        yield False
        return
    variables = dict(variables or {})
    target, why = chosen_instance(address)
    if target is not None:
        env = {"runtime_env": {"env_vars": variables}} if variables else {}
        with connected(target, why, say, **env, **init_kwargs):
            yield False
        return
    port = free_port()
    env = local_instance_env(port)
    say(f"Ray: starting a new local instance ({why}); it stops when this command ends")
    with scoped_env(env):  # the daemons read it at their start; this driver (Train's settings) for the block
        try:
            with bounded(f"the start of a local Ray instance ({why})", LOCAL_START_LIMIT_S, say,
                         advice="Ray's own logs are in /tmp/ray/session_latest/logs"):
                ray.init(address="local", dashboard_host="127.0.0.1", dashboard_port=port, include_dashboard=True,
                         log_to_driver=True, runtime_env={"env_vars": {**variables, **env}}, **init_kwargs)
        except RayUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to start: the command cannot run
            raise RayUnavailable(f"a local Ray instance did not start ({why}): {reason(e)}") from e
        try:
            yield True
        finally:
            ray.shutdown()


@contextlib.contextmanager
def connected(target: str, why: str, say: Callable[[str], None] = print, advice: str = ADVICE,
              **init_kwargs) -> Iterator[None]:
    """Connected to the Ray instance whose GCS is at ``target`` (chosen for the reason ``why``) for
    the block, then disconnected: the address and why on the console first, the GCS's handshake
    (:func:`wait_for_gcs`), the handshake of the instance's raylet on this machine (where it has
    one: with the raylet stopped, Ray's connection would end this process after 30 s, saying so only
    in its log), then ``ray.init``, each within the module's limits. Every command that
    joins a running instance comes here, ``raymcn drain`` and ``raymcn boot`` among them
    (``init_kwargs`` go to ``ray.init``; ``advice``: what the user can do, in the error and the named
    wait).

    Raises:
        RayUnavailable: no answer, or Ray's own connection failed or did not end in time.
    """
    say(f"Ray: connecting to the instance at {target} ({why})")
    wait_for_gcs(target, why, say, advice=advice)
    for pid, addresses in local_raylets(target).items():  # a driver attaches to it; Ray ends it unnamed
        if addresses:
            wait_for_answer(addresses, f"this machine's raylet (pid {pid}) of the instance at {target}",
                            f"this machine's raylet (pid {pid}) of the Ray instance at {target} ({why})", say,
                            advice=advice)
    kwargs = {"log_to_driver": True, **init_kwargs}
    try:
        with bounded(f"Ray's connection to {target} ({why})", CONNECT_LIMIT_S, say, advice=advice):
            ray.init(address=target, **kwargs)
    except RayUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to connect: the command cannot run
        raise RayUnavailable(f"Ray could not connect to {target} ({why}): {reason(e)}; {advice}") from e
    try:
        yield
    finally:
        ray.shutdown()


class _OutOfTime(BaseException):
    """Raised into the main thread by :func:`bounded`'s alarm. A BaseException, so that an ``except
    Exception`` around one of Ray's waits does not swallow it."""


@contextlib.contextmanager
def bounded(what: str, limit_s: float, say: Callable[[str], None], advice: str = ADVICE,
            named_after_s: float | None = None) -> Iterator[None]:
    """A start or connection of Ray (the block), named on the console after ``named_after_s`` and
    ended after ``limit_s``: an alarm (``SIGALRM``) interrupts it, ``ray.shutdown`` stops or leaves
    whatever it had started or joined, and :class:`RayUnavailable` names what and how long.

    ``ray.init`` takes no deadline and a thread cannot be stopped, so the end comes from a signal:
    only in the main thread, and only where no other alarm handler is set (a test runner's timeout);
    elsewhere the block is named, and bounded by Ray's own waits alone. The alarm takes effect when
    Ray's wait returns to Python, which its waits do (they poll). ``named_after_s``: default
    :data:`CONNECT_NAMED_AFTER_S`."""
    named_after_s = CONNECT_NAMED_AFTER_S if named_after_s is None else named_after_s
    timer = threading.Timer(named_after_s, lambda: say(f"Ray: {what} has taken {named_after_s:g} s so far; {advice}."
                                                       f" Giving up at {limit_s:g} s."))
    timer.daemon = True
    alarm = (threading.current_thread() is threading.main_thread()
             and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None))
    if alarm:
        def out_of_time(signum, frame):
            raise _OutOfTime

        signal.signal(signal.SIGALRM, out_of_time)
        signal.setitimer(signal.ITIMER_REAL, limit_s)
    timer.start()
    try:
        yield
    except _OutOfTime:
        with contextlib.suppress(Exception):  # whatever it had started or joined goes; the error says why
            ray.shutdown()
        raise RayUnavailable(f"{what} did not end within {limit_s:g} s; {advice}") from None
    finally:
        timer.cancel()
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)


def chosen_instance(address: str | None) -> tuple[str | None, str]:
    """The GCS address (host:port) a command connects to, or None for a new local instance of its
    own, and why, by the rule of the module doc: ``address`` (``--address``), else ``RAY_ADDRESS``;
    ``auto`` is :func:`instance_on_this_machine`; neither, or ``local``, a new local instance.

    Raises:
        ConfigError: ``auto`` and several Ray instances run on this machine, none of them the one
            ``ray start`` last recorded.
        RayUnavailable: ``auto`` and no Ray instance runs on this machine.
    """
    if address is None and os.environ.get("RAY_ADDRESS"):
        address, source = os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    else:
        source = "--address"
    if address is None:
        others = len(running_instances())
        beside = (f", beside {others} other Ray instance{'s' * (others != 1)} on this machine (--address auto would "
                  "join one)" if others else "")
        return None, f"no --address or RAY_ADDRESS: a run of its own{beside}"
    if address == OWN_INSTANCE:
        return None, f"{source}={OWN_INSTANCE}: a new local instance"
    if address != THIS_MACHINES:
        return address, f"given by {source}"
    target, why = instance_on_this_machine(f"{source}={THIS_MACHINES}")
    if target is None:
        raise RayUnavailable(f"{why}: on a cluster's server (~/.raymcn_env sets RAY_ADDRESS=auto) start the cluster "
                             "first (`ray up cluster.yaml`); for a run of its own here, pass --address local")
    return target, why


def instance_on_this_machine(source: str) -> tuple[str | None, str]:
    """The GCS address of the Ray instance whose raylet runs on this machine (of several, the one
    ``ray start`` last recorded), or None when none runs, and why, prefixed by ``source`` (what asked
    for it: ``RAY_ADDRESS=auto``, the boot service).

    Raises:
        ConfigError: several run here and none of them is the one ``ray start`` last recorded.
    """
    running, recorded = running_instances(), recorded_instance()
    if len(running) == 1:
        return running[0], f"{source}: the Ray instance running on this machine"
    if recorded in running:
        return recorded, f"{source}: the last `ray start` of the {len(running)} Ray instances running on this machine"
    if running:
        raise ConfigError([f"{source}: several Ray instances run on this machine ({', '.join(running)}) and none "
                           "is the one `ray start` last recorded; say which one with --address or RAY_ADDRESS (e.g. "
                           "the cluster's HEAD_IP:6379), or 'local' for a new one"])
    return None, f"{source}: no Ray instance runs on this machine"


def running_instances() -> list[str]:
    """The GCS address of every Ray instance whose raylet runs on this machine (a raylet is started
    with ``--gcs-address=HOST:PORT``; Ray's own ``address="auto"`` looks the same way)."""
    return sorted({r["gcs-address"] for r in _raylets() if r.get("gcs-address") not in (None, "", "None")})


def local_raylets(target: str) -> dict[int, list[str]]:
    """The raylets on this machine of the Ray instance whose GCS is at ``target`` (a driver started
    here attaches to one), by pid: the ``IP:PORT`` addresses each may answer at. Its node manager's
    port where its command line names one; a raylet started with port 0 (``ray start``'s default)
    chose its own, so then every port it listens on. Empty when this machine is not a node of the
    instance. A raylet names its GCS by the head's IP, a command often by 127.0.0.1: on this machine
    both are the same."""
    host, _, port = target.removeprefix("ray://").rpartition(":")
    here = this_machines_addresses()
    found = {}
    for raylet in _raylets():
        gcs_host, _, gcs_port = raylet.get("gcs-address", "").rpartition(":")
        same = (gcs_host, gcs_port) == (host, port) or (gcs_port == port and {host, gcs_host} <= here)
        ip = raylet.get("node_ip_address")
        if same and ip:
            named = raylet.get("node_manager_port", "0")
            found[int(raylet["pid"])] = [f"{ip}:{named}"] if named not in ("", "0") else _listening(raylet["pid"], ip)
    return found


def _listening(pid: str, ip: str) -> list[str]:
    """``HOST:PORT`` of every TCP port process ``pid`` listens on (``ip`` for a wildcard address);
    none when it is gone or not ours to look at."""
    import psutil

    try:
        sockets = psutil.Process(int(pid)).net_connections(kind="tcp")
    except psutil.Error:
        return []
    out = []
    for s in sockets:
        if s.status == psutil.CONN_LISTEN:
            host = ip if s.laddr.ip in ("0.0.0.0", "::", "") else s.laddr.ip.removeprefix("::ffff:")  # IPv4 in v6
            out.append(f"[{host}]:{s.laddr.port}" if ":" in host else f"{host}:{s.laddr.port}")
    return sorted(set(out))


def this_machines_addresses() -> set[str]:
    """The names and IP addresses by which this machine reaches itself."""
    import psutil

    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    return names | {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
                    if a.family in (socket.AF_INET, socket.AF_INET6)}


def _raylets() -> list[dict[str, str]]:
    """The ``--name=value`` arguments of every raylet running on this machine, a dict each (the first
    value of a name: the raylet's own, before those of the worker commands it carries), and its
    ``pid``."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmdline = proc.info["cmdline"] or []
        except psutil.Error:  # gone, or another user's: not ours to join
            continue
        if cmdline and "raylet" in os.path.basename(cmdline[0]):
            args: dict[str, str] = {"pid": str(proc.pid)}
            for arg in (word for part in cmdline for word in part.split(" ")):
                if arg.startswith("--") and "=" in arg:
                    args.setdefault(*arg[2:].split("=", 1))
            found.append(args)
    return found


def recorded_instance() -> str | None:
    """The address ``ray start`` on this machine last recorded (``ray_current_cluster`` in Ray's
    temp folder: ``$RAY_TMPDIR``, else ``$TMPDIR``, else /tmp, then ``ray``), if any."""
    root = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    try:
        return (Path(root) / "ray" / "ray_current_cluster").read_text().strip() or None
    except OSError:
        return None


def wait_for_gcs(target: str, why: str, say: Callable[[str], None], named_after_s: float | None = None,
                 limit_s: float | None = None, advice: str = ADVICE) -> None:
    """Wait until the GCS at ``target`` answers (:func:`wait_for_answer`).

    Raises:
        RayUnavailable: no answer within ``limit_s``, or TLS is on and its files cannot be read.
    """
    wait_for_answer([target.removeprefix("ray://")], f"{target} ({why})", f"the Ray instance at {target} ({why})", say,
                    named_after_s, limit_s, advice)


def wait_for_answer(addresses: list[str], short: str, long: str, say: Callable[[str], None],
                    named_after_s: float | None = None, limit_s: float | None = None, advice: str = ADVICE) -> None:
    """Wait until a gRPC server of one process (a GCS, a raylet) completes a new connection at one of
    its ``addresses``: its HTTP/2 handshake, and TLS's where ``RAY_USE_TLS`` is on. No Ray call, so no
    token or version is needed yet, and a process that is stopped or hung never completes it (its
    kernel still accepts the TCP connection). Named on the console as ``short`` after
    ``named_after_s`` (default :data:`CONNECT_NAMED_AFTER_S`), given up as ``long`` after
    ``limit_s`` (default :data:`CONNECT_LIMIT_S`).

    Raises:
        RayUnavailable: no answer within ``limit_s``, or TLS is on and its files cannot be read.
    """
    import grpc

    named_after_s = CONNECT_NAMED_AFTER_S if named_after_s is None else named_after_s
    limit_s = CONNECT_LIMIT_S if limit_s is None else limit_s
    started = time.monotonic()
    credentials = tls_credentials()
    # A channel of its own pool: grpc shares connections between a process's channels to one address
    # (its global subchannel pool), so a channel another caller holds READY, or one closed a moment
    # ago, would "answer" for a process that is stopped now.
    fresh = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.secure_channel(a, credentials, options=fresh) if credentials
                else grpc.insecure_channel(a, options=fresh) for a in addresses]
    answered = threading.Event()
    futures = [grpc.channel_ready_future(c) for c in channels]
    for future in futures:
        future.add_done_callback(lambda f: None if f.cancelled() else answered.set())
    try:
        for until_s in (named_after_s, limit_s):
            if answered.wait(timeout=max(0.0, until_s - (time.monotonic() - started))):
                return
            if until_s < limit_s:
                say(f"Ray: no answer from {short} for {until_s:g} s; {advice}. Giving up at {limit_s:g} s.")
    finally:
        for future, channel in zip(futures, channels):
            future.cancel()
            channel.close()
    tls = " over TLS (RAY_USE_TLS)" if credentials else ""
    raise RayUnavailable(f"{long} did not answer{tls} within {limit_s:g} s; {advice}")


def tls_credentials():
    """gRPC channel credentials from Ray's TLS settings when ``RAY_USE_TLS`` is on, built as Ray's
    own clients build them (``RAY_TLS_SERVER_CERT``, ``RAY_TLS_SERVER_KEY``, ``RAY_TLS_CA_CERT``);
    None when it is off (a plain channel).

    Raises:
        RayUnavailable: TLS is on and a file is not set or not readable (Ray would fail the same way).
    """
    import grpc

    if os.environ.get("RAY_USE_TLS", "0").lower() not in ("1", "true"):
        return None
    missing = [name for name in TLS_FILES if not os.environ.get(name)]
    if missing:
        raise RayUnavailable(f"RAY_USE_TLS is on but {', '.join(missing)} is not set: Ray's TLS needs "
                             f"{', '.join(TLS_FILES)}")
    try:
        cert, key, ca = (Path(os.environ[name]).read_bytes() for name in TLS_FILES)
    except OSError as e:
        raise RayUnavailable(f"RAY_USE_TLS is on but one of its files is not readable: {reason(e)}") from e
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


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
    gpus = workers * cfg.scale.gpus_per_worker
    if cfg.scale.use_gpu and gpus > have.get("GPU", 0) + 1e-9:
        problems.append(f"scale.use_gpu=true with scale.num_workers={cfg.scale.workers_text} x scale.gpus_per_worker="
                        f"{cfg.scale.gpus_per_worker:g} needs {gpus:g} GPUs; "
                        f"the cluster has {have.get('GPU', 0):g}")
    return problems


def worker_resources(cfg: Config) -> dict[str, float]:
    """What one Train worker reserves: ``scale.cpus_per_worker`` CPUs, and with ``scale.use_gpu`` its
    share of a GPU (``scale.gpus_per_worker``, one by default: DDP, never DataParallel)."""
    return {"CPU": cfg.scale.cpus_per_worker, **({"GPU": cfg.scale.gpus_per_worker} if cfg.scale.use_gpu else {})}


def process_group_backend(cfg: Config) -> str | None:
    """The ranks' process group: Ray Train's default (NCCL on GPUs, gloo on CPUs), except gloo for
    workers sharing a GPU (``scale.gpus_per_worker`` < 1), which NCCL refuses."""
    return "gloo" if cfg.scale.use_gpu and cfg.scale.gpus_per_worker < 1 else None


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
