"""The one harness every benchmark runs under: its arguments, the machine line, the JSON out, and
its figures saved as each measurement finishes.

Every benchmark (``python -m bench.NAME``) takes

* ``--smoke``: its smallest size, which checks the path in seconds and measures nothing worth
  quoting; the test suite runs every benchmark at it (``tests/test_bench_smoke.py`` and the tests
  it names);
* ``--json``: every figure as one JSON line, printed last;
* ``--out FILE``: every figure as JSON in ``FILE``.

The figures carry where they come from (:func:`stamp`): ``machine`` (:func:`machine_line`, and
``gpus`` where a GPU is visible), ``commit`` (the checkout's, with ``commit_note`` when tracked files
had uncommitted changes) and ``command`` (the ``python -m bench.NAME ...`` that wrote them): a
benchmark's figures are only as good as the machine and the code they were measured with, and
``python -m tools.docgen --stale`` lists the JSONs whose code changed since their commit. While a benchmark runs, what it has measured so far is in a
partial file (``FILE.partial`` beside ``--out``, else under ``$RAYMCN_BENCH_DIR/partial``),
rewritten after every measurement, so a benchmark that dies in its third repeat keeps its first
two; the file goes once the benchmark completes, and its path is printed when it does not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]  # the checkout: `python -m bench.NAME` runs from here


def machine_line() -> str:
    """CPU model, cores, host and torch version: the figures of a benchmark depend on them."""
    import torch  # here, not at the top: a benchmark's children may measure their own imports

    try:
        cpu = cpu_name(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = "unknown CPU"
    return (f"{cpu}, {os.cpu_count()} cores, {platform.node()}, torch {torch.__version__} with "
            f"{torch.get_num_threads()} threads")


def cpu_name(cpuinfo: str) -> str:
    """The first CPU of ``/proc/cpuinfo``'s text: its model name, and on x86 its family, model and
    widest vector extension: ``AMD EPYC (family 25 model 1 AVX2)``. A virtual machine's model
    name can be a bare ``AMD EPYC`` for CPU generations whose speed differs by more than 2x (a
    Zen 3 and a Zen 5), so the name alone cannot tell two machines' figures apart."""
    first: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block ends at its blank line
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    name = first.get("model name", "unknown CPU")
    if "cpu family" not in first:
        return name
    flags = first.get("flags", "").split()
    isa = next((label for flag, label in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX")) if flag in flags), "")
    return f"{name} (family {first['cpu family']} model {first.get('model', '?')}{' ' + isa if isa else ''})"


def gpu_names() -> list[str]:
    """The GPUs ``nvidia-smi`` lists (none without it): asked of the driver, so that stamping a
    benchmark's figures never opens a CUDA context."""
    if not shutil.which("nvidia-smi"):
        return []
    done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                          text=True, check=False)
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def git_commit() -> tuple[str, str | None]:
    """(the checkout's short commit, a note when tracked files differ from it); ("unknown", why)
    outside a git checkout (a copied tree)."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False)

    try:
        head = git("rev-parse", "--short=7", "HEAD")
    except OSError:
        return "unknown", "git is not installed"
    if head.returncode != 0:
        return "unknown", "not run from a git checkout"
    changed = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.strip(), "measured with uncommitted changes to tracked files" if changed else None


def stamp(name: str, argv: list[str] | None) -> dict:
    """Where a benchmark's figures come from: machine, GPUs, commit and the command that wrote them."""
    commit, note = git_commit()
    out = {"machine": machine_line(), "commit": commit}
    if note:
        out["commit_note"] = note
    if gpus := gpu_names():
        out["gpus"] = gpus
    out["command"] = shlex.join(["python", "-m", f"bench.{name}", *(argv or [])])
    return out


def bench_dir() -> Path:
    """Where benchmarks keep what outlives a run (corpora reused across runs, partial figures)."""
    return Path(os.environ.get("RAYMCN_BENCH_DIR", "/tmp/raymcn-bench"))


class _Parser(argparse.ArgumentParser):
    """An argument parser that keeps the arguments it was given (``argv`` of the namespace), so that
    the figures can name the command that wrote them whether it ran from a shell or from a test."""

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        ns.argv = list(sys.argv[1:] if args is None else args)
        return ns, rest


def parser(doc: str | None, smoke: str, raw: bool = False) -> argparse.ArgumentParser:
    """An argument parser with the harness's arguments; ``doc``: the benchmark's module docstring
    (its first paragraph describes it; with ``raw`` all of it, as written); ``smoke``: what
    ``--smoke`` runs."""
    text = doc or ""
    spec = getattr(sys.modules["__main__"], "__spec__", None)  # `python -m bench.NAME`: usage says so
    by_name = spec is not None and spec.name.startswith("bench.")
    p = _Parser(prog=f"python -m {spec.name}" if by_name else None,
                                description=text if raw else " ".join(text.split("\n\n")[0].split()),
                                formatter_class=argparse.RawDescriptionHelpFormatter if raw
                                else argparse.HelpFormatter)
    p.add_argument("--smoke", action="store_true", help=f"the smallest size, checks the path: {smoke}")
    p.add_argument("--json", action="store_true", help="print every figure as one JSON line last")
    p.add_argument("--out", metavar="FILE", help="write every figure as JSON to FILE")
    return p


def parse_args(p: argparse.ArgumentParser, argv: list[str] | None, smoke: dict | None = None) -> argparse.Namespace:
    """``p``'s arguments from ``argv`` (None: the command line); with ``--smoke``, the values of
    ``smoke`` (argument name -> value) replace theirs."""
    args = p.parse_args(argv)
    if args.smoke and smoke:
        vars(args).update(smoke)
    return args


def module_command(module: str, *args: str) -> list[str]:
    """``python -m module args`` with this interpreter; run it with ``cwd=REPO`` (``bench`` and
    ``raymcn`` import from the checkout there)."""
    return [sys.executable, "-m", module, *args]


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The JSON objects of a JSON-lines file, one a line (blank lines skipped); [] without the file."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _plain(value: Any) -> Any:
    """A value ``json`` cannot write (numpy scalars, paths, ...) as one it can."""
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, float):
        return value
    return str(value)


def dumps(figures: dict, indent: int | None = None) -> str:
    return json.dumps(figures, default=_plain, indent=indent)


class Results:
    """One benchmark run's figures: partial ones saved as measurements finish, then the final ones.

    Use as a context manager around the measurements: ``save(**parts)`` after each measurement,
    ``finish(figures)`` once at the end (writes ``--out``, prints the ``--json`` line, removes the
    partial file). Leaving the block with an error keeps the partial file and says where it is.
    """

    def __init__(self, name: str, args: argparse.Namespace):
        self.name, self.out, self.print_json = name, getattr(args, "out", None), getattr(args, "json", False)
        if self.out:
            self.partial = Path(f"{self.out}.partial")
        else:
            self.partial = bench_dir() / "partial" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
        self.parts: dict = {}
        self.argv: list[str] | None = getattr(args, "argv", None)
        self._stamp: dict | None = None

    @property
    def stamp(self) -> dict:
        if self._stamp is None:
            self._stamp = stamp(self.name, self.argv)
        return self._stamp

    @property
    def machine(self) -> str:
        return self.stamp["machine"]

    def __enter__(self) -> Results:
        self.stamp  # noqa: B018 (the commit and machine as the measurements start, not as they end)
        return self

    def __exit__(self, kind, error, tb) -> None:
        if error is not None and self.partial.exists():
            print(f"bench.{self.name} failed; what it measured before is in {self.partial}", file=sys.stderr)

    def save(self, **parts: Any) -> None:
        """Record ``parts`` (a measurement's figures, by name) and rewrite the partial file."""
        self.parts.update(parts)
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.partial.with_name(self.partial.name + ".tmp")
        tmp.write_text(dumps({"bench": self.name, **self.stamp, "partial": True, **self.parts},
                             indent=1) + "\n")
        os.replace(tmp, self.partial)  # never half a file, even if the benchmark dies while writing

    def finish(self, figures: dict) -> dict:
        """The benchmark's final figures, stamped (:func:`stamp`; a key the figures have is kept): to
        ``--out``, to stdout as one JSON line with ``--json``; the partial file removed. Returns them."""
        for key, value in self.stamp.items():
            figures.setdefault(key, value)
        if self.out:
            Path(self.out).parent.mkdir(parents=True, exist_ok=True)
            Path(self.out).write_text(dumps(figures, indent=1) + "\n")
            print(f"wrote {self.out}", file=sys.stderr)
        if self.print_json:
            print(dumps(figures), flush=True)
        self.partial.unlink(missing_ok=True)
        return figures
