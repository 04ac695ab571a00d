"""``make install``'s torch: the build this machine's NVIDIA driver runs, then a check that torch
sees the GPUs nvidia-smi shows. Run with the venv's Python from the checkout's root, before raymcn
is installed (it imports only the standard library and ``raymcn.doctor.driver``, which is
stdlib-only too).

    python -m tools.install_torch [torch==2.13.0] [--index auto|default|cpu|URL] [--dry-run]
    python -m tools.install_torch --check

The release defaults to the Makefile's ``TORCH`` (``ray up``'s setup commands run it so).

``--index auto`` (the default) decides by ``nvidia-smi`` (``raymcn.doctor.driver.choose_build``):

- no nvidia-smi: the CPU build, from PyTorch's CPU index where it answers within 5 s, else from
  pip's configured indexes (offline, a proxy, a local mirror: on a stock Linux machine that is the
  multi-GB CUDA build, which runs on the CPU too);
- a driver that runs CUDA 13: pip's default index, whose recent torch releases are CUDA 13 builds;
- a driver that runs CUDA 12 only: PyTorch's CUDA 12 index; where that does not answer within 5 s,
  or has no such release, it stops and prints the exact command to run instead.

``default`` is pip's configured indexes, ``cpu`` PyTorch's CPU index, anything else an index URL
(a mirror). ``--dry-run`` prints the choice and the pip command and runs nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import urllib.request
import warnings
from pathlib import Path

from raymcn.doctor.driver import CPU_INDEX, Choice, choose_build, read_driver, torch_can_use

ROOT = Path(__file__).resolve().parents[1]
ANSWER_WITHIN_S = 5.0
CUDA13_SINCE = (2, 11)  # pip's default index serves torch as a CUDA 13 build from this release on


def answers(index: str, timeout_s: float = ANSWER_WITHIN_S) -> bool:
    """Whether the wheel index ``index`` lists torch within ``timeout_s``."""
    try:
        urllib.request.urlopen(index.rstrip("/") + "/torch/", timeout=timeout_s).close()
        return True
    except (OSError, ValueError):
        return False


def makefile_torch(makefile: Path = ROOT / "Makefile") -> str:
    """The Makefile's ``TORCH ?= ...``: the release ``make install`` installs."""
    found = re.search(r"^TORCH \?= (\S+)", makefile.read_text(), re.MULTILINE)
    if found is None:
        raise ValueError(f"{makefile} has no 'TORCH ?= ...' line")
    return found.group(1)


def release(spec: str) -> tuple[int, int] | None:
    """(major, minor) of ``torch==X.Y[.Z]``; None for any other requirement."""
    found = re.fullmatch(r"torch==(\d+)\.(\d+)(\.\d+)?", spec.strip())
    return (int(found.group(1)), int(found.group(2))) if found else None


def plan(spec: str, index: str) -> Choice:
    """The torch build ``make install`` installs (module doc)."""
    if index == "default":
        return Choice(spec, "", "TORCH_INDEX=default: pip's configured indexes")
    if index == "cpu":
        return Choice(spec, CPU_INDEX, "TORCH_INDEX=cpu: the CPU build")
    if index != "auto":
        return Choice(spec, index, f"TORCH_INDEX={index}")
    version = release(spec)
    return choose_build(read_driver(), spec, cuda13_default=version is None or version >= CUDA13_SINCE)


def pip_install(args: list[str]) -> int:
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--timeout", "15", *args],
                          check=False).returncode


def install(spec: str, index: str, dry_run: bool = False, pip=pip_install, reachable=answers) -> int:
    """Install ``spec`` as :func:`plan` chooses; 0 on success, else 1 with what to run instead."""
    try:
        choice = plan(spec, index)
    except ValueError as e:
        print(f"torch: {e}", file=sys.stderr)
        return 1
    if dry_run:
        print(f"torch: {choice.why}\n  would run: pip install {' '.join(choice.pip_args())}")
        return 0
    if choice.index == CPU_INDEX and index == "auto" and not reachable(CPU_INDEX):
        choice = Choice(spec, "", f"no nvidia-smi here, so the build pip's configured indexes serve (PyTorch's CPU "
                                  f"index {CPU_INDEX} did not answer within {ANSWER_WITHIN_S:g} s; a stock Linux "
                                  "machine gets the CUDA build there, which runs on the CPU too)")
    elif choice.fallback and not reachable(choice.index):
        print(f"torch: {choice.why}; but {choice.index} did not answer within {ANSWER_WITHIN_S:g} s. Run instead:\n"
              f"  {choice.fallback}\n  or, where a mirror of that index answers: make install TORCH_INDEX=URL",
              file=sys.stderr)
        return 1
    print(f"torch: {choice.why}: pip install {' '.join(choice.pip_args())}")
    if pip(choice.pip_args()) != 0:
        if choice.fallback:
            print(f"torch: {choice.index} has no {spec} (pip said why above). Run instead:\n  {choice.fallback}",
                  file=sys.stderr)
        return 1
    return 0


def check() -> int:
    """After the install: which build arrived, and whether it sees the GPUs nvidia-smi shows."""
    import torch

    driver = read_driver()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
        sees = torch.cuda.device_count() if available else 0
    ok, sentence = torch_can_use(driver, torch.version.cuda or "", available, sees,
                                 os.environ.get("CUDA_VISIBLE_DEVICES"), " ".join(str(w.message) for w in said))
    if not ok:  # in `ray up`'s log among every server's: which server, and its driver
        sentence += f" [server {socket.gethostname()}, NVIDIA driver {driver.version or '?'}]"
    print(f"torch {torch.__version__} installed: {sentence}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.install_torch", description=__doc__.split("\n\n")[0])
    parser.add_argument("torch", nargs="?", default="", help="the requirement, e.g. torch==2.13.0 (default: the "
                        "Makefile's TORCH)")
    parser.add_argument("--index", default="auto", help="auto (by nvidia-smi), default (pip's), cpu, or an index URL")
    parser.add_argument("--dry-run", action="store_true", help="print the choice and the pip command only")
    parser.add_argument("--check", action="store_true", help="after the install: torch against nvidia-smi")
    args = parser.parse_args(argv)
    if args.check:
        return check()
    return install(args.torch or makefile_torch(), args.index, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
