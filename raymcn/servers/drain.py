"""``raymcn drain``: take this server's Ray node out of the cluster before a planned reboot.

It asks Ray to drain the node (``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
--deadline-remaining-seconds N``): from then on Ray schedules nothing new there, Ray Train's
preemption watcher (on by default in Ray 2.60) tells every run with workers there, and the
node's raylet exits once nothing runs on it. The command waits until no Ray Train worker runs on
the node any more, or until every one there has marked its drain checkpoint registered, or until
the deadline, and with ``--reboot`` then reboots the machine. What a run does when it learns of the
drain is the run's business (``train/drain.py``): its ranks checkpoint at once, each marks on its
machine when Ray Train has registered that checkpoint (``<temp folder>/raymcn-drained/<pid>``), and
they train on. A reboot once they are all marked loses only what was trained since: the group
restarts from that checkpoint as soon as the node is gone, a preemption in Ray Train's count, instead
of the deadline's worth of steps, trained after it and then thrown away.

How the node is found: ``ray.nodes()`` of the cluster named by ``--address``, else ``RAY_ADDRESS``
(``auto``, as ``~/.raymcn_env`` sets it on a cluster's servers: the instance whose raylet runs
here; none there: nothing to drain), through the connection every raymcn
command makes (``train/on_ray/cluster.py``): a GCS that does not answer is named and given up
within its limits instead of holding a reboot. The node is the alive one at this machine's IP.
How its Train workers are counted: on this machine, the processes Ray titles
``ray::RayTrainWorker...`` whose parent is that node's raylet. Not through the State API: its
server is the head's dashboard, which listens on the head's loopback only (cluster.yaml), so a
worker server cannot ask it. And the command disconnects before it drains: a driver attached to
a raylet that exits is ended with it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from raymcn.config import drain_marks_dir

REASON = "DRAIN_NODE_REASON_PREEMPTION"
# Ray titles an actor's process "ray::<class>" (idle) or "ray::<class>.<method>" (in a call).
TRAIN_WORKER_TITLE = "ray::RayTrainWorker"
# Long enough for a step, a paper-dims checkpoint and its upload, with room (a checkpoint's stall
# depends on the disk: `python -m bench.checkpoint` measures it, docs/faults.md, "Checkpoints");
# the command returns as soon as the node's Train workers have marked their drain checkpoint
# registered, or are gone.
DEFAULT_DEADLINE_S = 300
POLL_S = 2.0
REPORT_EVERY_S = 30.0


class DrainError(RuntimeError):
    """The node to drain cannot be told, or Ray refused the drain."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--deadline", type=int, default=DEFAULT_DEADLINE_S, metavar="SECONDS",
                   help="the node goes away at the latest this many seconds from now: Ray Train's workers on it "
                        f"have until then to checkpoint (default {DEFAULT_DEADLINE_S})")
    p.add_argument("--reboot", action="store_true",
                   help="reboot this machine once every Ray Train worker on it has its drain checkpoint registered "
                        "(or has left, or at the deadline)")
    p.add_argument("--address", help="the cluster's GCS address HOST:PORT, or auto: the Ray instance running on this "
                   "machine (default: RAY_ADDRESS, which ~/.raymcn_env sets to auto on a cluster's servers)")
    p.add_argument("--node-id", help="the node to drain (default: the alive node at this machine's IP)")


def drain_command(ray: str, address: str, node_id: str, deadline_s: int, message: str) -> list[str]:
    """The ``ray drain-node`` command line (Ray 2.60's flags; its ``--reason`` and
    ``--reason-message`` are required)."""
    if deadline_s < 0:
        raise DrainError(f"--deadline {deadline_s}: a number of seconds from now, not negative")
    return [ray, "drain-node", "--address", address, "--node-id", node_id, "--reason", REASON,
            "--reason-message", message, "--deadline-remaining-seconds", str(deadline_s)]


def node_at(nodes: list[dict], ip: str) -> str:
    """The id of the one alive node of ``nodes`` (``ray.nodes()``) at ``ip``."""
    here = [n["NodeID"] for n in nodes if n.get("Alive") and n.get("NodeManagerAddress") == ip]
    if len(here) == 1:
        return here[0]
    seen = ", ".join(f"{n['NodeID'][:12]} at {n.get('NodeManagerAddress')}" for n in nodes if n.get("Alive"))
    if not here:
        raise DrainError(f"no alive Ray node at this machine's IP {ip} (alive nodes: {seen or 'none'})")
    raise DrainError(f"{len(here)} alive Ray nodes at {ip}: {', '.join(here)}; name one with --node-id")


def reboot_command(euid: int | None = None) -> list[str]:
    """``systemctl reboot``, through ``sudo -n`` (never a password prompt) unless root."""
    euid = os.geteuid() if euid is None else euid
    return (["systemctl", "reboot"] if euid == 0 else ["sudo", "-n", "systemctl", "reboot"])


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # the process ended while we looked
        return b""


def _parent(stat: bytes) -> int | None:
    """The parent pid from a /proc/PID/stat line (the name in parentheses may hold spaces)."""
    fields = stat.rpartition(b")")[2].split()
    return int(fields[1]) if len(fields) > 1 else None


def train_workers(node_id: str, proc: Path = Path("/proc")) -> list[int]:
    """Pids of the Ray Train workers of node ``node_id`` on this machine: processes titled
    ``ray::RayTrainWorker...`` whose parent is the raylet started with ``--node_id=<node_id>``."""
    raylets, titled = set(), {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        cmdline = _read(entry / "cmdline")
        if _read(entry / "comm").strip() == b"raylet" and f"--node_id={node_id}".encode() in cmdline.split(b"\0"):
            raylets.add(int(entry.name))
        elif cmdline.startswith(TRAIN_WORKER_TITLE.encode()):
            titled[int(entry.name)] = _parent(_read(entry / "stat"))
    return sorted(pid for pid, parent in titled.items() if parent in raylets)


def read_mark(pid: int, since: float, marks: Path | None = None) -> dict | None:
    """Worker ``pid``'s drain mark (``train.drain.mark_registered``: ``{"step", "rank", "time"}``) if it
    was written at or after ``since`` (epoch seconds: this drain's, not an earlier one's), else None."""
    try:
        mark = json.loads(((drain_marks_dir() if marks is None else marks) / str(pid)).read_text())
    except (OSError, ValueError):
        return None
    return mark if isinstance(mark, dict) and mark.get("time", 0.0) >= since else None


def wait_for_node(node_id: str, deadline_s: float, since: float, proc: Path = Path("/proc"), marks: Path | None = None,
                  clock=time.monotonic, sleep=time.sleep, say=print) -> tuple[list[int], dict[int, dict]]:
    """Wait until no Ray Train worker of ``node_id`` runs here, or every one has marked its drain
    checkpoint registered (a mark written since ``since``), at most ``deadline_s``. Returns the pids
    still there and their marks: ``([], {})`` when they left, every pid marked when the node can go
    now, some unmarked at the deadline."""
    end, next_report = clock() + deadline_s, clock()
    while True:
        left = train_workers(node_id, proc)
        marked = {pid: m for pid in left if (m := read_mark(pid, since, marks)) is not None}
        now = clock()
        if len(marked) == len(left) or now >= end:
            return left, marked
        if now >= next_report:
            say(f"  {len(left)} Ray Train worker(s) still on this node, {len(marked)} with their drain checkpoint "
                f"registered; waiting up to {end - now:.0f} s more")
            next_report = now + REPORT_EVERY_S
        sleep(min(POLL_S, end - now))


def outcome(left: list[int], marked: dict[int, dict], waited_s: float) -> str:
    """What the wait ended on, for the terminal."""
    if not left:
        return f"after {waited_s:.0f} s: no Ray Train worker on this node"
    if len(marked) == len(left):
        steps = sorted({m.get("step") for m in marked.values()})
        return (f"after {waited_s:.0f} s: every Ray Train worker on this node ({len(left)}) has its drain checkpoint "
                f"registered (global step {', '.join(map(str, steps))}): the node can go now, before the deadline")
    return (f"after {waited_s:.0f} s: {len(left)} Ray Train worker(s) still here at the deadline (pids "
            f"{', '.join(map(str, left))}), {len(marked)} with a drain checkpoint")


def _ray_executable() -> str:
    beside = Path(sys.executable).with_name("ray")
    return str(beside) if beside.exists() else (shutil.which("ray") or "ray")


DRAIN_ADVICE = ("see `ray status` and Ray's logs on that instance's head (stop nothing that may not be yours); to "
                "drain a node of another cluster, pass --address HOST:PORT")


def _cluster(address: str | None, say=print) -> tuple[str, list[dict], str] | None:
    """(GCS address, ``ray.nodes()``, this machine's IP as Ray sees it) of the cluster named by
    ``address``, else ``RAY_ADDRESS``, or None when that is ``auto`` and no Ray instance runs on
    this machine (nothing to drain: at shutdown Ray may be gone already). Disconnects before returning.

    Raises:
        DrainError: neither names a cluster, or it is ``local`` (a new instance has nothing to drain).
        ConfigError: ``auto``, and several Ray instances run here and none is the one ``ray start`` recorded.
        RayUnavailable: the instance named or found did not answer within the connection's limits.
    """
    import ray

    from raymcn.train.on_ray.cluster import OWN_INSTANCE, THIS_MACHINES, connected, instance_on_this_machine

    source = "--address" if address else "RAY_ADDRESS"
    told = address or os.environ.get("RAY_ADDRESS")
    if not told or told == OWN_INSTANCE:
        named = f"{source}={told} is a new instance, not a cluster" if told else "no --address or RAY_ADDRESS"
        raise DrainError(f"no cluster to drain ({named}): pass --address HOST:PORT, or --address {THIS_MACHINES} for "
                         "the Ray instance running on this machine (a cluster's servers get "
                         f"RAY_ADDRESS={THIS_MACHINES} from ~/.raymcn_env)")
    if told == THIS_MACHINES:
        target, why = instance_on_this_machine(f"{source}={THIS_MACHINES}")
        if target is None:
            return None
    else:
        target, why = told, f"given by {source}"
    with connected(target, why, say, advice=DRAIN_ADVICE, logging_level="ERROR", log_to_driver=False):
        return ray.get_runtime_context().gcs_address, ray.nodes(), ray.util.get_node_ip_address()


def drain(args: argparse.Namespace) -> None:
    """Drain this machine's node and wait for its Train workers (or the deadline)."""
    found = _cluster(args.address)
    if found is None:
        print("raymcn drain: this machine is in no running Ray cluster; nothing to drain")
        return
    address, nodes, ip = found
    node = args.node_id or node_at(nodes, ip)
    command = drain_command(_ray_executable(), address, node, args.deadline,
                            f"raymcn drain on {socket.gethostname()}" + (" before a reboot" if args.reboot else ""))
    since = time.time()  # a drain mark older than this drain is an earlier one's
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise DrainError(f"`ray drain-node` failed: {(done.stderr or done.stdout).strip()[-2000:]}")
    print(f"draining node {node} ({ip}) of the cluster at {address}, deadline {args.deadline} s: nothing new starts "
          "there, and Ray Train's runs on it were told")
    start = time.monotonic()
    left, marked = wait_for_node(node, args.deadline, since)
    print(outcome(left, marked, time.monotonic() - start))


def run(args: argparse.Namespace) -> int:
    from raymcn.config import ConfigError, RayUnavailable

    try:
        drain(args)
    except (DrainError, RayUnavailable, ConfigError) as e:
        print(f"raymcn drain: {e}" + ("; not rebooting (`sudo systemctl reboot` reboots without a drain)"
                                      if args.reboot else ""), file=sys.stderr)
        return 1
    if args.reboot:
        command = reboot_command()
        print(f"rebooting: {' '.join(command)}", flush=True)
        return subprocess.run(command).returncode
    return 0
