"""The cluster launcher configs validate against Ray's own schema, offline.

Recipe: ``prepare_config`` (merges the provider's ``defaults.yaml``; for ``local`` it also
injects the single ``local.cluster.node`` type and moves the top-level ``min_workers``), then
``jsonschema.Draft7Validator`` over ``ray/autoscaler/ray-schema.json`` collecting every error,
then ``validate_config`` (schema + head type exists + worker counts). The raw YAML is not what
``ray up`` validates, so it is not what we validate either. For GCP, ``prepare_config`` only
reads ``ray/autoscaler/gcp/defaults.yaml``. The ``offline`` fixture proves that no socket is
opened and no cloud SDK is imported.
"""

from __future__ import annotations

import json
import re
import socket
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")
ray_autoscaler = pytest.importorskip("ray.autoscaler")
from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402  (private API)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "local": ROOT / "cluster.yaml",
    "gcp": ROOT / "sweeps" / "clusters" / "gcp-a2-highgpu-4g.yaml",
}
SCHEMA = json.loads((Path(ray_autoscaler.__file__).parent / "ray-schema.json").read_text())
RAY_PIN = re.compile(r"ray\[([a-z,]+)\]==2\.60\.0")
# A pip requirement naming ray, e.g. `ray`, "ray[default]", ray==2.60.0, 'ray[train]>=2'.
RAY_REQUIREMENT = re.compile(r"""(?<![\w./-])ray(?:\[[^\]]*\])?(?:[=<>!~]=?[\w.*]+)?(?=["'\s]|$)""")
# Cloud SDKs, by package (not "google": protobuf, imported lazily by Ray itself, lives there too)
CLOUD_SDKS = ("googleapiclient", "google.cloud", "google.auth", "google.oauth2", "boto3", "botocore", "azure")


def load(name: str) -> dict:
    return yaml.safe_load(CONFIGS[name].read_text())


def schema_errors(config: dict) -> list[str]:
    """Every schema violation, each prefixed by its JSON path, not just the first."""
    validator = jsonschema.Draft7Validator(SCHEMA)
    return sorted(f"{'/'.join(map(str, e.absolute_path)) or '<top>'}: {e.message}"
                  for e in validator.iter_errors(config))


@pytest.fixture
def offline(monkeypatch):
    """Fail on any network use or cloud SDK import while the test body runs."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"cluster-config validation tried to reach the network: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    before = set(sys.modules)
    yield
    imported = sorted(m for m in set(sys.modules) - before
                      if any(m == sdk or m.startswith(sdk + ".") for sdk in CLOUD_SDKS))
    assert not imported, f"validation imported cloud SDK modules: {imported}"


@pytest.mark.parametrize("name", CONFIGS)
def test_config_is_valid_for_ray_up(name, offline):
    prepared = prepare_config(load(name))
    assert schema_errors(prepared) == []
    validate_config(prepared)  # also: head_node_type exists, sum(min_workers) <= max_workers


def test_local_config_is_a_plain_on_prem_config(offline):
    raw = load("local")
    # prepare_local aborts on these fields for on-prem clusters.
    for field in ("available_node_types", "head_node_type", "head_node", "worker_nodes"):
        assert field not in raw, f"{field} is not allowed with the local provider"
    prepared = prepare_config(raw)
    (node_type,) = prepared["available_node_types"]
    assert node_type == "local.cluster.node"
    workers = len(raw["provider"]["worker_ips"])
    assert prepared["available_node_types"][node_type]["min_workers"] == workers
    assert prepared["max_workers"] == workers


@pytest.mark.parametrize("name", CONFIGS)
def test_typo_key_is_rejected_by_name(name, offline, tmp_path):
    text = CONFIGS[name].read_text()
    typo, count = re.subn(r"^setup_commands:", "setup_comands:", text, flags=re.MULTILINE)
    assert count == 1
    copy_path = tmp_path / CONFIGS[name].name
    copy_path.write_text(typo)
    prepared = prepare_config(yaml.safe_load(copy_path.read_text()))
    errors = schema_errors(prepared)
    assert any("setup_comands" in e and "unexpected" in e for e in errors), errors
    with pytest.raises(jsonschema.ValidationError, match="setup_comands"):
        validate_config(prepared)


def test_local_declares_four_gpus_on_every_node():
    # The local provider passes no resource override to `ray start` (node type resources are
    # {}), so the start commands are where the 4 GPUs are declared.
    raw = load("local")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in raw[key] if "ray start" in c]
        assert starts, key
        for command in starts:
            assert re.search(r"--num-gpus[= ]4(?!\d)", command), (key, command)
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in raw["head_start_ray_commands"][-1]
    assert "$RAY_HEAD_IP:6379" in raw["worker_start_ray_commands"][-1]


def recorded_start(role: str) -> list[str]:
    """The command cluster.yaml's last start command of ``role`` runs through `raymcn boot --record
    ROLE -- COMMAND` (which keeps it for the boot service), as the real command-line parser reads it."""
    import shlex

    from raymcn.cli import build_parser

    ulimit, boot = load("local")[f"{role}_start_ray_commands"][-1].split(";", 1)
    assert "ulimit -n 65536" in ulimit  # recorded with the command: the open-files limit in effect
    words = shlex.split(boot)
    assert words[0] == "raymcn", boot
    args = build_parser().parse_args(words[1:])
    assert args.command == "boot" and args.record == role and args.start_command[0] == "--", boot
    return args.start_command[1:]


def test_start_commands_record_themselves_for_the_boot_service():
    """cluster.yaml stays the one place of the start commands: each `ray start` runs through
    `raymcn boot --record`, and the boot service replays what `ray up` last ran."""
    for role in ("head", "worker"):
        command = recorded_start(role)
        assert command[command.index("ray"):][:2] == ["ray", "start"], command
    assert "--head" in recorded_start("head") and "--head" not in recorded_start("worker")


def _env_and_flags(command: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """(what `env` sets before `ray start`, ray start's --flag=value options)."""
    assert command[0] == "env", command
    ray = command.index("ray")
    env = dict(w.split("=", 1) for w in command[1:ray])
    flags = dict(w[2:].split("=", 1) for w in command[ray + 2:] if w.startswith("--") and "=" in w)
    return env, flags


def test_the_daemons_are_pinned_to_this_cluster():
    """A second Ray instance on a server (a colleague's run, a `make test`) must not confuse Ray Train's
    placement-group cleaner, which asks the State API without an address: the head's daemons name
    their own dashboard (whose port is given, so Ray refuses a taken one instead of moving it), the
    workers' daemons the head's GCS. What `ray start` has in its environment every process the raylet
    starts inherits (docs/cluster.md)."""
    env, flags = _env_and_flags(recorded_start("head"))
    assert env == {"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{flags['dashboard-port']}"}
    assert flags["dashboard-port"] == "8265" and flags["port"] == "6379"
    env, flags = _env_and_flags(recorded_start("worker"))
    assert env == {"RAY_ADDRESS": flags["address"]} and flags["address"] == "$RAY_HEAD_IP:6379"


def test_the_boot_service_is_off_unless_its_line_is_uncommented():
    raw = load("local")
    text = CONFIGS["local"].read_text()
    assert not [c for key in ("setup_commands", "head_setup_commands", "worker_setup_commands")
                for c in raw[key] if "boot --install" in c]
    assert re.search(r"^  # - raymcn boot --install$", text, flags=re.MULTILINE)  # one uncommenting away


def test_gcp_declares_a2_highgpu_4g_resources():
    raw = load("gcp")
    types = raw["available_node_types"]
    gpu = [t for t in types.values() if t["node_config"].get("machineType") == "a2-highgpu-4g"]
    assert len(gpu) == 1
    assert gpu[0]["resources"] == {"CPU": 48, "GPU": 4}
    assert gpu[0]["node_config"]["scheduling"] == [{"onHostMaintenance": "TERMINATE"}]
    assert types[raw["head_node_type"]]["resources"].get("GPU", 0) == 0
    assert raw["provider"]["project_id"]


def test_gcp_head_keeps_the_gcp_api_client(offline):
    # Setting head_setup_commands replaces Ray's default, which installs the client that the
    # head's autoscaler needs to launch GPU workers.
    prepared = prepare_config(load("gcp"))
    assert any("google-api-python-client" in c for c in prepared["head_setup_commands"])


@pytest.mark.parametrize("name", CONFIGS)
def test_setup_pins_ray_and_installs_the_mounted_repo(name, offline):
    raw = load(name)
    pins = [m for c in raw["setup_commands"] for m in RAY_PIN.finditer(c)]
    assert pins, "setup_commands must pin ray[...]==2.60.0"
    for pin in pins:
        # ray[default] brings the State API that frees stopped trials' GPUs.
        assert {"default", "train", "tune"} <= set(pin.group(1).split(",")), pin.group(0)
    # Not ~/raymcn: `ray submit` runs from ~, where a folder "raymcn" would shadow the package.
    assert raw["file_mounts"]["~/raymcn-src"] == "." and "~/raymcn" not in raw["file_mounts"]
    prepared = prepare_config(raw)
    for key in ("head_setup_commands", "worker_setup_commands"):
        installs = [c for c in prepared[key] if "pip install" in c]
        named = [r.strip("\"'") for c in installs for r in RAY_REQUIREMENT.findall(c)]
        assert named and all(RAY_PIN.fullmatch(r) for r in named), (key, named)  # no unpinned ray
        assert any(re.search(r"pip install.* -e ~/raymcn-src(\s|$)", c) for c in installs), key


@pytest.mark.parametrize("name", CONFIGS)
def test_submit_command_resolves_on_the_head(name):
    # `ray submit CFG sweep.py -- --config sweeps/stage_order_bohb.yaml` runs in the head's home
    # directory, so sweeps/ must be mounted at ~/sweeps; local paths are relative to the repo root.
    mounts = load(name)["file_mounts"]
    assert (ROOT / mounts["~/raymcn-src"] / "sweep.py").is_file()
    assert (ROOT / mounts["~/sweeps"] / "stage_order_bohb.yaml").is_file()
    assert mounts["~/.ray/auth_token"] == "~/.ray/auth_token"  # one token on every node


@pytest.mark.parametrize("name", CONFIGS)
def test_node_environment_matches_the_lab_sweep(name):
    """RAYMCN_SHARDS is where stage_order_bohb.yaml's shards are; its results go to RAYMCN_RESULTS
    (a shared folder or a bucket), which the sweep files leave to the node environment."""
    env = {}
    for command in load(name)["setup_commands"]:
        m = re.fullmatch(r"echo 'export (\w+)=([^']*)' >>? ~/\.raymcn_env", command.strip())
        if m:
            env[m.group(1)] = m.group(2)
    sweep = yaml.safe_load((ROOT / "sweeps" / "stage_order_bohb.yaml").read_text())
    assert env["RAYMCN_SHARDS"] == sweep["data"]["shards"]
    assert not (sweep.get("run") or {}).get("storage_path") and env["RAYMCN_RESULTS"]
    assert env["RAYMCN_RESULTS"].startswith(("/", "s3://", "gs://"))
    assert env["RAY_AUTH_MODE"] == "token"
    # raymcn's commands there (the submitted sweep, `ray exec ... raymcn doctor`, drain, the boot
    # service) join the cluster; anywhere else nothing names one, and a command runs a Ray of its own
    assert env["RAY_ADDRESS"] == "auto"



def test_the_cluster_smoke_sweep_reads_what_the_real_sweep_reads():
    """The lab's guide edits data.shards and data.eval_set in both files; the smoke sweep proves the
    cluster only if it reads the same inputs, with the same trial size and concurrency."""
    real, smoke = (yaml.safe_load((ROOT / "sweeps" / name).read_text())
                   for name in ("stage_order_bohb.yaml", "cluster_smoke.yaml"))
    for section, key in [("data", "shards"), ("data", "eval_set"), ("scale", "num_workers"), ("scale", "use_gpu"),
                         ("sweep", "max_concurrent")]:
        assert smoke[section][key] == real[section][key], f"{section}.{key}"
    assert not (smoke.get("run") or {}).get("storage_path")


# --- the setup commands, run as Ray's updater runs them ----------------------------------------------------
STAND_IN_PYTHON = """#!/bin/sh
# python, as the setup commands call it: the install steps pass; the check (tools.install_torch --check)
# compares the GPUs torch sees (TORCH_SEES) with those nvidia-smi lists, as the real check does
case "$*" in
  *"tools.install_torch --check"*)
    shown=$(nvidia-smi -L | grep -c '^GPU')
    if [ "$TORCH_SEES" -lt "$shown" ]; then
      echo "torch installed: sees $TORCH_SEES of the $shown GPUs nvidia-smi shows [server $(hostname)]" >&2; exit 1
    fi
    echo "torch installed: sees $shown of the $shown GPUs nvidia-smi shows";;
  *) echo "ray 2.60.0 torch 2.13.0";;
esac
"""


def updater_home(home: Path) -> dict[str, str]:
    """A home for the setup commands with stand-ins where they would install or touch the machine:
    the venv they create (its ``python``: :data:`STAND_IN_PYTHON`; ``pip``), ``nvidia-smi`` listing
    4 GPUs, and ``sudo``, ``gcloud``, ``blkid`` and ``mountpoint`` (the Google Cloud variant's disk
    steps) that do nothing. The environment to run them in."""
    bin_dir = home / "raymcn-venv" / "bin"
    bin_dir.mkdir(parents=True)
    (home / "raymcn-src").mkdir()
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    scripts = {"python": STAND_IN_PYTHON, "pip": "#!/bin/sh\n", "sudo": "#!/bin/sh\n", "gcloud": "#!/bin/sh\n",
               "blkid": "#!/bin/sh\n", "mountpoint": "#!/bin/sh\n",
               "nvidia-smi": "#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA A100-SXM4-80GB'\n" for i in range(4))}
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"HOME": str(home), "PATH": "/usr/bin:/bin", "TERM": "dumb"}


def run_setup(name: str, home: Path, torch_sees: int) -> list[tuple[str, int, str]]:
    """(command, status, output) of each of ``name``'s setup commands, in order, up to the first
    that fails: Ray's updater runs each through its own login shell (its ``_with_interactive``:
    ``bash --login -c -i 'source ~/.bashrc; ... && (COMMAND)'``, sent over SSH as one string) and
    stops the server's setup at the first non-zero status."""
    import subprocess

    from ray.autoscaler._private.command_runner import _with_interactive  # noqa: PLC0415  (private API)

    env = {**updater_home(home), "TORCH_SEES": str(torch_sees)}
    ran = []
    for command in load(name)["setup_commands"]:
        done = subprocess.run(" ".join(_with_interactive(command)), shell=True, executable="/bin/bash", env=env,
                              capture_output=True, text=True, timeout=60)
        ran.append((command, done.returncode, done.stdout + done.stderr))
        if done.returncode:
            break
    return ran


@pytest.mark.parametrize("name", CONFIGS)
def test_ray_up_stops_a_server_whose_torch_sees_fewer_gpus_and_only_warns_about_its_shards(name, tmp_path):
    """Every setup command of the file, run as Ray's updater runs them, with stand-ins for the
    installs, nvidia-smi (4 GPUs) and the check; the shards path is missing here. A torch that
    sees all 4: every command exits 0 (the missing shards are a warning naming the server). One
    that sees 2: the check's command exits non-zero, which fails `ray up` on that server."""
    import socket as sockets

    ran = run_setup(name, tmp_path / "sees-all", torch_sees=4)
    assert [status for _, status, _ in ran] == [0] * len(load(name)["setup_commands"]), ran[-1]
    said = "".join(out for _, _, out in ran)
    assert f"WARNING: {sockets.gethostname()} cannot see RAYMCN_SHARDS=/data/howto100m/shards" in said
    assert "sees 4 of the 4 GPUs" in said

    ran = run_setup(name, tmp_path / "sees-fewer", torch_sees=2)
    command, status, out = ran[-1]
    assert status != 0 and "install_torch --check" in command, ran[-1]
    assert "sees 2 of the 4 GPUs nvidia-smi shows" in out


def test_ray_up_stops_a_server_whose_python3_is_outside_the_range_before_installing_anything(tmp_path):
    """The venv's command, run as Ray's updater runs it on a server without the venv whose python3
    is older than the range (Ubuntu 20.04's 3.8, say): it exits non-zero naming that Python and the
    range, and no venv is made (so nothing is downloaded into one)."""
    import shutil
    import subprocess

    from ray.autoscaler._private.command_runner import _with_interactive  # noqa: PLC0415  (private API)

    versions = Path.home() / ".pyenv" / "versions"
    old = sorted(versions.glob("3.[5-9].*/bin/python3"))
    if not old:
        pytest.skip("no Python 3.9 or older in pyenv here")
    (command,) = [c for c in load("local")["setup_commands"] if "-m venv" in c]
    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    home.mkdir()
    bin_dir.mkdir()
    (home / "raymcn-src").symlink_to(ROOT)  # what `ray up`'s file mounts give the server
    for tool in ("bash", "sh", "sed", "dirname", "grep", "head", "sort", "tail", "cat"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    (bin_dir / "python3").symlink_to(old[-1])
    # the server's PATH as its ~/.bashrc leaves it (the updater's login shell sources it last): no
    # Python of the range on it
    (home / ".bashrc").write_text(f'export PATH="{bin_dir}"\n')
    env = {"HOME": str(home), "PATH": str(bin_dir), "TERM": "dumb", "RAYMCN_VENV": str(home / "raymcn-venv")}
    done = subprocess.run(" ".join(_with_interactive(command)), shell=True, executable="/bin/bash", env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0, done.stdout + done.stderr
    assert not (home / "raymcn-venv").exists()
    range_ = re.search(r'requires-python = "([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert re.search(rf"python3: Python 3\.[5-9]\.\d+, outside raymcn's range \({re.escape(range_)}", done.stderr), \
        done.stderr
