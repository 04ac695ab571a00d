"""The lab's own commands, for real: `ray up`, `ray submit --tmux cluster.yaml sweep.py -- ...` (the
README's), a sweep interrupted and resumed with `ray submit ... -- --resume latest`, the head's
reboot with the boot service's command continuing the unfinished sweep (and leaving a finished and
a stopped one alone), `raymcn drain`, and `ray down`, over SSH; one `ray up` for all of them.
(Beside a Ray instance of someone else's the tier stands aside: tests/test_launcher_safety.py.)

The project's own cluster.yaml is filled in for one head on 127.0.0.1 (placeholders and paths
only; the setup and start commands run as written) and the launcher reaches it through an sshd
of this test's own: its own config, host key, authorized key and port-22 listener on the
loopback, so neither ~/.ssh nor a system sshd is touched. The head's "venv" is a fresh venv that
sees this test environment's packages through a .pth file, so the setup commands' pip steps
find everything installed and install raymcn itself, editable, from the mounted ~/raymcn-src.

What `ray up` writes into the home folder (~/.raymcn_env, the ~/.bashrc line, the mounts, the
bootstrap files) is removed afterwards and ~/.bashrc is restored byte for byte; sshd is stopped.
Needs root, sshd, rsync and tmux (`.ci/run` installs them); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from conftest import last_json, stop_shared_ray
from tune_dirs import result_rows, trial_statuses

from raymcn.servers import sweeps

pytestmark = [pytest.mark.launcher, pytest.mark.slow, pytest.mark.timeout(1800)]
REPO = Path(__file__).resolve().parents[1]
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
RAY = str(Path(sys.executable).with_name("ray"))
HOME = Path.home()


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def running_ray() -> str | None:
    """A Ray instance already running on this machine ("gcs_server pid N"), or None. The suite's
    own instance is shut down before this is asked (``conftest.stop_shared_ray``)."""
    for comm in sorted(Path("/proc").glob("[0-9]*/comm")):
        try:
            name = comm.read_text().strip()
        except OSError:  # the process ended while we looked
            continue
        if name in ("gcs_server", "raylet"):
            return f"{name} pid {comm.parent.name}"
    return None


RUNNING_RAY = "a Ray instance is running on this machine"


def _skip_reason() -> str | None:
    running = running_ray()
    if running:  # e.g. `make test` on a cluster head: never end the lab's running sweep
        return (f"{RUNNING_RAY} ({running}): `ray up` and `ray down` run `ray stop`, which would end it; "
                "the launcher tier runs only where no Ray runs (CI, a laptop)")
    if os.geteuid() != 0:
        return "the launcher tier logs in as root over SSH on 127.0.0.1 and needs root"
    if not (os.path.exists(SSHD) and shutil.which("rsync") and shutil.which("ssh") and shutil.which("tmux")):
        return "needs sshd, ssh, rsync and tmux (apt-get install openssh-server rsync tmux; .ci/run installs them)"
    if _port_open(22):
        return "port 22 on 127.0.0.1 is taken: this test runs its own sshd there"
    return None


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """An sshd of this test's own on 127.0.0.1:22; yields (private key, work folder)."""
    stop_shared_ray()  # the suite's own Ray instance is not the lab's: ours to stop, and started again after
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("launcher")
    for name in ("host_key", "id_ed25519"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(work / name)], check=True)
    shutil.copy(work / "id_ed25519.pub", work / "authorized_keys")
    (work / "sshd_config").write_text(
        f"Port 22\nListenAddress 127.0.0.1\nHostKey {work}/host_key\nPidFile {work}/sshd.pid\n"
        f"AuthorizedKeysFile {work}/authorized_keys\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nStrictModes no\nUsePAM no\n"
        "Subsystem sftp internal-sftp\n")
    privsep = Path("/run/sshd")  # sshd refuses to start without it
    made_privsep = not privsep.exists()
    privsep.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(work / "sshd_config")],
                            stdout=open(work / "sshd.log", "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 20
        while not _port_open(22):
            assert proc.poll() is None, (work / "sshd.log").read_text()
            assert time.time() < deadline, "sshd did not listen within 20 s"
            time.sleep(0.2)
        yield work / "id_ed25519", work
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if made_privsep:
            shutil.rmtree(privsep, ignore_errors=True)


@pytest.fixture(scope="module")
def home_restored():
    """Everything `ray up` / `ray submit` add to the home folder is removed afterwards, and
    ~/.bashrc and ~/.ray/auth_token are as they were."""
    before = set(os.listdir(HOME))
    bashrc = HOME / ".bashrc"
    saved_bashrc = bashrc.read_bytes() if bashrc.exists() else None
    token = HOME / ".ray" / "auth_token"
    had_token = token.exists()
    yield
    for name in set(os.listdir(HOME)) - before:
        path = HOME / name
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    if saved_bashrc is None:
        bashrc.unlink(missing_ok=True)
    else:
        bashrc.write_bytes(saved_bashrc)
    if not had_token:
        token.unlink(missing_ok=True)
    assert set(os.listdir(HOME)) == before


def _cluster_venv(work: Path) -> Path:
    """A venv whose own site-packages start empty but which sees this environment's packages."""
    venv = work / "cluster-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "test-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # The `ray` command, as installing ray into the venv would have created it.
    ray = venv / "bin" / "ray"
    ray.write_text(f"#!{venv}/bin/python\nimport sys\nfrom ray.scripts.scripts import main\nsys.exit(main())\n")
    ray.chmod(0o755)
    return venv


def _filled_cluster_yaml(key: Path, work: Path, venv: Path) -> Path:
    """The project's cluster.yaml, its placeholders and site paths filled in for 127.0.0.1."""
    text = (REPO / "cluster.yaml").read_text()
    fills = {
        "head_ip: HEAD_IP_PLACEHOLDER": "head_ip: 127.0.0.1",
        "    - WORKER_IP_1_PLACEHOLDER\n": "",
        "  worker_ips:\n": "  worker_ips: []\n",
        "min_workers: 1": "min_workers: 0",
        "max_workers: 1": "max_workers: 0",
        "ssh_user: SSH_USER_PLACEHOLDER": "ssh_user: root",
        "ssh_private_key: ~/.ssh/id_ed25519": f"ssh_private_key: {key}",
        "export RAYMCN_VENV=$HOME/raymcn-venv": f"export RAYMCN_VENV={venv}",
        "export RAYMCN_SHARDS=/data/howto100m/shards": f"export RAYMCN_SHARDS={work}/shards",
        "export RAYMCN_RESULTS=/shared/raymcn_results": f"export RAYMCN_RESULTS={work}/results",
        "export RAYMCN_CACHE=$HOME/.cache/raymcn": f"export RAYMCN_CACHE={work}/cache",
    }
    for placeholder, value in fills.items():
        assert placeholder in text, f"cluster.yaml no longer has {placeholder!r}"
        text = text.replace(placeholder, value)
    assert not [line for line in text.splitlines() if "PLACEHOLDER" in line.split("#")[0]]
    out = work / "cluster.yaml"
    out.write_text(text)
    return out


def _ray(*args: str, timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    """A `ray` launcher command, run from the repository root as the README says."""
    return subprocess.run([RAY, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, **kw)



def _tmux_sessions() -> set[str]:
    listed = subprocess.run(["tmux", "ls", "-F", "#{session_name}"], capture_output=True, text=True)
    return set(listed.stdout.split()) if listed.returncode == 0 else set()


@pytest.fixture(scope="module")
def cluster(sshd, home_restored):
    """One `ray up` of the project's cluster.yaml for the module (it costs minutes), `ray down` after
    it; yields (the filled cluster.yaml, the work folder)."""
    key, work = sshd
    sessions = _tmux_sessions()
    (HOME / ".ray").mkdir(exist_ok=True)
    assert _ray("get-auth-token", "--generate", timeout=60).returncode == 0  # the laptop's one-time step
    config = _filled_cluster_yaml(key, work, _cluster_venv(work))
    try:
        up = _ray("up", "-y", str(config), timeout=900)
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        yield config, work
    finally:
        down = _ray("down", "-y", str(config), timeout=300)
        for session in _tmux_sessions() - sessions:  # the --tmux submits' sessions (their shells stay open)
            subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]
    left = subprocess.run(["pgrep", "-f", "gcs_server|raylet"], capture_output=True, text=True).stdout.split()
    assert not left, f"Ray processes left after `ray down`: {left}"


EPOCHS = ["--set", "schedule.epochs=2"]  # the smoke sweep, shortened: 2 trials of 2 epochs
PINNED = ("import os, ray; ray.init(log_to_driver=False); "
          "print('pinned:', ray.get(ray.remote(num_cpus=0)(lambda: os.environ.get('RAY_API_SERVER_ADDRESS')).remote()))")


def _submit_and_kill(config: Path, name: str, until) -> None:
    """The README's `ray submit --tmux` of the smoke sweep named ``name``; its driver SIGKILLed (the
    head's reboot, for the driver) once ``until()`` holds."""
    submitted = _ray("submit", "--tmux", str(config), "sweep.py", "--", "--config", "sweeps/smoke.yaml",
                     "--set", f"run.name={name}", *EPOCHS)
    assert submitted.returncode == 0, submitted.stdout[-4000:] + submitted.stderr[-4000:]
    try:
        deadline = time.time() + 600
        while not until():
            assert time.time() < deadline, f"the sweep {name} in tmux did not get there in time"
            time.sleep(1)
    finally:
        subprocess.run(["pkill", "-KILL", "-f", f"sweep.py --config sweeps/smoke.yaml --set run.name={name}"])


def _a_trial_finished(exp: Path):
    return lambda: "TERMINATED" in trial_statuses(exp).values()


def test_ray_up_installs_raymcn_and_pins_the_head(cluster):
    config, work = cluster
    # A script of the user's own, run from the home folder, imports the installed package.
    own = _ray("exec", str(config), "cd ~ && python -c 'import raymcn.cli as c; print(c.__file__)'")
    assert own.returncode == 0 and "/raymcn-src/raymcn/cli.py" in own.stdout, own.stdout[-2000:]
    # The head's daemons are pinned to their own State API: every process its raylet starts has it.
    (work / "pinned.py").write_text(PINNED)
    pinned = _ray("exec", str(config), f"cd ~ && python {work}/pinned.py")
    assert "pinned: http://127.0.0.1:8265" in pinned.stdout, pinned.stdout[-2000:] + pinned.stderr[-2000:]
    # ... and the start command recorded itself for the boot service: what `ray up` ran, with its variables.
    (record,) = (HOME / ".raymcn_boot").glob("*.json")
    recorded = json.loads(record.read_text())
    assert recorded["role"] == "head" and recorded["argv"][:2] == ["env", "RAY_API_SERVER_ADDRESS=http://127.0.0.1:8265"]
    assert recorded["env"]["RAY_CLOUD_INSTANCE_ID"] == "127.0.0.1"


@pytest.mark.soak  # the boot service's test below resumes the same way, without the hand
def test_a_killed_sweep_resumed_by_hand(cluster):
    """The documented command, verbatim (plus a shorter schedule and a name to find it by): in a tmux
    session on the head, so it outlives the laptop's SSH connection; `ray submit` returns at once. Its
    driver then dies after the first trial (the head's reboot) and the one-line recovery continues it."""
    config, work = cluster
    interrupted = work / "results" / "interrupted"
    _submit_and_kill(config, "interrupted", _a_trial_finished(interrupted))
    assert not (interrupted / "best_by_stage_order.png").exists(), "the sweep ended before it could be killed"
    assert sweeps.state(str(interrupted)) == "unfinished"
    finished = [t for t, s in trial_statuses(interrupted).items() if s == "TERMINATED"]
    before = result_rows(interrupted)
    resumed = _ray("submit", str(config), "sweep.py", "--", "--resume", "latest", "--json")
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    assert last_json(resumed.stdout)["experiment_dir"] == str(interrupted)
    after = result_rows(interrupted)
    assert set(trial_statuses(interrupted).values()) == {"TERMINATED"} and len(after) == 2
    for t in finished:
        assert after[t] == before[t] == [1, 2]  # kept, not rerun
    assert (interrupted / "best_by_stage_order.png").exists()
    assert sweeps.state(str(interrupted)) == "finished"  # so a boot never continues it


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def _exec_start(config: Path) -> list[str]:
    """The service file's ExecStart, as `raymcn boot --install` would write it on the head."""
    unit = _ray("exec", str(config), "raymcn boot --unit")
    assert unit.returncode == 0, unit.stdout[-2000:] + unit.stderr[-2000:]
    (line,) = [x for x in unit.stdout.splitlines() if x.startswith("ExecStart=")]
    return shlex.split(line.split("=", 1)[1])


@pytest.mark.soak  # minutes past CI's time; a killed sweep resumed by its folder: the rehearsals (slow tier)
def test_the_boot_service_continues_the_unfinished_sweep_after_the_head_reboots(cluster):
    """The head reboots mid-sweep: every Ray process and the sweep's driver die. At boot the service's
    command (the service file's ExecStart, run as systemd runs it: a bare environment, the home folder)
    starts Ray as `ray up` did and continues the newest sweep that is neither finished nor stopped on
    purpose: here an older one, because the newest was stopped with `raymcn sweep --stop latest`."""
    config, work = cluster
    results = work / "results"
    rebooted, stopped = results / "rebooted", results / "stopped-on-purpose"
    _submit_and_kill(config, "rebooted", _a_trial_finished(rebooted))
    finished = [t for t, s in trial_statuses(rebooted).items() if s == "TERMINATED"]
    before = result_rows(rebooted)
    _submit_and_kill(config, "stopped-on-purpose", lambda: (stopped / "raymcn_sweep.yaml").exists())
    marked = _ray("exec", str(config), "raymcn sweep --stop latest")
    assert marked.returncode == 0 and f"sweep {stopped} marked as stopped" in marked.stdout, marked.stdout[-2000:]
    untouched = {folder: _files(folder) for folder in (stopped, results / "interrupted")}
    command = _exec_start(config)

    # The reboot, as far as Ray and the sweep know it: every Ray process of the machine killed.
    subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)
    assert running_ray() is None
    boot_env = {"HOME": str(HOME), "USER": "root", "LOGNAME": "root", "SHELL": "/bin/bash",
                "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}  # what systemd gives it
    out = work / "boot.out"
    with open(out, "wb") as log:
        service = subprocess.Popen(command, cwd=HOME, env=boot_env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        deadline = time.time() + 600
        while sweeps.state(str(rebooted)) != "finished":
            assert service.poll() is None, out.read_text()[-4000:]
            assert time.time() < deadline, "the boot did not finish the sweep in time:\n" + out.read_text()[-4000:]
            time.sleep(2)
        said = out.read_text()
        assert f"continuing the sweep {rebooted}" in said, said[-4000:]
        after = result_rows(rebooted)
        assert set(trial_statuses(rebooted).values()) == {"TERMINATED"} and len(after) == 2
        for t in finished:
            assert after[t] == before[t] == [1, 2]  # kept, not rerun
        assert (rebooted / "best_by_stage_order.png").exists()  # the sweep's answer
        assert f"raymcn table {rebooted}" in (rebooted / "raymcn_boot.log").read_text()
        # The stopped sweep and the finished one are left alone, to the byte.
        assert {folder: _files(folder) for folder in untouched} == untouched
        assert sweeps.state(str(stopped)) == "stopped"
        # The Ray it started is the one `ray up` starts: pinned to its own State API.
        pinned = _ray("exec", str(config), f"cd ~ && python {work}/pinned.py")
        assert "pinned: http://127.0.0.1:8265" in pinned.stdout, pinned.stdout[-2000:] + pinned.stderr[-2000:]
    finally:
        service.terminate()  # its main process only: the drain test below uses the Ray it started
        service.wait(timeout=60)


def test_drain_before_a_planned_reboot(cluster):
    """`raymcn drain` on the head (without --reboot): its node found by IP, `ray drain-node` accepted."""
    config, _ = cluster
    drained = _ray("exec", str(config), "raymcn drain --deadline 20")
    assert drained.returncode == 0, drained.stdout[-3000:] + drained.stderr[-3000:]
    assert re.search(r"draining node [0-9a-f]{56} \(\S+\) of the cluster at \S+, deadline 20 s", drained.stdout)
    assert "no Ray Train worker on this node" in drained.stdout, drained.stdout[-2000:]
    # The planned reboot follows, and ends Ray on the server: here `ray stop`. Ray's autoscaler on the
    # head counts a drained node as stopped and terminates it in the cluster's state (its monitor.log:
    # RAY_STOPPED -> TERMINATING), so `ray down` no longer finds a head to run `ray stop` on.
    stopped = subprocess.run([RAY, "stop"], capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0, stopped.stdout[-2000:] + stopped.stderr[-2000:]
