"""``make install``'s torch for the machine's NVIDIA driver (tools/install_torch.py with
raymcn/doctor/driver.py), tested with a stand-in ``nvidia-smi`` on the PATH: no test downloads torch.
And the range pyproject.toml admits is the one the Makefile's two installs test."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from raymcn.doctor import driver
from tools import install_torch

ROOT = Path(__file__).resolve().parents[1]


def stand_in_nvidia_smi(folder: Path, cuda: str, gpus: int = 4, version: str = "535.104.05",
                        fails: str = "") -> Path:
    """An ``nvidia-smi`` that prints a real header for a driver running CUDA ``cuda`` at most and
    lists ``gpus`` A100s (``-L``); with ``fails``, one that exits 9 saying it."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"
    if fails:
        body = f"echo '{fails}'\nexit 9\n"
    else:
        listing = "".join(f"echo 'GPU {i}: NVIDIA A100-SXM4-80GB (UUID: GPU-{i:08d})'\n" for i in range(gpus))
        body = (f'if [ "$1" = "-L" ]; then\n{listing}exit 0\nfi\n'
                "echo '+-----------------------------------------------------------------------------+'\n"
                f"echo '| NVIDIA-SMI {version}    Driver Version: {version}    CUDA Version: {cuda}     |'\n"
                "echo '|-------------------------------+----------------------+----------------------+'\n")
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return folder


@pytest.fixture
def on_path(monkeypatch, tmp_path):
    """Put a stand-in nvidia-smi (``on_path(cuda=...)``) first on the PATH, or none (``on_path(None)``)."""
    def install(cuda: str | None, **kwargs):
        if cuda is None:
            monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi, and no other command
        else:
            folder = stand_in_nvidia_smi(tmp_path / "bin", cuda, **kwargs)
            monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return install


def test_a_driver_that_runs_cuda_12_2_gets_a_cuda_12_build_and_says_so(on_path, capsys):
    on_path("12.2")
    assert install_torch.main(["torch==2.13.0", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "the driver 535.104.05 runs CUDA 12.2 at most (nvidia-smi)" in out
    assert "pip's default index serves torch==2.13.0 as a CUDA 13 build: the CUDA 12.6 build" in out
    assert "would run: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126" in out


def test_a_driver_that_runs_cuda_12_8_gets_the_cuda_12_8_build(on_path, capsys):
    on_path("12.8", version="570.86.15")
    assert install_torch.main(["torch==2.13.0", "--dry-run"]) == 0
    assert "--index-url https://download.pytorch.org/whl/cu128" in capsys.readouterr().out


def test_a_driver_that_runs_cuda_13_gets_the_default_build(on_path, capsys):
    on_path("13.0", version="580.159.04")
    assert install_torch.main(["torch==2.13.0", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "the driver 580.159.04 runs CUDA 13.0 at most (nvidia-smi): the build pip's default index serves" in out
    assert out.rstrip().endswith("would run: pip install torch==2.13.0")


def test_a_release_that_pip_serves_as_a_cuda_12_build_comes_from_pips_index_on_a_cuda_12_driver(on_path, capsys):
    on_path("12.2")
    assert install_torch.main(["torch==2.3.1", "--dry-run"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("would run: pip install torch==2.3.1")


def test_no_nvidia_smi_gets_the_cpu_build(on_path, capsys):
    on_path(None)
    assert install_torch.main(["torch==2.13.0", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "no nvidia-smi here: the CPU build" in out and "--index-url https://download.pytorch.org/whl/cpu" in out


@pytest.mark.parametrize("cuda, says", [
    ("11.4", "needs CUDA 12 or later (a 525.60.13 driver or newer): update the NVIDIA driver"),
    ("", "nvidia-smi is here but says no CUDA version")])
def test_a_driver_no_tested_torch_runs_stops_saying_what_to_do(on_path, capsys, cuda, says):
    on_path(cuda)
    assert install_torch.main(["torch==2.13.0", "--dry-run"]) == 1
    assert says in capsys.readouterr().err


def test_a_failing_nvidia_smi_is_named_not_taken_for_a_cpu_machine(on_path, capsys):
    on_path("12.2", fails="Failed to initialize NVML: Driver/library version mismatch")
    assert install_torch.main(["torch==2.13.0", "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert "nvidia-smi exited with 9: Failed to initialize NVML: Driver/library version mismatch" in err
    assert "make install TORCH_INDEX=cpu" in err


def test_an_unreachable_cuda_12_index_stops_with_the_exact_command(on_path, capsys):
    on_path("12.2")
    ran = []
    rc = install_torch.install("torch==2.13.0", "auto", pip=ran.append, reachable=lambda index: False)
    err = capsys.readouterr().err
    assert rc == 1 and ran == []
    assert "https://download.pytorch.org/whl/cu126 did not answer within 5 s" in err
    assert "make install TORCH=torch==2.3.1 TORCH_INDEX=default" in err


def test_a_cuda_12_index_without_the_release_stops_with_the_exact_command(on_path, capsys):
    on_path("12.2")
    ran = []
    rc = install_torch.install("torch==2.13.0", "auto", pip=lambda args: ran.append(args) or 1,
                               reachable=lambda index: True)
    assert rc == 1 and ran == [["torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cu126"]]
    assert "has no torch==2.13.0" in capsys.readouterr().err


def test_an_unreachable_cpu_index_falls_back_to_pips_indexes(on_path, capsys):
    on_path(None)
    ran = []
    assert install_torch.install("torch==2.13.0", "auto", pip=lambda args: ran.append(args) or 0,
                                 reachable=lambda index: False) == 0
    assert ran == [["torch==2.13.0"]]
    out = capsys.readouterr().out
    assert out.startswith("torch: no nvidia-smi here, so the build pip's configured indexes serve (PyTorch's CPU "
                          "index https://download.pytorch.org/whl/cpu did not answer within 5 s") and out.count("\n") == 1, out


def test_the_check_after_the_install_fails_when_torch_sees_fewer_gpus_than_nvidia_smi(on_path, capsys):
    """This machine's torch sees no GPU; with a stand-in that shows four, the install's last line
    fails, naming the build, the count, the server and its driver (`ray up`'s log holds every
    server's)."""
    import socket

    import torch

    on_path("12.2")
    if torch.cuda.is_available():
        pytest.skip("a GPU here: the stand-in's four would not be what torch sees")
    assert install_torch.main(["--check"]) == 1
    err = capsys.readouterr().err
    build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "the CPU build"
    assert f"torch {torch.__version__} installed: {build}, which sees 0 of the 4 GPUs nvidia-smi shows" in err
    assert err.rstrip().endswith(f"[server {socket.gethostname()}, NVIDIA driver 535.104.05]"), err


def test_a_driver_too_old_for_the_build_is_named_with_both_versions_and_the_remedy():
    old = driver.Driver(True, "535.104.05", (12, 2), gpus=4)
    ok, said = driver.torch_can_use(old, "13.0", available=False, sees=0, visible=None,
                                    warning="The NVIDIA driver on your system is too old (found version 12020).")
    assert not ok
    assert "a CUDA 13.0 build, which sees 0 of the 4 GPUs nvidia-smi shows" in said
    assert "the driver 535.104.05 runs CUDA 12.2 at most, older than this CUDA 13.0 build" in said
    assert "run make install in the checkout" in said
    # within CUDA 12 any build runs on any 12 driver (minor-version compatibility): not "too old"
    ok, said = driver.torch_can_use(old, "12.6", available=True, sees=4, visible=None)
    assert ok and said == "a CUDA 12.6 build, which sees 4 of the 4 GPUs nvidia-smi shows"
    ok, said = driver.torch_can_use(old, "12.6", available=True, sees=2, visible="0,1")
    assert ok and "sees 2 of the 2 GPUs nvidia-smi shows (CUDA_VISIBLE_DEVICES=0,1)" in said
    ok, said = driver.torch_can_use(old, "12.6", available=True, sees=3, visible=None)
    assert not ok and "older than" not in said and "exclusive mode" in said


def test_the_header_parse_reads_real_nvidia_smi_headers():
    assert driver.parse_header("| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: 13.0   |") == (
        "580.159.04", (13, 0))
    assert driver.parse_header("NVIDIA-SMI has failed because it couldn't communicate with the driver") == ("", None)


def _make_dry_run(*args: str) -> str:
    """What ``make -n ARGS`` would run, as from a shell: not with the variables of a make this suite
    runs under (``make test-compat`` hands its VENV, TORCH and PYTHON down, in MAKEFLAGS and in the
    environment)."""
    makes = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "VENV", "TORCH", "TORCH_INDEX", "PYTHON",
             "COMPAT_PYTHON", "COMPAT_VENV", "PYTEST_ARGS")
    env = {k: v for k, v in os.environ.items() if k not in makes}
    proc = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_make_install_upgrades_pip_then_installs_torch_for_the_driver_then_checks_it(tmp_path):
    lines = _make_dry_run("install", f"VENV={tmp_path / 'v'}").splitlines()
    order = [next(i for i, line in enumerate(lines) if needle in line) for needle in (
        "-m venv", "-m pip install -q --upgrade pip", '-m tools.install_torch "torch==2.13.0" --index "auto"',
        '-m pip install -q -e ".[test]"', "-m tools.install_torch --check")]
    assert order == sorted(order), lines


def _requirement(name: str) -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(rf'"{name}([^"]*)"', text).group(1) if name != "python" else re.search(
        r'requires-python = "([^"]+)"', text).group(1)


def _makefile_torch(variable: str) -> tuple[int, ...]:
    """The release of the Makefile's ``VARIABLE ?= torch==X.Y.Z`` (or ``:=``), as numbers."""
    found = re.search(rf"^{variable} [?:]= torch==(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    return tuple(int(n) for n in found.group(1).split("."))


def _python_range() -> tuple[int, int]:
    """pyproject's requires-python as (lowest minor, highest minor + 1) of Python 3."""
    low, high = re.fullmatch(r">=3\.(\d+),<3\.(\d+)", _requirement("python")).groups()
    return int(low), int(high)


def test_the_range_pyproject_admits_is_the_one_the_tiers_test():
    """pyproject's torch floor is the compat tier's torch and the driver table's fallback; its top
    admits the top tier's torch and no later minor release; `make install`'s default lies between.
    The Python running this suite is inside its Python range."""
    floor, top, default = (_makefile_torch(v) for v in ("TORCH_FLOOR", "TORCH_TOP", "TORCH"))
    assert _requirement("torch") == f">={'.'.join(map(str, floor))},<{top[0]}.{top[1] + 1}"
    assert floor <= default <= top
    assert driver.TORCH_FLOOR == f"torch=={'.'.join(map(str, floor))}"
    low, high = _python_range()
    assert low <= sys.version_info.minor < high


def _find_python(*args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"PATH": path} if path is not None else {})}
    return subprocess.run([str(ROOT / "tools" / "find_python"), *args], capture_output=True, text=True, timeout=60,
                          check=False, env=env)


def _minor(python: str) -> int:
    return int(subprocess.run([python, "-c", "import sys; print(sys.version_info[1])"], capture_output=True,
                              text=True, timeout=60, check=True).stdout)


def test_the_compat_and_top_tiers_find_the_ranges_oldest_and_newest_python_here():
    low, high = _python_range()
    floor = _find_python("floor")
    if floor.returncode != 0:
        pytest.skip(f"no Python 3.{low} here: {floor.stderr.strip()}")
    assert _minor(floor.stdout.strip()) == low
    newest = _find_python("newest")
    assert newest.returncode == 0, newest.stderr
    assert low <= _minor(newest.stdout.strip()) < high
    assert _minor(newest.stdout.strip()) >= sys.version_info.minor  # at least the one running this suite


def _outside_the_range() -> str:
    """A Python 3 interpreter outside pyproject's range from pyenv (3.9 on the lab's old servers), or skip."""
    low, high = _python_range()
    versions = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted((p for p in versions.glob("3.*/bin/python3") if re.fullmatch(r"3\.\d+\.\d+", p.parent.parent.name)
                    and not low <= int(p.parent.parent.name.split(".")[1]) < high),
                   key=lambda p: tuple(map(int, p.parent.parent.name.split("."))))
    if found:
        return str(found[-1])
    pytest.skip("no Python 3 outside pyproject's range in pyenv here")


def _shell_tools(folder: Path, python3: str) -> str:
    """A PATH holding only what `make install` runs before the venv exists, and ``python3``."""
    import shutil

    folder.mkdir()
    for tool in ("sh", "sed", "dirname", "grep", "head", "sort", "tail", "make", "cat"):
        (folder / tool).symlink_to(shutil.which(tool))
    (folder / "python3").symlink_to(python3)
    return str(folder)


def test_make_install_with_a_python_outside_the_range_stops_at_once_having_downloaded_nothing(tmp_path):
    """The first recipe line checks PYTHON against pyproject's range: outside it, with no
    python3.X of the range on the PATH, make stops before the venv exists (so before any pip
    call), naming the Python it found, the range, and how to get one."""
    outside = _outside_the_range()
    env = {"PATH": _shell_tools(tmp_path / "bin", outside), "HOME": str(tmp_path)}
    proc = subprocess.run(["make", "install", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=10, check=False, env=env)  # the bound; the check itself takes well under 1 s
    assert proc.returncode != 0
    assert not (tmp_path / "venv").exists()
    version = subprocess.run([outside, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    low, high = _python_range()
    assert f"python3: {version}, outside raymcn's range ({_requirement('python')}, pyproject.toml's " \
           f"requires-python), and no python3.{low} to python3.{high - 1} is on the PATH" in proc.stderr, proc.stderr
    assert "Nothing was installed" in proc.stderr and "uv python install" in proc.stderr


def test_a_python_outside_the_range_gives_way_to_one_of_the_range_on_the_path_and_says_so(tmp_path):
    outside = _outside_the_range()
    path = _shell_tools(tmp_path / "bin", outside)
    supported = tmp_path / "bin" / f"python3.{sys.version_info.minor}"
    supported.symlink_to(sys.executable)
    proc = _find_python("python3", path=path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(supported)
    assert proc.stderr.startswith("python3: Python 3.") and proc.stderr.rstrip().endswith(
        f"using python3.{sys.version_info.minor} ({supported}) instead"), proc.stderr


def test_make_test_compat_runs_the_fast_tier_in_its_own_venv_on_the_floor_python_and_torch(tmp_path):
    proc = _find_python("floor")
    if proc.returncode != 0:
        pytest.skip(f"no floor Python here: {proc.stderr.strip()}")
    venv = tmp_path / "compat"  # not made yet, so that make would make it
    out = _make_dry_run("test-compat", f"COMPAT_VENV={venv}")
    assert f'tools/find_python "{proc.stdout.strip()}"' in out and f"-m venv {venv}" in out
    assert f'{venv}/bin/python -m tools.install_torch "torch==2.3.1"' in out
    assert f"{venv}/bin/python -m pytest -q --tier fast" in out


def test_make_test_top_runs_the_fast_tier_in_its_own_venv_on_the_newest_python_and_torch(tmp_path):
    proc = _find_python("newest")
    assert proc.returncode == 0, proc.stderr
    venv = tmp_path / "top"
    out = _make_dry_run("test-top", f"TOP_VENV={venv}")
    top = ".".join(map(str, _makefile_torch("TORCH_TOP")))
    assert f'tools/find_python "{proc.stdout.strip()}"' in out and f"-m venv {venv}" in out
    assert f'{venv}/bin/python -m tools.install_torch "torch=={top}"' in out
    assert f"{venv}/bin/python -m pytest -q --tier fast" in out


GUIDE = ROOT / "docs" / "lab-guide.md"


def test_the_guides_check_of_python_and_the_driver_prints_both(tmp_path):
    folder = stand_in_nvidia_smi(tmp_path, "12.2")
    proc = subprocess.run(
        ["bash", "-c", "python3 --version && nvidia-smi | grep Driver"],
        capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"})
    said = proc.stdout + proc.stderr
    assert re.search(r"Python 3\.\d+\.\d+", said) and "Driver Version: 535.104.05    CUDA Version: 12.2" in said


def test_the_guides_two_torch_lines_are_what_make_install_prints(on_path, capsys, monkeypatch):
    """Step 1 shows what `make install` prints about torch on a CUDA 12.2 driver with 4 GPUs: the
    choice (pip stubbed), then the check (torch made to answer as that CUDA 12.6 build would)."""
    import torch

    text = GUIDE.read_text()
    block = text[text.index("Its two lines about torch"):]
    shown = block[block.index("```text\n") + 8:block.index("\n```", block.index("```text\n"))].splitlines()
    on_path("12.2")
    assert install_torch.install("torch==2.13.0", "auto", pip=lambda args: 0, reachable=lambda index: True) == 0
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu126")
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert install_torch.check() == 0
    assert capsys.readouterr().out.splitlines() == shown


def test_ray_up_installs_the_makefiles_torch_the_same_way(on_path, capsys):
    """cluster.yaml's setup commands run the installer without a release: the Makefile's, chosen for
    the server's driver as `make install` chooses it, then the same check."""
    text = (ROOT / "cluster.yaml").read_text()
    assert "cd ~/raymcn-src && python -m tools.install_torch\n" in text
    assert "\n  - cd ~/raymcn-src && python -m tools.install_torch --check\n" in text  # a command of its own
    assert install_torch.makefile_torch() == "torch==2.13.0"
    on_path("12.2")
    assert install_torch.main(["--dry-run"]) == 0
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126" in capsys.readouterr().out
