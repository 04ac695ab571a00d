"""The NVIDIA driver and the torch build: what ``nvidia-smi`` says a machine's driver runs, which
torch build ``make install`` installs for it, and whether the installed torch can use the GPUs.

A CUDA build of torch runs only on a driver that supports its CUDA version or a later one (within
CUDA 12, NVIDIA's minor-version compatibility lets any 12.x build run on any 12 driver, 525.60.13
or later). ``nvidia-smi`` prints the newest CUDA version its driver supports (``CUDA Version:
12.2`` in its header). torch's build string (``torch.version.cuda``) says only what torch was
built for: a CUDA 13 build on a 535 driver has ``torch.version.cuda == "13.0"`` and
``torch.cuda.is_available() == False``. So a machine is judged by what torch can use, next to
what nvidia-smi shows.

Stdlib only: ``make install`` runs this before anything but the venv exists
(``python -m tools.install_torch`` from the checkout), and the doctor's probe on every node.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

# PyTorch's wheel index per CUDA version; builds of one torch release exist for some of them only.
CUDA_INDEX = "https://download.pytorch.org/whl/cu{tag}"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The CUDA 12 indexes of PyTorch's recent releases (12.6 and 12.8), newest first: the newest one the
# driver supports is taken, else 12.6, which every CUDA 12 driver runs (minor-version compatibility).
CUDA12_TAGS = ((12, 8), (12, 6))
# The oldest torch pyproject admits (the compat tier tests it); pip's default index serves it as a
# CUDA 12.1 build, so it is the fallback a CUDA 12 driver can always get.
TORCH_FLOOR = "torch==2.3.1"
FLOOR_CUDA = (12, 1)


@dataclass(frozen=True)
class Driver:
    """What ``nvidia-smi`` says: the driver's version, the newest CUDA it runs, its GPUs.
    ``present``: nvidia-smi is on the PATH; ``error``: why it said nothing (its own words)."""

    present: bool = False
    version: str = ""
    cuda: tuple[int, int] | None = None
    gpus: int = 0
    error: str = ""

    @property
    def cuda_text(self) -> str:
        return f"{self.cuda[0]}.{self.cuda[1]}" if self.cuda else "?"


def parse_header(text: str) -> tuple[str, tuple[int, int] | None]:
    """(driver version, (major, minor) of the newest CUDA it runs) from ``nvidia-smi``'s header,
    ``| NVIDIA-SMI 535.104.05   Driver Version: 535.104.05   CUDA Version: 12.2 |``; "" and None
    for what it does not say."""
    version = re.search(r"Driver Version:\s*([0-9.]+)", text)
    cuda = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", text)
    return (version.group(1) if version else "", (int(cuda.group(1)), int(cuda.group(2))) if cuda else None)


def read_driver(timeout_s: float = 30.0) -> Driver:
    """This machine's driver, as ``nvidia-smi`` (its header) and ``nvidia-smi -L`` (a line per GPU)
    say; never raises."""
    if shutil.which("nvidia-smi") is None:
        return Driver(error="no nvidia-smi on the PATH")
    try:
        header = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=timeout_s, check=True).stdout
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=timeout_s,
                                 check=True).stdout
    except subprocess.CalledProcessError as e:
        said = ((e.stdout or "").strip() or (e.stderr or "").strip()).splitlines()
        return Driver(True, error=f"nvidia-smi exited with {e.returncode}" + (f": {said[0]}" if said else ""))
    except (OSError, subprocess.SubprocessError) as e:
        return Driver(True, error=f"nvidia-smi: {type(e).__name__}: {e}")
    version, cuda = parse_header(header)
    gpus = sum(1 for line in listing.splitlines() if re.match(r"GPU \d+:", line.strip()))
    return Driver(True, version=version, cuda=cuda, gpus=gpus)


@dataclass(frozen=True)
class Choice:
    """How ``make install`` gets torch: ``pip install TORCH [--index-url index]`` (``index`` "":
    pip's configured indexes), and why, in a sentence for the console."""

    torch: str
    index: str
    why: str
    fallback: str = ""  # where the index cannot be reached: the exact command to run instead

    def pip_args(self) -> list[str]:
        return [self.torch, *(["--index-url", self.index] if self.index else [])]


def choose_build(driver: Driver, torch_spec: str, cuda13_default: bool = True) -> Choice:
    """The torch build for ``driver`` (:func:`read_driver`; missing: a machine without a GPU, which
    gets the CPU build) of the release ``torch_spec`` (``torch==2.13.0``). ``cuda13_default``: pip's
    default index serves ``torch_spec`` as a CUDA 13 build (torch 2.11 and later); older releases
    are CUDA 12 builds there, which every CUDA 12 driver runs."""
    if not driver.present:
        return Choice(torch_spec, CPU_INDEX, "no nvidia-smi here: the CPU build")
    if driver.error or driver.cuda is None:
        raise ValueError(f"nvidia-smi is here but says no CUDA version ({driver.error or 'none in its header'}): "
                         "fix the NVIDIA driver (nvidia-smi must list the GPUs), or install the CPU build with "
                         "make install TORCH_INDEX=cpu")
    cuda = driver.cuda
    said = f"the driver {driver.version or '?'} runs CUDA {driver.cuda_text} at most (nvidia-smi)"
    if cuda >= (13, 0) or (cuda >= (12, 0) and not cuda13_default):
        return Choice(torch_spec, "", f"{said}: the build pip's default index serves")
    if cuda >= (12, 0):
        tag = next((t for t in CUDA12_TAGS if t <= cuda), CUDA12_TAGS[-1])
        index = CUDA_INDEX.format(tag=f"{tag[0]}{tag[1]}")
        return Choice(torch_spec, index, f"{said}, and pip's default index serves {torch_spec} as a CUDA 13 build: "
                                         f"the CUDA {tag[0]}.{tag[1]} build from PyTorch's index",
                      fallback=f"make install TORCH={TORCH_FLOOR} TORCH_INDEX=default   (the oldest torch raymcn "
                               f"is tested with; pip's default index serves it as a CUDA {FLOOR_CUDA[0]}."
                               f"{FLOOR_CUDA[1]} build)")
    raise ValueError(f"{said}; every torch raymcn is tested with needs CUDA 12 or later (a 525.60.13 driver or "
                     "newer): update the NVIDIA driver, then run make install again")


def torch_can_use(driver: Driver, built_for: str, available: bool, sees: int, visible: str | None,
                  warning: str = "") -> tuple[bool, str]:
    """Whether torch can use the GPUs ``nvidia-smi`` shows, and what to say: (ok, sentence).

    Args:
        driver: :func:`read_driver`'s facts.
        built_for: ``torch.version.cuda`` ("" or None for a CPU build).
        available, sees: ``torch.cuda.is_available()`` and ``torch.cuda.device_count()``.
        visible: ``CUDA_VISIBLE_DEVICES`` where set (torch then sees only those), else None.
        warning: what torch warned while answering (e.g. "The NVIDIA driver on your system is too old").
    """
    build = f"a CUDA {built_for} build" if built_for else "the CPU build"
    if not driver.gpus:
        return True, f"{build}; no GPU here ({driver.error or 'nvidia-smi shows none'})"
    expected = driver.gpus if visible is None else min(driver.gpus, len([d for d in visible.split(",") if d.strip()]))
    said = (f"{build}, which sees {sees} of the {expected} GPUs nvidia-smi shows"
            + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""))
    if available and sees == expected:
        return True, said
    if not built_for:
        return False, f"{said}: install a CUDA build of torch (make install in the checkout picks one for the driver)"
    # Within one CUDA major version a build runs on any of its drivers (minor-version compatibility).
    too_old = driver.cuda is not None and driver.cuda[0] < int(built_for.split(".")[0])
    if too_old or "too old" in warning:
        return False, (f"{said}: the driver {driver.version} runs CUDA {driver.cuda_text} at most, older than this "
                       f"CUDA {built_for} build: run make install in the checkout (it picks a build this driver "
                       "runs), or update the NVIDIA driver")
    return False, (f"{said}" + (f"; torch said {warning!r}" if warning else "")
                   + ": check that no other process holds them in exclusive mode (nvidia-smi) and CUDA_VISIBLE_DEVICES")
