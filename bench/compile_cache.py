"""A sweep's trials reuse compiled code: with scale.compile, its second trial compiles far faster than its first.

    python -m bench.compile_cache                 # 2 trials of the embedded default, 1 epoch each
    python -m bench.compile_cache --out docs/measurements/compile_cache.json

Runs ``raymcn sweep`` as ``python sweep.py`` does (``python -m raymcn.cli sweep`` in a process of its
own, with a fresh local Ray instance) over the embedded default with ``scale.compile=true``: a grid
of two learning rates, one trial at a time (``sweep.max_concurrent=1``), no confirmation, and
``TORCHINDUCTOR_CACHE_DIR`` set to a new, empty folder. The first trial so starts cold, as a lab
server's first trial after a reboot; the second finds the kernels the first compiled in Inductor's
FX graph cache on the node's disk. Each trial is a Ray Train run of its own, so its workers are new
processes: they still trace the model (Dynamo) and its backward (AOT autograd) again, then load
the compiled graphs from the cache instead of generating and compiling C++. AOT autograd's own
cache does not serve them: Dynamo splits a DDP model's graph at the gradient buckets, and torch
does not cache the split graphs (it logs "Won't cache a graph with fakify_first_call enabled").

Per trial, from the sweep's results (each epoch's ``compiled_graphs`` and ``time_compile_s``,
rank 0's, summed over the trial's epochs; Tune's ``time_total_s``, the trial's wall time from its
start to its last report): graphs compiled, compile seconds, wall seconds, and the second
trial's over the first's. Beside them: the files the sweep left in the cache folder (the workers
wrote there, not to the default folder), the load average and the CPU seconds of the machine's
other processes during the sweep (``bench.procstat``), and the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import harness, procstat
from bench.harness import REPO

LEARNING_RATES = (1.0e-3, 3.0e-3)  # the embedded default's two: the grid's two trials
# The smoke size: two trials of 1 epoch on one worker, on the test suite's tiny corpus (the sweep
# starts its own Ray instance: run it where no other instance runs)
SMOKE = {"epochs": 1, "overrides": ["scale.num_workers=1", "data.synthetic_videos=64", "data.synthetic_eval_clips=64"]}


def sweep_command(epochs: int, extra: list[str]) -> list[str]:
    """``raymcn sweep`` of the embedded default with compile on: two learning rates, one trial at a time."""
    grid = ", ".join(str(lr) for lr in LEARNING_RATES)
    settings = [f"sweep.space={{optim.lr: {{grid: [{grid}]}}}}", "sweep.confirm={}", "sweep.max_concurrent=1",
                "scale.compile=true", f"schedule.epochs={epochs}", "run.name=compile-cache", *extra]
    return [sys.executable, "-m", "raymcn.cli", "sweep", "--json", *sum((["--set", s] for s in settings), [])]


def run_sweep(cmd: list[str], results: Path, inductor_cache: Path) -> tuple[dict, float, dict]:
    """The sweep in its own process: (its ``--json`` line, its wall seconds, the CPU seconds of its
    processes and of the machine's others meanwhile)."""
    env = {**os.environ, "RAY_ADDRESS": "local", "RAYMCN_RESULTS": str(results),
           "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache)}
    with procstat.ProcessSampler(every_s=1.0) as sampler:
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        t1 = time.time()
        used = sampler.cpu(t0, t1).get("cpu_s", {})
    if proc.returncode != 0:
        raise SystemExit(f"raymcn sweep exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    cpu = {"sweep": sum(v for k, v in used.items() if k != procstat.OTHERS), "others": used.get(procstat.OTHERS, 0.0)}
    return json.loads(proc.stdout.strip().splitlines()[-1]), t1 - t0, cpu


def trials_in_start_order(exp_dir: str) -> list[dict]:
    """Each trial of the sweep, the first started first: its learning rate, its epochs' compile
    figures (rank 0's) and Tune's wall time."""
    from raymcn.results.experiment import load_experiment

    table, curves = load_experiment(exp_dir)
    lr = dict(zip(table["trial"].astype(str), table["optim.lr"]))
    out = []
    for trial, curve in curves.groupby("trial"):
        curve = curve.sort_values("epoch")
        missing = {"compiled_graphs", "time_compile_s"} - set(curve.columns)
        if missing:
            raise SystemExit(f"trial {trial} of {exp_dir} reported no {sorted(missing)}: was scale.compile on?")
        epochs = [{"epoch": int(r["epoch"]), "compiled_graphs": float(r["compiled_graphs"]),
                   "time_compile_s": float(r["time_compile_s"]), "time_total_s": float(r["time_total_s"])}
                  for _, r in curve.iterrows()]
        started = float(curve["timestamp"].iloc[0]) - float(curve["time_total_s"].iloc[0])
        out.append({"trial": str(trial), "optim.lr": float(lr[str(trial)]), "started": started, "epochs": epochs,
                    "compiled_graphs": sum(e["compiled_graphs"] for e in epochs),
                    "time_compile_s": sum(e["time_compile_s"] for e in epochs),
                    "wall_s": epochs[-1]["time_total_s"]})
    return sorted(out, key=lambda t: t["started"])


def folder_size(path: Path) -> dict:
    files = [p for p in path.rglob("*") if p.is_file()]
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}


def build_parser():
    p = harness.parser(__doc__, smoke="two 1-epoch trials on one worker, on a corpus of 64 videos")
    p.add_argument("--epochs", type=int, default=1, help="epochs per trial (default 1: the first compiles)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a further setting of the sweep's trials")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.epochs, args.overrides = SMOKE["epochs"], [*SMOKE["overrides"], *args.overrides]
    from raymcn.results.render import render_table

    load0 = procstat.load()
    with harness.Results("compile_cache", args) as results, \
            tempfile.TemporaryDirectory(prefix="raymcn-compilecache-") as tmp:
        tmp = Path(tmp)
        inductor_cache = tmp / "inductor"
        inductor_cache.mkdir()  # empty: the first trial compiles cold
        cmd = sweep_command(args.epochs, args.overrides)
        line, wall, cpu = run_sweep(cmd, tmp / "results", inductor_cache)
        trials = trials_in_start_order(line["experiment_dir"])
        if len(trials) != 2:
            raise SystemExit(f"the sweep {line['experiment_dir']} ran {len(trials)} trials, not 2")
        first, second = trials
        ratio = {key: second[key] / first[key] if first[key] else float("nan")
                 for key in ("compiled_graphs", "time_compile_s", "wall_s")}
        figures = {"settings": {"epochs": args.epochs, "learning_rates": list(LEARNING_RATES),
                                "overrides": args.overrides},
                   "sweep_wall_s": wall, "trials": trials, "second_over_first": ratio,
                   "inductor_cache": folder_size(inductor_cache), "load_start": load0, "load_end": procstat.load(),
                   "cpu_s": cpu, "machine": results.machine}
        results.save(**figures)
        rows = [{"trial": f"{i}: {t['trial']} (lr {t['optim.lr']:g})", "compiled graphs": t["compiled_graphs"],
                 "compile s": t["time_compile_s"], "wall s": t["wall_s"]} for i, t in enumerate(trials, 1)]
        rows.append({"trial": "second / first", "compiled graphs": ratio["compiled_graphs"],
                     "compile s": ratio["time_compile_s"], "wall s": ratio["wall_s"]})
        print(render_table(rows, spec={"compiled graphs": ".3g", "compile s": ".3g", "wall s": ".3g"}))
        print(f"sweep of 2 trials ({args.epochs} epoch(s) each) {wall:.0f} s; Inductor's cache after it: "
              f"{figures['inductor_cache']['files']} files; CPU s: the sweep's {cpu['sweep']:.0f}, the machine's "
              f"other processes {cpu['others']:.0f}")
        print(f"machine: {results.machine}; load average {load0} at the start, {figures['load_end']} at the end")
        results.finish(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
