"""The lab's servers around a sweep, without Ray: which sweep a boot continues (finished, stopped,
unfinished, a confirmation under way), `raymcn sweep --stop`, `raymcn drain`'s command line, node
and Train workers, and `raymcn boot`'s record, replay and service file. What these do on a real
`ray up` cluster: tests/test_launcher.py."""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raymcn.cli import main
from raymcn.config import SWEEP_CONFIG_FILE
from raymcn.servers import boot, drain, sweeps

# --- which sweep a boot continues --------------------------------------------------------------------------


def make_sweep(root: Path, name: str, started: int, mark: str | None = None, confirm_started: bool = False) -> str:
    """A sweep folder whose raymcn_sweep.yaml was written at time ``started`` (seconds)."""
    exp = root / name
    exp.mkdir(parents=True)
    (exp / SWEEP_CONFIG_FILE).write_text("sweep: {}\n")
    os.utime(exp / SWEEP_CONFIG_FILE, (started, started))
    if confirm_started:  # run_confirmation writes its own config into EXP/confirm first
        (exp / "confirm").mkdir()
        (exp / "confirm" / SWEEP_CONFIG_FILE).write_text("sweep: {}\n")
    if mark == "finished":
        sweeps.mark_finished(str(exp))
    elif mark == "stopped":
        sweeps.mark_stopped(str(exp))
    return str(exp)


def test_the_newest_sweep_neither_finished_nor_stopped_is_continued(tmp_path):
    old = make_sweep(tmp_path, "sweep-old", 1000)                                # unfinished
    make_sweep(tmp_path, "sweep-done", 2000, mark="finished")
    confirming = make_sweep(tmp_path, "sweep-confirming", 3000, confirm_started=True)  # search ended, confirmation not
    make_sweep(tmp_path, "sweep-stopped", 4000, mark="stopped")                  # the newest, stopped on purpose
    (tmp_path / "not-a-sweep").mkdir()
    assert sweeps.unfinished_sweeps(str(tmp_path)) == [confirming, old]
    assert boot.sweep_to_continue(str(tmp_path), say=lambda _: None) == confirming
    assert [sweeps.state(s) for s in sweeps.sweeps_newest_first(str(tmp_path))] == \
        ["stopped", "unfinished", "finished", "unfinished"]


def test_nothing_to_continue_when_every_sweep_is_finished_or_stopped(tmp_path):
    make_sweep(tmp_path, "a", 1000, mark="finished")
    make_sweep(tmp_path, "b", 2000, mark="stopped")
    said = []
    assert boot.sweep_to_continue(str(tmp_path), say=said.append) is None
    assert "no unfinished sweep" in said[0]
    assert sweeps.unfinished_sweeps(str(tmp_path / "missing")) == []


def test_a_stop_mark_wins_and_running_again_clears_both(tmp_path):
    exp = make_sweep(tmp_path, "a", 1000, mark="finished")
    sweeps.mark_stopped(exp)
    assert sweeps.state(exp) == "stopped"
    sweeps.clear_marks(exp)  # what `raymcn sweep --resume` / `--confirm` does first
    assert sweeps.state(exp) == "unfinished" and sorted(os.listdir(exp)) == [SWEEP_CONFIG_FILE]
    sweeps.clear_marks(exp)  # nothing to clear: no error


def test_sweep_stop_latest_marks_the_sweep_a_boot_would_continue(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAYMCN_RESULTS", str(tmp_path))
    old = make_sweep(tmp_path, "old", 1000)
    new = make_sweep(tmp_path, "new", 2000)
    make_sweep(tmp_path, "done", 3000, mark="finished")
    assert main(["sweep", "--stop", "latest"]) == 0
    assert sweeps.state(new) == "stopped" and sweeps.state(old) == "unfinished"
    assert f"raymcn sweep --resume {new}" in capsys.readouterr().out
    assert main(["sweep", "--stop", old]) == 0 and sweeps.state(old) == "stopped"
    assert main(["sweep", "--stop", "latest"]) == 2
    assert "no sweep under" in capsys.readouterr().err


def test_sweep_stop_refuses_what_is_not_a_sweep_and_a_second_action(tmp_path, capsys):
    assert main(["sweep", "--stop", str(tmp_path)]) == 2
    assert "is it a raymcn sweep?" in capsys.readouterr().err
    exp = make_sweep(tmp_path, "a", 1000)
    assert main(["sweep", "--stop", exp, "--resume", exp]) == 2
    assert sweeps.state(exp) == "unfinished"


# --- raymcn drain ----------------------------------------------------------------------------------------


def test_the_drain_command_line_is_ray_2_60s():
    assert drain.drain_command("ray", "10.0.0.1:6379", "ab12", 300, "raymcn drain on h1") == [
        "ray", "drain-node", "--address", "10.0.0.1:6379", "--node-id", "ab12",
        "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "raymcn drain on h1",
        "--deadline-remaining-seconds", "300"]
    with pytest.raises(drain.DrainError, match="not negative"):
        drain.drain_command("ray", "a:1", "ab12", -1, "m")


def test_the_drain_flags_exist_in_the_installed_ray():
    from click.testing import CliRunner
    from ray.scripts.scripts import drain_node

    help_text = CliRunner().invoke(drain_node, ["--help"]).output
    for flag in drain.drain_command("ray", "a:1", "ab12", 1, "m"):
        if flag.startswith("--"):
            assert flag in help_text, flag
    assert drain.REASON in help_text


NODES = [{"NodeID": "head0", "NodeManagerAddress": "10.0.0.1", "Alive": True},
         {"NodeID": "old1", "NodeManagerAddress": "10.0.0.2", "Alive": False},  # before the last reboot
         {"NodeID": "work1", "NodeManagerAddress": "10.0.0.2", "Alive": True}]


def test_this_machines_node_is_the_alive_one_at_its_ip():
    assert drain.node_at(NODES, "10.0.0.2") == "work1"
    with pytest.raises(drain.DrainError, match=r"no alive Ray node at this machine's IP 10.0.0.9 .*head0"):
        drain.node_at(NODES, "10.0.0.9")
    twice = NODES + [{"NodeID": "work2", "NodeManagerAddress": "10.0.0.2", "Alive": True}]
    with pytest.raises(drain.DrainError, match="--node-id"):
        drain.node_at(twice, "10.0.0.2")


def fake_process(proc: Path, pid: int, comm: str, cmdline: list[str], parent: int) -> None:
    d = proc / str(pid)
    d.mkdir(parents=True)
    (d / "comm").write_text(comm + "\n")
    (d / "cmdline").write_bytes(b"\0".join(w.encode() for w in cmdline) + b"\0")
    (d / "stat").write_text(f"{pid} ({comm}) S {parent} {pid} {pid} 0 -1\n")


@pytest.fixture
def proc(tmp_path):
    """Two raylets on this machine (the lab's node and a colleague's instance) and their workers."""
    root = tmp_path / "proc"
    fake_process(root, 10, "raylet", ["/ray/raylet", "--node_id=mine", "--gcs-address=10.0.0.1:6379"], 1)
    fake_process(root, 20, "raylet", ["/ray/raylet", "--node_id=other", "--gcs-address=127.0.0.1:60000"], 1)
    fake_process(root, 11, "ray::RayTrainW", ["ray::RayTrainWorker.run_train_fn"], 10)
    fake_process(root, 12, "ray::RayTrainW", ["ray::RayTrainWorker"], 10)
    fake_process(root, 13, "ray::IDLE", ["ray::IDLE"], 10)
    fake_process(root, 14, "ray::TrainCont", ["ray::TrainController.run"], 10)
    fake_process(root, 21, "ray::RayTrainW", ["ray::RayTrainWorker.run_train_fn"], 20)  # the colleague's
    fake_process(root, 30, "python", ["python", "ray::RayTrainWorker"], 10)  # a title elsewhere in its words
    (root / "self").mkdir()
    return root


def test_the_train_workers_counted_are_those_of_this_node(proc):
    assert drain.train_workers("mine", proc) == [11, 12]
    assert drain.train_workers("other", proc) == [21]
    assert drain.train_workers("gone", proc) == []


def test_the_parent_is_read_after_the_name_even_with_spaces_and_parentheses():
    assert drain._parent(b"42 (ray::a (b) c) S 7 42 42 0") == 7


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_the_wait_ends_when_the_workers_leave_or_at_the_deadline(proc, tmp_path):
    clock, said, marks = Clock(), [], tmp_path / "marks"

    def leave_after_10_s(s):
        clock.sleep(s)
        if clock.now >= 10:
            for pid in ("11", "12"):
                shutil.rmtree(proc / pid, ignore_errors=True)

    assert drain.wait_for_node("mine", 300, 0.0, proc, marks, clock=clock, sleep=leave_after_10_s,
                               say=said.append) == ([], {})
    assert 10 <= clock.now < 300 and "2 Ray Train worker(s) still on this node, 0 with" in said[0]
    clock = Clock()
    left = drain.wait_for_node("other", 30, 0.0, proc, marks, clock=clock, sleep=clock.sleep, say=said.append)
    assert left == ([21], {})
    assert clock.now == 30
    assert "still here at the deadline (pids 21), 0 with a drain checkpoint" in drain.outcome([21], {}, 30)


def test_the_wait_ends_once_every_worker_of_the_node_marked_its_drain_checkpoint(proc, tmp_path):
    """The ranks' marks (written as a rank writes them): the node's two workers marked, the
    colleague's worker on the other raylet not; a mark from an earlier drain does not count."""
    from raymcn.train.checkpoints.policy import mark_registered

    clock, marks, since = Clock(), tmp_path / "marks", time.time()
    mark_registered(7, 1, marks, pid=11)
    (marks / "12").write_text(json.dumps({"step": 3, "rank": 0, "time": since - 60}))  # an earlier drain's

    def marked_after_5_s(s):
        clock.sleep(s)
        if clock.now >= 5:
            mark_registered(7, 0, marks, pid=12)

    left, marked = drain.wait_for_node("mine", 300, since, proc, marks, clock=clock, sleep=marked_after_5_s,
                                       say=lambda _: None)
    assert 5 <= clock.now < 300 and left == [11, 12] and sorted(marked) == [11, 12]
    assert marked[11]["step"] == marked[12]["step"] == 7 and {marked[11]["rank"], marked[12]["rank"]} == {0, 1}
    assert "every Ray Train worker on this node (2) has its drain checkpoint registered (global step 7)" in (
        drain.outcome(left, marked, clock.now))
    assert drain.read_mark(21, since, marks) is None  # never marked
    (marks / "21").write_text("{not json")  # half a file is never read: the rank writes it whole
    assert drain.read_mark(21, since, marks) is None
    assert [p.name for p in marks.iterdir() if p.name.startswith(".")] == []


def test_reboot_goes_through_sudo_unless_root():
    assert drain.reboot_command(euid=0) == ["systemctl", "reboot"]
    assert drain.reboot_command(euid=1000) == ["sudo", "-n", "systemctl", "reboot"]


def drain_args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"deadline": 60, "reboot": False, "address": None, "node_id": None, **kw})


def test_drain_drains_this_node_then_reboots(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(drain, "_cluster", lambda address: ("10.0.0.1:6379", NODES, "10.0.0.2"))
    monkeypatch.setattr(drain, "train_workers", lambda node, proc=None: [])
    monkeypatch.setattr(drain.time, "sleep", pytest.fail)  # nothing to wait for
    monkeypatch.setattr(drain.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0, "", ""))
    assert drain.run(drain_args(reboot=True)) == 0
    message = ran[0][ran[0].index("--reason-message") + 1]
    assert ran[0][1:] == drain.drain_command("ray", "10.0.0.1:6379", "work1", 60, message)[1:]
    assert "before a reboot" in message and ran[1] == drain.reboot_command()
    assert "no Ray Train worker on this node" in capsys.readouterr().out


def test_a_refused_drain_does_not_reboot_and_no_cluster_is_nothing_to_drain(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(drain, "_cluster", lambda address: ("10.0.0.1:6379", NODES, "10.0.0.2"))
    monkeypatch.setattr(drain.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(
        cmd, 1, "", "The drain request is not accepted: node is dead"))
    assert drain.run(drain_args(reboot=True)) == 1
    assert len(ran) == 1 and "not accepted" in capsys.readouterr().err
    monkeypatch.setattr(drain, "_cluster", lambda address: None)
    assert drain.run(drain_args(reboot=True)) == 1  # the reboot command itself failed (the fake says 1)
    assert ran[-1] == drain.reboot_command() and "nothing to drain" in capsys.readouterr().out


def test_drain_drains_only_a_cluster_it_is_told_of(monkeypatch, capsys):
    """Named by nothing, `raymcn drain` drains nothing (a Ray instance on the machine may be anyone's)
    and does not reboot; RAY_ADDRESS=auto, as a cluster's server has it from ~/.raymcn_env, is the
    instance running here, and with none (Ray gone before a shutdown) there is nothing to drain."""
    from raymcn.train.on_ray import cluster

    monkeypatch.setattr(drain.subprocess, "run", pytest.fail)  # neither `ray drain-node` nor a reboot
    monkeypatch.setattr(cluster, "connected", pytest.fail)
    monkeypatch.setattr(cluster, "running_instances", lambda: ["10.0.0.2:6379"])  # a colleague's instance
    monkeypatch.setattr(cluster, "recorded_instance", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for told in ({}, {"address": "local"}):
        assert drain.run(drain_args(reboot=True, **told)) == 1
        err = capsys.readouterr().err
        assert err.startswith("raymcn drain: no cluster to drain (") and "--address auto" in err, err
        assert "not rebooting" in err
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    monkeypatch.setattr(cluster, "running_instances", lambda: [])
    assert drain.run(drain_args()) == 0
    assert "in no running Ray cluster; nothing to drain" in capsys.readouterr().out


# --- raymcn boot -----------------------------------------------------------------------------------------


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_the_record_keeps_the_command_the_launchers_variables_and_the_open_files_limit(home):
    env = {"RAY_HEAD_IP": "10.0.0.1", "RAY_enable_autoscaler_v2": "1", "RAY_AUTH_TOKEN": "secret", "PATH": "/bin"}
    argv = ["env", "RAY_ADDRESS=10.0.0.1:6379", "ray", "start", "--address=10.0.0.1:6379", "--num-gpus=4"]
    path = boot.save_record(boot.make_record("worker", argv, env))
    assert path.parent == home / boot.RECORD_DIR
    loaded = boot.load_record()
    assert loaded.role == "worker" and loaded.argv == argv
    assert loaded.env == {"RAY_HEAD_IP": "10.0.0.1", "RAY_enable_autoscaler_v2": "1"}  # never the token
    assert loaded.nofile == resource.getrlimit(resource.RLIMIT_NOFILE)
    assert boot.gcs_address_of(loaded.argv) == "10.0.0.1:6379"
    assert boot.gcs_address_of(["ray", "start", "--address", "h:1"]) == "h:1"
    assert boot.gcs_address_of(["ray", "start", "--head"]) is None


def test_boot_record_runs_the_command_and_passes_on_its_status(home):
    assert main(["boot", "--record", "head", "--", sys.executable, "-c", "import sys; sys.exit(3)"]) == 3
    assert boot.load_record().argv == [sys.executable, "-c", "import sys; sys.exit(3)"]
    assert main(["boot", "--record", "head"]) == 1  # no command


def test_a_boot_with_nothing_recorded_exits_with_the_status_the_service_does_not_restart_on(home, capsys):
    assert main(["boot"]) == boot.NOTHING_RECORDED
    assert "no start recorded for this machine" in capsys.readouterr().err


def test_a_worker_whose_head_does_not_answer_exits_for_systemd_to_try_again(home, capsys):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    boot.save_record(boot.make_record("worker", ["ray", "start", f"--address=127.0.0.1:{closed}"], {}))
    assert main(["boot", "--wait", "0"]) == 1
    assert f"the head's GCS at 127.0.0.1:{closed} did not answer within 0 s" in capsys.readouterr().err


def test_the_replay_is_ray_stop_then_the_recorded_command_with_the_launchers_variables(home):
    record = boot.make_record("head", ["env", "X=1", "ray", "start", "--head"], {"RAY_CLOUD_INSTANCE_ID": "10.0.0.1"})
    ran, start_status = [], 0

    def run(cmd, env, cwd, check):
        ran.append((cmd, env.get("RAY_CLOUD_INSTANCE_ID"), cwd))
        return subprocess.CompletedProcess(cmd, start_status if cmd == record.argv else 0)

    boot.start_ray(record, run)
    assert ran == [(["ray", "stop"], "10.0.0.1", str(home)), (record.argv, "10.0.0.1", str(home))]
    start_status = 1
    with pytest.raises(boot.BootError, match="failed with status 1"):
        boot.start_ray(record, run)


def test_the_head_waits_for_cluster_yamls_workers(home):
    assert boot.expected_nodes() == 1
    (home / boot.BOOTSTRAP_CONFIG).write_text(json.dumps({"provider": {"type": "local", "worker_ips": ["a", "b"]}}))
    assert boot.expected_nodes() == 3
    clock, seen = Clock(), iter([1, 2, 3])
    assert boot.poll_until(lambda: next(seen) >= 3, 900, 5, clock=clock, sleep=clock.sleep) and clock.now == 10
    clock = Clock()
    assert not boot.poll_until(lambda: False, 12, 5, clock=clock, sleep=clock.sleep) and clock.now == 12


def test_the_head_joins_the_instance_it_started_not_another_on_the_machine(monkeypatch):
    """The boot's Ray is the one at its start command's port, among others on the machine (a
    colleague's, a test suite's); none there after the start is an error naming the command."""
    from raymcn.train.on_ray import cluster

    monkeypatch.setattr(cluster, "running_instances", lambda: ["10.0.0.1:41000", "10.0.0.1:6379", "10.0.0.1:52000"])
    record = boot.make_record("head", ["env", "X=1", "ray", "start", "--head", "--port=6379"], {})
    assert boot.started_instance(record) == ("10.0.0.1:6379", "started by this boot: this machine's Ray instance "
                                                               "at port 6379")
    record = boot.make_record("head", ["ray", "start", "--head", "--port", "7000"], {})
    with pytest.raises(boot.BootError, match=r"no Ray instance runs on this machine at port 7000 after its start "
                                             r"\(`ray start --head --port 7000`\)"):
        boot.started_instance(record)
    monkeypatch.setattr(cluster, "running_instances", lambda: ["10.0.0.1:6379"])
    assert boot.started_instance(boot.make_record("head", ["ray", "start", "--head"], {}))[0] == "10.0.0.1:6379"


def test_the_continued_sweep_joins_the_boots_cluster_by_its_address(tmp_path, monkeypatch):
    """The sweep's driver is told the cluster's address, so it joins it whatever its environment
    says (a raymcn command named by nothing would start a Ray instance of its own)."""
    exp = make_sweep(tmp_path, "sweep-a", 1000)
    ran = []
    monkeypatch.setattr(boot, "tee", lambda command, log, cwd: ran.append(command) or 0)
    assert boot.continue_sweep(str(tmp_path), say=lambda _: None, home=tmp_path, address="10.0.0.1:6379") == 0
    assert ran == [[sys.executable, "-m", "raymcn.cli", "sweep", "--resume", exp, "--address", "10.0.0.1:6379"]]


def test_the_driver_output_goes_to_the_terminal_and_the_sweeps_log(tmp_path, capfd):
    log = boot.boot_log(str(tmp_path / "sweep"))
    assert log == tmp_path / "sweep" / boot.BOOT_LOG_FILE
    assert boot.tee([sys.executable, "-c", "print('trial a'); print('Answer: b')"], log, tmp_path) == 0
    assert boot.tee([sys.executable, "-c", "import sys; sys.exit(4)"], log, tmp_path) == 4
    text = log.read_text()
    assert "trial a\nAnswer: b\n" in text and text.count("--- raymcn boot") == 2
    assert "Answer: b" in capfd.readouterr().out


def test_the_service_file_runs_the_boot_and_drains_at_stop():
    text = boot.unit_text("lab", Path("/home/lab"), deadline_s=300)
    lines = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    assert lines["User"] == "lab"
    assert lines["ExecStart"] == "/bin/bash -c 'source /home/lab/.raymcn_env && exec raymcn boot'"
    assert lines["ExecStop"] == "/bin/bash -c 'source /home/lab/.raymcn_env && exec raymcn drain --deadline 300'"
    assert int(lines["TimeoutStopSec"]) > 300 and lines["RestartPreventExitStatus"] == str(boot.NOTHING_RECORDED)


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="needs systemd-analyze")
def test_systemd_accepts_the_service_file(tmp_path):
    def warnings(text: str) -> str:
        unit = tmp_path / boot.UNIT_NAME
        unit.write_text(text)
        return subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True).stderr

    text = boot.unit_text(os.environ.get("USER") or "root", Path.home())
    assert warnings(text) == ""
    assert "Unknown key" in warnings(text.replace("Restart=", "Restrt="))  # the check can fail


def test_install_writes_reloads_and_enables_through_sudo_unless_root():
    unit = str(boot.UNIT_DIR / boot.UNIT_NAME)
    assert boot.install_commands(euid=0) == [["tee", unit], ["systemctl", "daemon-reload"],
                                             ["systemctl", "enable", boot.UNIT_NAME]]
    assert all(c[:2] == ["sudo", "-n"] for c in boot.install_commands(euid=1000) + boot.uninstall_commands(euid=1000))
    ran = []

    def run(cmd, input, text, capture_output):
        ran.append((cmd, input))
        return subprocess.CompletedProcess(cmd, 1 if cmd[-1] == "daemon-reload" else 0, "", "sudo: a password is required")

    with pytest.raises(boot.BootError, match="password is required.*password-less sudo"):
        boot._run_all(boot.install_commands(euid=1000), "UNIT", run)
    assert ran[0] == (["sudo", "-n", "tee", unit], "UNIT") and len(ran) == 2
