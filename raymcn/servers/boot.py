"""``raymcn boot``: after a server boots, Ray as ``ray up`` last started it there and, on the head,
the newest unfinished sweep continued. Opt-in: a systemd service (``raymcn-boot.service`` beside
this module) that ``raymcn boot --install`` writes and enables, from a line of cluster.yaml's
setup_commands that stays commented out unless the lab turns it on.

Open-source Ray does not bring a cluster back after its head reboots (GCS fault tolerance is for
Ray Serve on KubeRay) and a sweep's driver must be started again; the sweep's state and
checkpoints are on shared storage, so ``raymcn sweep --resume`` continues it. This module does by
itself what a person otherwise does after a reboot (``ray up``, then ``--resume``):

- **The one place of the start commands is cluster.yaml.** Each of its start commands runs
  ``raymcn boot --record ROLE -- <the ray start command>``, which keeps, per machine, that command
  line, the variables the launcher gives it (``LAUNCHER_ENV``) and the open-files limit, then runs
  it. At boot the service replays exactly that record (``ray stop``, then the command), so the two
  cannot drift: editing cluster.yaml and running ``ray up`` again updates the record.
- **A worker** waits for the head's GCS port (the head may boot later), then starts Ray; when the
  head does not answer in ``--wait`` seconds it exits with status 1 and systemd tries again.
- **The head** starts Ray, waits until every worker of cluster.yaml has rejoined (Ray's node count)
  or ``--wait`` seconds passed, then runs ``raymcn sweep --resume EXP`` for the newest sweep under
  ``$RAYMCN_RESULTS`` that is neither finished, stopped on purpose nor a rehearsal
  (``servers/sweeps.py``), from the home folder as ``ray submit`` runs a sweep, its output also
  appended to ``raymcn_boot.log`` in the sweep's folder. Both join the instance it started (the
  one on this machine at its start command's port, given to the sweep as ``--address``), never
  another Ray instance on the machine.
- Then it stays, as the service's main process, so that the Ray it started belongs to the service
  until the service stops; stopping it (also at shutdown) first drains the node (``raymcn drain``).
"""

from __future__ import annotations

import argparse
import datetime
import getpass
import json
import os
import resource
import shlex
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

from raymcn import storage
from raymcn.servers import drain, sweeps

RECORD_DIR = ".raymcn_boot"  # in the home folder: <hostname>.json (one per machine: homes may be on NFS)
# What `ray up` adds to a start command's environment (Ray 2.60, autoscaler/_private/commands.py for
# the head, autoscaler.py for workers): the head's autoscaler version and its own instance, the
# workers' head address.
LAUNCHER_ENV = ("RAY_HEAD_IP", "RAY_enable_autoscaler_v2", "RAY_CLOUD_INSTANCE_ID", "RAY_NODE_TYPE_NAME")
ROLES = ("head", "worker")
UNIT_NAME = "raymcn-boot.service"
UNIT_DIR = Path("/etc/systemd/system")
BOOT_LOG_FILE = "raymcn_boot.log"  # in a sweep's folder: what the boot-started driver printed
BOOTSTRAP_CONFIG = "ray_bootstrap_config.yaml"  # in the head's home: the cluster config `ray up` left there
# As long as `ray up` waits for a server's SSH before giving up on it.
DEFAULT_WAIT_S = 900
POLL_S = 5.0
NOTHING_RECORDED = 2  # exit status the unit does not restart on


class BootError(RuntimeError):
    """Ray did not start, or the service could not be installed."""


class NothingRecorded(BootError):
    """``ray up`` never ran this machine's start commands: there is nothing to start."""


@dataclass
class StartRecord:
    """How ``ray up`` last started Ray on this machine."""

    role: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    nofile: tuple[int, int] | None = None  # RLIMIT_NOFILE (soft, hard) in effect (cluster.yaml's ulimit)
    recorded_at: str = ""


def record_path(home: Path | None = None) -> Path:
    return (home or Path.home()) / RECORD_DIR / f"{socket.gethostname()}.json"


def make_record(role: str, argv: list[str], env: dict[str, str] | None = None) -> StartRecord:
    env = os.environ if env is None else env
    if role not in ROLES:
        raise BootError(f"--record {role}: the role is head or worker")
    if not argv:
        raise BootError("--record: give the ray start command after --")
    return StartRecord(role, list(argv), {k: env[k] for k in LAUNCHER_ENV if k in env},
                       tuple(resource.getrlimit(resource.RLIMIT_NOFILE)),
                       datetime.datetime.now().astimezone().isoformat(timespec="seconds"))


def save_record(record: StartRecord, home: Path | None = None) -> Path:
    path = record_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(asdict(record), indent=1) + "\n")
    partial.replace(path)  # a boot never reads half a record
    return path


def load_record(home: Path | None = None) -> StartRecord:
    path = record_path(home)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise NothingRecorded(f"no start recorded for this machine ({path}): `ray up` with raymcn's cluster.yaml records "
                        "one (its start commands run `raymcn boot --record`); nothing to start") from None
    data["nofile"] = tuple(data["nofile"]) if data.get("nofile") else None
    return StartRecord(**data)


def _flag(argv: list[str], name: str) -> str | None:
    """The value of ``--name=V`` or ``--name V`` in ``argv``, or None."""
    for i, word in enumerate(argv):
        if word.startswith(f"{name}="):
            return word.split("=", 1)[1]
        if word == name and i + 1 < len(argv):
            return argv[i + 1]
    return None


def gcs_address_of(argv: list[str]) -> str | None:
    """The ``--address`` a worker's ``ray start`` joins (``--address=H:P`` or ``--address H:P``)."""
    return _flag(argv, "--address")


HEAD_PORT = "6379"  # `ray start --head`'s GCS port when the command names none
BOOT_ADVICE = "see `ray status` and Ray's logs in /tmp/ray/session_latest/logs on this server"


def started_instance(record: StartRecord) -> tuple[str, str]:
    """The GCS address of the Ray instance this boot started on this machine, the head (the one whose
    raylet runs here at the recorded command's ``--port``: other Ray instances on the machine, a
    colleague's, are not it), and why.

    Raises:
        BootError: none runs here at that port.
    """
    from raymcn.train.on_ray.cluster import running_instances

    port = _flag(record.argv, "--port") or HEAD_PORT
    at_port = [a for a in running_instances() if a.rpartition(":")[2] == port]
    if not at_port:
        raise BootError(f"no Ray instance runs on this machine at port {port} after its start "
                        f"(`{shlex.join(record.argv)}`); {BOOT_ADVICE}")
    return at_port[0], f"started by this boot: this machine's Ray instance at port {port}"


def poll_until(done, timeout_s: float, interval_s: float = POLL_S, clock=time.monotonic, sleep=time.sleep) -> bool:
    """Call ``done()`` until it is true or ``timeout_s`` passed; whether it became true."""
    end = clock() + timeout_s
    while not done():
        if clock() >= end:
            return False
        sleep(max(0.0, min(interval_s, end - clock())))
    return True


def port_open(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


def apply_nofile(limits: tuple[int, int] | None) -> None:
    """The recorded open-files limit, as far as this process's hard limit allows."""
    if not limits:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft = limits[0] if hard == resource.RLIM_INFINITY else min(limits[0], hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def start_ray(record: StartRecord, run=subprocess.run, home: Path | None = None) -> None:
    """What cluster.yaml's start commands do: ``ray stop``, then the recorded ``ray start``, with the
    launcher's variables and the open-files limit it had."""
    apply_nofile(record.nofile)
    env = {**os.environ, **record.env}
    cwd = str(home or Path.home())
    run(["ray", "stop"], env=env, cwd=cwd, check=False)
    done = run(record.argv, env=env, cwd=cwd, check=False)
    if done.returncode != 0:
        raise BootError(f"`{shlex.join(record.argv)}` failed with status {done.returncode}")


def expected_nodes(home: Path | None = None) -> int:
    """The head and every worker IP of the cluster config ``ray up`` left on the head (1 without it)."""
    import yaml

    path = (home or Path.home()) / BOOTSTRAP_CONFIG
    if not path.exists():
        return 1
    config = yaml.safe_load(path.read_text()) or {}
    return 1 + len((config.get("provider") or {}).get("worker_ips") or [])


def wait_for_nodes(target: str, why: str, expected: int, timeout_s: float, say=print) -> int:
    """Wait until ``expected`` nodes are alive in the cluster whose GCS is at ``target`` (the one this
    boot started: :func:`started_instance`, and why), at most ``timeout_s``; returns how many are.
    Connects as every raymcn command does (``train/on_ray/cluster.py``: named, and ended within its
    limits).

    Raises:
        BootError: it does not answer (its reason named).
    """
    import ray

    from raymcn.config import ConfigError, RayUnavailable
    from raymcn.train.on_ray.cluster import connected

    try:
        with connected(target, why, say, advice=BOOT_ADVICE, logging_level="ERROR", log_to_driver=False):
            def alive() -> int:
                return sum(1 for n in ray.nodes() if n.get("Alive"))

            if not poll_until(lambda: alive() >= expected, timeout_s):
                say(f"raymcn boot: {alive()} of {expected} nodes after {timeout_s:.0f} s; going on without the "
                    "others (a trial waits for its GPUs)")
            return alive()
    except (RayUnavailable, ConfigError) as e:
        raise BootError(str(e)) from e


def boot_log(experiment_dir: str) -> Path:
    """Where the boot-started driver's output goes: the sweep's folder, or for a bucket the local cache."""
    if storage.is_uri(experiment_dir):
        from raymcn.config import Config, default_cache_dir

        return default_cache_dir(Config()) / "logs" / storage.basename(experiment_dir) / BOOT_LOG_FILE
    return Path(experiment_dir) / BOOT_LOG_FILE


def tee(command: list[str], log: Path, cwd: Path) -> int:
    """Run ``command``; its output goes to this process's stdout and is appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # lines reach the log as they are printed
    with open(log, "ab") as out, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                  cwd=cwd, env=env) as child:
        out.write(f"--- raymcn boot, {datetime.datetime.now():%Y-%m-%d %H:%M:%S}: {shlex.join(command)}\n".encode())
        for line in child.stdout:
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
            out.write(line)
            out.flush()
    return child.returncode


def sweep_to_continue(location: str, say=print) -> str | None:
    """The newest sweep under ``location`` neither finished nor stopped (None: nothing to continue)."""
    candidates = sweeps.unfinished_sweeps(location)
    if not candidates:
        say(f"raymcn boot: no unfinished sweep under {location}; nothing to continue (finished sweeps and those "
            "stopped with `raymcn sweep --stop` are left alone)")
        return None
    if len(candidates) > 1:
        say("raymcn boot: older unfinished sweeps, left alone: " + ", ".join(candidates[1:]) +
            " (`raymcn sweep --resume EXP` continues one by hand, `raymcn sweep --stop EXP` marks it stopped)")
    return candidates[0]


def continue_sweep(location: str, say=print, home: Path | None = None, address: str | None = None) -> int | None:
    """``raymcn sweep --resume`` of :func:`sweep_to_continue`'s sweep on the cluster at ``address``
    (the one this boot started; given, so that the driver joins it whatever its environment says);
    its status, or None."""
    experiment_dir = sweep_to_continue(location, say)
    if experiment_dir is None:
        return None
    log = boot_log(experiment_dir)
    say(f"raymcn boot: continuing the sweep {experiment_dir} (its output also in {log})")
    joins = ["--address", address] if address else []
    status = tee([sys.executable, "-m", "raymcn.cli", "sweep", "--resume", experiment_dir, *joins], log,
                 home or Path.home())
    say(f"raymcn boot: the sweep's driver ended with status {status}")
    return status


def boot(args: argparse.Namespace, say=print) -> None:
    if hasattr(sys.stdout, "reconfigure"):  # its lines reach the journal in order with the children's
        sys.stdout.reconfigure(line_buffering=True)
    record = load_record()
    say(f"raymcn boot: this machine's role: {record.role}; starting Ray as `ray up` did on {record.recorded_at}: "
        f"{shlex.join(record.argv)}")
    head = gcs_address_of(record.argv) if record.role == "worker" else None
    if head and not poll_until(lambda: port_open(head), args.wait):
        raise BootError(f"the head's GCS at {head} did not answer within {args.wait} s")
    start_ray(record)
    if record.role == "head":
        from raymcn.config import Config, default_storage_path

        expected = expected_nodes()
        say(f"raymcn boot: waiting up to {args.wait} s for {expected} node(s) (the head and cluster.yaml's workers)")
        address, why = started_instance(record)
        say(f"raymcn boot: {wait_for_nodes(address, why, expected, args.wait, say)} node(s) alive")
        continue_sweep(args.storage or default_storage_path(Config()), say, address=address)


# --- the systemd service -------------------------------------------------------------------------------
def unit_text(user: str, home: Path, deadline_s: int = drain.DEFAULT_DEADLINE_S) -> str:
    """The service file for ``user``: the template beside this module, filled in."""
    template = (resources.files("raymcn.servers") / UNIT_NAME).read_text()
    # systemd waits this long for ExecStop (the drain) before it kills the service's processes
    return template.format(user=user, home=home, deadline=deadline_s, stop_timeout=deadline_s + 60)


def _sudo(euid: int | None) -> list[str]:
    return [] if (os.geteuid() if euid is None else euid) == 0 else ["sudo", "-n"]


def install_commands(euid: int | None = None) -> list[list[str]]:
    """Write the unit (its text on stdin), reload systemd, enable it for the next boot. Not started
    now: it would restart the Ray that `ray up` is starting (its setup runs before its start)."""
    sudo = _sudo(euid)
    return [[*sudo, "tee", str(UNIT_DIR / UNIT_NAME)], [*sudo, "systemctl", "daemon-reload"],
            [*sudo, "systemctl", "enable", UNIT_NAME]]


def uninstall_commands(euid: int | None = None) -> list[list[str]]:
    sudo = _sudo(euid)
    return [[*sudo, "systemctl", "disable", UNIT_NAME], [*sudo, "rm", "-f", str(UNIT_DIR / UNIT_NAME)],
            [*sudo, "systemctl", "daemon-reload"]]


def _run_all(commands: list[list[str]], stdin: str | None = None, run=subprocess.run) -> None:
    for i, command in enumerate(commands):
        done = run(command, input=stdin if i == 0 else None, text=True, capture_output=True)
        if done.returncode != 0:
            raise BootError(f"`{shlex.join(command)}` failed: {(done.stderr or done.stdout).strip()} (the service "
                            "needs systemd and root or password-less sudo)")


# --- the command ------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_mutually_exclusive_group()
    what.add_argument("--record", choices=ROLES, help="cluster.yaml's start commands: keep the command after -- as "
                      "this machine's start (and the launcher's variables), then run it")
    what.add_argument("--unit", action="store_true", help="print the systemd service file for this user")
    what.add_argument("--install", action="store_true", help="write and enable the service for the next boot "
                      "(cluster.yaml's commented setup line)")
    what.add_argument("--uninstall", action="store_true", help="disable and remove the service")
    p.add_argument("--wait", type=int, default=DEFAULT_WAIT_S, metavar="SECONDS",
                   help=f"how long the head waits for the workers, a worker for the head (default {DEFAULT_WAIT_S})")
    p.add_argument("--storage", metavar="PATH", help="where the sweeps are (default: $RAYMCN_RESULTS)")
    p.add_argument("start_command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                   help="with --record: the ray start command")


def run(args: argparse.Namespace) -> int:
    """Without an option: the boot itself, which then stays (the service's main process)."""
    command = args.start_command[1:] if args.start_command[:1] == ["--"] else args.start_command
    try:
        if args.record:
            save_record(make_record(args.record, command))
            return subprocess.run(command).returncode
        if command:
            raise BootError(f"unexpected arguments {shlex.join(command)} (only --record takes a command)")
        if args.unit:
            print(unit_text(getpass.getuser(), Path.home()), end="")
            return 0
        if args.install or args.uninstall:
            text = unit_text(getpass.getuser(), Path.home()) if args.install else None
            _run_all(install_commands() if args.install else uninstall_commands(), text)
            print(f"raymcn boot: {UNIT_NAME} " + ("installed and enabled: it starts at the next boot" if args.install
                                                   else "disabled and removed"))
            return 0
        boot(args)
    except BootError as e:
        print(f"raymcn boot: {e}", file=sys.stderr, flush=True)
        return NOTHING_RECORDED if isinstance(e, NothingRecorded) else 1
    print("raymcn boot: done; staying as the service's main process, so the Ray it started stays in the service",
          flush=True)
    threading.Event().wait()
    return 0
