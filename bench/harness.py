"""The one harness every benchmark runs under: its arguments, the machine line, the JSON out, and
its figures saved as each measurement finishes.

Every benchmark (``python -m bench.NAME``) takes

* ``--smoke``: its smallest size, which checks the path in seconds and measures nothing worth
  quoting; the test suite runs every benchmark at it (``tests/test_bench_smoke.py`` and the tests
  it names);
* ``--json``: every figure as one JSON line, printed last;
* ``--out FILE``: every figure as JSON in ``FILE``.

The figures carry ``machine`` (:func:`machine_line`): a benchmark's figures are only as good as
the machine they were measured on. While a benchmark runs, what it has measured so far is in a
partial file (``FILE.partial`` beside ``--out``, else under ``$RAYMCN_BENCH_DIR/partial``),
rewritten after every measurement, so a benchmark that dies in its third repeat keeps its first
two; the file goes once the benchmark completes, and its path is printed when it does not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]  # the checkout: `python -m bench.NAME` runs from here


def machine_line() -> str:
    """CPU model, cores, host and torch version: the figures of a benchmark depend on them."""
    import torch  # here, not at the top: a benchmark's children may measure their own imports

    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return (f"{model}, {os.cpu_count()} cores, {platform.node()}, torch {torch.__version__} with "
            f"{torch.get_num_threads()} threads")


def bench_dir() -> Path:
    """Where benchmarks keep what outlives a run (corpora reused across runs, partial figures)."""
    return Path(os.environ.get("RAYMCN_BENCH_DIR", "/tmp/raymcn-bench"))


def parser(doc: str | None, smoke: str, raw: bool = False) -> argparse.ArgumentParser:
    """An argument parser with the harness's arguments; ``doc``: the benchmark's module docstring
    (its first line describes it; with ``raw`` all of it, as written); ``smoke``: what ``--smoke``
    runs."""
    text = doc or ""
    spec = getattr(sys.modules["__main__"], "__spec__", None)  # `python -m bench.NAME`: usage says so
    by_name = spec is not None and spec.name.startswith("bench.")
    p = argparse.ArgumentParser(prog=f"python -m {spec.name}" if by_name else None,
                                description=text if raw else text.split("\n")[0],
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
        self._machine: str | None = None

    @property
    def machine(self) -> str:
        if self._machine is None:
            self._machine = machine_line()
        return self._machine

    def __enter__(self) -> Results:
        return self

    def __exit__(self, kind, error, tb) -> None:
        if error is not None and self.partial.exists():
            print(f"bench.{self.name} failed; what it measured before is in {self.partial}", file=sys.stderr)

    def save(self, **parts: Any) -> None:
        """Record ``parts`` (a measurement's figures, by name) and rewrite the partial file."""
        self.parts.update(parts)
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.partial.with_name(self.partial.name + ".tmp")
        tmp.write_text(dumps({"bench": self.name, "machine": self.machine, "partial": True, **self.parts},
                             indent=1) + "\n")
        os.replace(tmp, self.partial)  # never half a file, even if the benchmark dies while writing

    def finish(self, figures: dict) -> dict:
        """The benchmark's final figures (with ``machine`` unless they have it): to ``--out``, to
        stdout as one JSON line with ``--json``; the partial file removed. Returns them."""
        figures.setdefault("machine", self.machine)
        if self.out:
            Path(self.out).parent.mkdir(parents=True, exist_ok=True)
            Path(self.out).write_text(dumps(figures, indent=1) + "\n")
            print(f"wrote {self.out}", file=sys.stderr)
        if self.print_json:
            print(dumps(figures), flush=True)
        self.partial.unlink(missing_ok=True)
        return figures
