"""The embedded default sweep (`python sweep.py`, 16 trials) timed against an earlier commit, alternating.

    python -m bench.sweep_time --baseline 4de240c               # 1 run each (16 min on 2 cores)
    python -m bench.sweep_time --baseline 4de240c --runs 2 --out docs/measurements/sweep_time.json
                    # 2 each, alternating (31 min): docs/ray-cost.md's figures

4de240c is the code before trials shared their driver process.

The baseline's tree is extracted with ``git archive`` into a temporary folder (no worktree is
added to the repository) and run with ``PYTHONPATH`` pointing at it, so its driver and every Ray
worker import the baseline's ``raymcn``; the current checkout runs the same way. Both use this
interpreter, the same synthetic corpus (generated into one cache before any timing) and their own
results folder, with ``RAY_ADDRESS=local`` (a fresh Ray instance each, never one that is already
running on the machine). The runs alternate: baseline, current, current, baseline, ...

Reported per run: wall seconds of the whole command (Ray's start, 16 trials, the tables and plots),
the lines it printed and its widest line, and the CPU seconds of its processes and of the rest of
the machine meanwhile (``bench.procstat``), with the load average and the machine.
"""

from __future__ import annotations

import io
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from bench import harness, procstat
from bench.harness import REPO

# The smoke size: the checkout against its HEAD, one run each of `sweep.py --help`: the benchmark's
# own path (the baseline's tree, the runs alternating, their CPU, the report) without a sweep, whose
# cost a smoke run cannot afford (two sweeps, two Ray instances); bench.trial_cost's smoke times one
SMOKE_SWEEP = ["--help"]


def extract(commit: str, where: Path) -> Path:
    """The tree of ``commit`` in ``where`` (git archive: nothing is written into the repository)."""
    data = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(where, filter="data")
    return where


def run_once(tree: Path, results: Path, cache: Path, args) -> dict:
    env = {**os.environ, "RAY_ADDRESS": "local", "RAYMCN_RESULTS": str(results), "RAYMCN_CACHE": str(cache),
           "PYTHONPATH": str(tree)}
    load0 = procstat.load()
    with procstat.ProcessSampler(every_s=1.0) as sampler:
        t0 = time.time()
        proc = subprocess.run([sys.executable, "sweep.py", *args.sweep_args], cwd=tree, env=env,
                              capture_output=True, text=True)
        t1 = time.time()
        used = sampler.cpu(t0, t1)
    if proc.returncode != 0:
        raise RuntimeError(f"sweep in {tree} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    lines = proc.stdout.splitlines()
    ours = sum(v for k, v in used.get("cpu_s", {}).items() if k != procstat.OTHERS)
    return {"wall_s": t1 - t0, "lines": len(lines), "widest_line": max(map(len, lines), default=0),
            "cpu_s": ours, "others_cpu_s": used.get("cpu_s", {}).get(procstat.OTHERS, 0.0),
            "load_before": load0, "load_after": procstat.load(), "stdout_tail": lines[-40:]}


def build_parser():
    p = harness.parser(__doc__, smoke="this checkout against HEAD, one run each of `sweep.py --help` (no sweep)")
    p.add_argument("--baseline", help="the commit to compare with (e.g. the branch point; required but with --smoke)")
    p.add_argument("--runs", type=int, default=1, help="runs of each (alternating; default 1)")
    p.add_argument("sweep_args", nargs="*", help="arguments for sweep.py (default: none, the embedded default)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.smoke:
        args.baseline, args.runs, args.sweep_args = args.baseline or "HEAD", 1, [*SMOKE_SWEEP, *args.sweep_args]
    if not args.baseline:
        p.error("--baseline COMMIT is required")
    with tempfile.TemporaryDirectory(prefix="raymcn-sweeptime-") as tmp, harness.Results("sweep_time", args) as results:
        info = results.machine
        tmp = Path(tmp)
        trees = {"baseline": extract(args.baseline, tmp / "baseline"), "current": REPO}
        cache = tmp / "cache"
        from raymcn.config import load_config, preset_path
        from raymcn.train.inputs import resolve_inputs

        os.environ["RAYMCN_CACHE"] = str(cache)
        if not args.smoke:  # the corpus and its shards, once, before any timing (`--help` reads none)
            resolve_inputs(load_config(preset_path(), settings(args.sweep_args)))
        runs: dict[str, list[dict]] = {"baseline": [], "current": []}
        order = [("baseline", "current") if i % 2 == 0 else ("current", "baseline") for i in range(args.runs)]
        for i, pair in enumerate(order):
            for which in pair:
                r = run_once(trees[which], tmp / f"results-{which}-{i}", cache, args)
                runs[which].append(r)
                results.save(baseline=args.baseline, runs=runs)
                print(f"run {i + 1} {which:8s}: {r['wall_s'] / 60:.2f} min, {r['lines']} lines (widest "
                      f"{r['widest_line']}), CPU {r['cpu_s']:.0f} s (the rest of the machine "
                      f"{r['others_cpu_s']:.0f} s), "
                      f"load {r['load_before']} -> {r['load_after']}", flush=True)
        med = {k: statistics.median(r["wall_s"] for r in v) for k, v in runs.items()}
        print(f"\nmachine: {info}; load average now {procstat.load()}")
        print(f"median wall: baseline {args.baseline} {med['baseline'] / 60:.2f} min, current "
              f"{med['current'] / 60:.2f} min ({med['current'] / med['baseline']:.2f}x)")
        print("the current run's last lines:\n" + "\n".join(runs["current"][-1]["stdout_tail"]))
        results.finish({"machine": info, "baseline": args.baseline, "runs": runs, "median_wall_s": med})
    return 0


def settings(sweep_args: list[str]) -> list[str]:
    """The ``--set KEY=VALUE`` settings among sweep.py's arguments."""
    return [value for flag, value in zip(sweep_args, sweep_args[1:]) if flag == "--set"]


if __name__ == "__main__":
    sys.exit(main())
