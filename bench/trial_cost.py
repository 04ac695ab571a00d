"""A sweep trial's fixed cost, itemised: where the seconds of a short Tune trial go besides training.

    python -m bench.trial_cost                        # 4 trials of the embedded default (~3 min, 2 cores)
    python -m bench.trial_cost --baseline 52d96d4 --runs 2 --out docs/measurements/trial_cost.json
                                                      # against the commit that added the timeline (~15 min)

Runs ``raymcn sweep`` as ``python sweep.py`` does (``python -m raymcn.cli sweep``: the console, a
fresh local Ray instance, Tune, one Ray Train run per trial) in a process of its own, over the
embedded default with a grid of ``--trials`` stage orders and no confirmation, with
``RAYMCN_TIMELINE`` set: raymcn's processes then append timestamped events
(``raymcn/train/monitor/timeline.py``), and ``bench.procstat`` samples every process's title and CPU
from ``/proc`` every 0.1 s. With ``--baseline`` the commit's tree (extracted with ``git archive``,
run with ``PYTHONPATH`` pointing at it) alternates with this checkout in the same run. Per trial:

* **between trials**: the previous trial driver's end -> this one's start (Tune ends a trial and
  starts the next; the trial driver is a new process, or reused, and imports its modules);
* **plan**: the trial's run plan (``sweep/tuner.trial_fn``; the sweep's driver resolved the inputs
  and the shards' video index once for every trial);
* **trainer**: building the TorchTrainer -> ``fit()`` called;
* **controller + placement group + workers**: ``fit()`` -> every rank in raymcn's worker function
  (the Train controller's actor, its placement group, the worker actors' processes, their imports
  of torch and Ray Train, the gloo process group), split where the process titles show it;
* **worker set-up**: the reader, the eval set, the model, DDP (-> ``worker: assembled``);
* **first batch**: the first epoch's wait for its first batch;
* **epochs**: the steps of every epoch, and between them evaluation, checkpoint and report;
* **teardown**: the last rank's return -> ``fit()`` returns (workers, controller and placement
  group stopped) -> the trial driver returns.

fixed cost = the trial's wall time (its driver's start to the next one's) less its epochs' steps.
The first trial also pays for Ray's start; the last for the sweep's end: the middle trials are the
steady cost. The machine and ``os.getloadavg()`` are printed beside the figures.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import harness, procstat
from bench.harness import REPO, read_jsonl
from raymcn.train.monitor import timeline

ORDERS = ("AV_T", "VT_A", "AT_V", "joint")
TIMELINE = "RAYMCN_TIMELINE"
# The smoke size: one sweep of one trial of 1 epoch on one worker, on the test suite's tiny corpus
# (the sweep starts its own Ray instance: run it where no other instance runs)
SMOKE = {"trials": 1, "overrides": ["schedule.epochs=1", "scale.num_workers=1", "data.synthetic_videos=64",
                                    "data.synthetic_eval_clips=64"]}


def run_sweep(tree: Path, trials: int, results: Path, timeline: Path, extra: list[str]) -> float:
    """``raymcn sweep`` of ``trials`` stage orders from the checkout ``tree`` (its own process, its
    own fresh Ray instance); returns its wall seconds."""
    grid = ", ".join(ORDERS[:trials])
    cmd = [sys.executable, "-m", "raymcn.cli", "sweep",
           "--set", f"sweep.space={{schedule.stage_order: {{grid: [{grid}]}}}}", "--set", "sweep.confirm={}",
           "--set", "run.name=trial-cost", *sum((["--set", o] for o in extra), [])]
    env = {**os.environ, "RAY_ADDRESS": "local", "RAYMCN_RESULTS": str(results), TIMELINE: str(timeline),
           "PYTHONPATH": str(tree)}
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"raymcn sweep in {tree} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    return time.time() - t0


def itemise(events: list[dict], sampler: procstat.ProcessSampler) -> list[dict]:
    """Per trial (in start order): its items (seconds) and its CPU per kind of process."""
    by_trial: dict[str, list[dict]] = {}
    order = []
    current = None
    for e in sorted(events, key=lambda e: e["t"]):
        if e["event"] == "trial: driver entered":
            current = e["trial"]
            order.append(current)
        if current is not None:
            by_trial.setdefault(current, []).append(e)
    out = []
    for i, trial in enumerate(order):
        ev = by_trial[trial]

        def first(name: str, **match) -> float | None:
            ts = [e["t"] for e in ev if e["event"] == name and all(e.get(k) == v for k, v in match.items())]
            return min(ts, default=None)

        def last(name: str, **match) -> float | None:
            ts = [e["t"] for e in ev if e["event"] == name and all(e.get(k) == v for k, v in match.items())]
            return max(ts, default=None)

        entered = first("trial: driver entered")
        driver = next(e for e in ev if e["event"] == "trial: driver entered")
        prev_done = None
        if i > 0:
            prev_done = max((e["t"] for e in by_trial[order[i - 1]] if e["event"] == "trial: driver done"),
                            default=None)
        fit0, fit1 = first("trial: fit started"), first("trial: fit done")
        workers_in = [e for e in ev if e["event"] == timeline.WORKER_ENTERED]
        w_in = max((e["t"] for e in workers_in), default=None)
        ctrl = sampler.first_seen("ray::TrainController", after=fit0 or 0)
        wtitle = sampler.first_seen("ray::RayTrainWorker", after=fit0 or 0)
        w_start = max((e.get("process_started") or 0 for e in workers_in), default=None)
        epochs = sorted({e["epoch"] for e in ev if e["event"] == "epoch: steps started"})
        steps_s = 0.0
        for ep in epochs:
            a, b = first("epoch: steps started", epoch=ep, rank=0), first("epoch: steps done", epoch=ep, rank=0)
            if a and b:
                steps_s += b - a
        e0, e_last = first("epoch: steps started", epoch=epochs[0], rank=0), last("epoch: steps done", rank=0)
        first_step = first("worker: epoch's first step done", epoch=epochs[0], rank=0)
        items = {}

        def put(name: str, a: float | None, b: float | None) -> None:
            if a is not None and b is not None:
                items[name] = b - a

        put("between trials: previous driver done -> this driver entered", prev_done, entered)
        if driver.get("process_started") and prev_done and driver["process_started"] > prev_done:
            put("  of which: driver process started -> entered (imports)", driver["process_started"], entered)
        put("plan (the trial's run plan)", first("trial: plan started"), first("trial: plan done"))
        put("trainer built -> fit() called", first("trial: plan done"), fit0)
        put("fit() -> every rank in the worker function", fit0, w_in)
        put("  fit() -> Train controller's title seen", fit0, ctrl)
        put("  controller -> first worker actor's title seen", ctrl, wtitle)
        if w_start and fit0 and w_start > fit0:
            put("  last worker process started -> in the function (imports, process group)", w_start, w_in)
        put("worker set-up (reader, eval set, model, DDP)", w_in, max((e["t"] for e in ev if e["event"] ==
                                                                     "worker: assembled"), default=None))
        put("first batch + first step", e0, first_step)
        put("epochs: steps", 0.0, steps_s)
        if e0 and e_last:
            items["epochs: between the steps (evaluation, checkpoint, report)"] = (e_last - e0) - steps_s
        put("teardown: last rank done -> fit() returned", last("worker: done"), fit1)
        put("teardown: fit() returned -> driver done", fit1, first("trial: driver done"))
        nxt = None
        if i + 1 < len(order):
            nxt = min(e["t"] for e in by_trial[order[i + 1]] if e["event"] == "trial: driver entered")
        wall = (nxt - entered) if nxt else (first("trial: driver done") - entered)
        cpu = sampler.cpu(entered, nxt or first("trial: driver done"))
        out.append({"trial": trial, "items_s": items, "wall_s": wall, "steps_s": steps_s,
                    "fixed_s": wall - steps_s, "to_next_trial": nxt is not None,
                    "cpu_s": cpu.get("cpu_s", {}), "driver_reused": not (driver.get("process_started") or 0) > (
                        prev_done or 0) if i else None})
    return out


def trial_table(trials: list[dict]) -> str:
    from raymcn.results.render import render_table

    names = []
    for t in trials:
        names += [k for k in t["items_s"] if k not in names]
    cols = [f"trial {i + 1}" for i in range(len(trials))]
    rows = [{"item (s)": k, **{c: (f"{t['items_s'][k]:.2f}" if k in t["items_s"] else "-")
                                for c, t in zip(cols, trials)}} for k in names]
    rows.append({"item (s)": "trial wall (its driver's start -> the next one's)",
                 **{c: f"{t['wall_s']:.2f}" for c, t in zip(cols, trials)}})
    rows.append({"item (s)": "fixed cost = wall - steps", **{c: f"{t['fixed_s']:.2f}" for c, t in zip(cols, trials)}})
    return render_table(rows, right=cols)


def steady(trials: list[dict]) -> dict:
    """The means over the trials between the first (Ray's start) and the last (the sweep's end)."""
    middle = [t for t in trials[1:] if t["to_next_trial"]] or trials
    names = {k for t in middle for k in t["items_s"]}
    return {"wall_s": statistics.fmean(t["wall_s"] for t in middle),
            "fixed_s": statistics.fmean(t["fixed_s"] for t in middle),
            "steps_s": statistics.fmean(t["steps_s"] for t in middle),
            "items_s": {k: statistics.fmean(t["items_s"][k] for t in middle if k in t["items_s"]) for k in names},
            "cpu_s": {k: statistics.fmean(t["cpu_s"].get(k, 0.0) for t in middle)
                      for k in {k for t in middle for k in t["cpu_s"]}}, "trials": len(middle)}


def build_parser():
    p = harness.parser(__doc__, smoke="one sweep of one 1-epoch trial on one worker, on a corpus of 64 videos")
    p.add_argument("--trials", type=int, default=4, choices=(1, 2, 3, 4), help="trials per sweep (default 4)")
    p.add_argument("--baseline", metavar="COMMIT", help="also run this commit's tree (it must write the "
                   "timeline: raymcn/train/monitor/timeline.py), alternating with this checkout")
    p.add_argument("--runs", type=int, default=1, help="sweeps of each tree (alternating; default 1)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.trials, args.overrides = SMOKE["trials"], [*SMOKE["overrides"], *args.overrides]
    load0 = procstat.load()
    with harness.Results("trial_cost", args) as results:
        out = measure(args, results)
        print(f"machine: {results.machine}; load average {load0} at the start, {procstat.load()} at the end")
        summary = report(out)
        results.finish({"machine": results.machine, "load_start": load0, "load_end": procstat.load(),
                        "baseline": args.baseline, "trials_per_sweep": args.trials, "steady": summary, "runs": out})
    return 0


def measure(args, results: harness.Results) -> dict[str, list[dict]]:
    """Every sweep (alternating trees): tree -> one entry per run (its trials itemised), printed and
    saved as each ends."""
    out: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="raymcn-trialcost-") as tmp:
        tmp = Path(tmp)
        trees = {"current": REPO}
        if args.baseline:
            from bench.sweep_time import extract

            trees = {"baseline": extract(args.baseline, tmp / "baseline"), **trees}
        order = [list(trees) if i % 2 == 0 else list(reversed(trees)) for i in range(args.runs)]
        with procstat.ProcessSampler(every_s=0.1) as sampler:
            for i, names in enumerate(order):
                for name in names:
                    timeline = tmp / f"timeline-{name}-{i}.jsonl"
                    load = procstat.load()
                    wall = run_sweep(trees[name], args.trials, tmp / f"results-{name}-{i}", timeline, args.overrides)
                    trials = itemise(read_jsonl(timeline), sampler)
                    out.setdefault(name, []).append({"sweep_wall_s": wall, "load_before": load,
                                                     "load_after": procstat.load(), "trials": trials,
                                                     "steady": steady(trials)})
                    results.save(runs=out)
                    print(f"\n{name} (run {i + 1}): sweep of {args.trials} trials {wall:.1f} s (Ray's start and "
                          f"the end included); load average {load} -> {procstat.load()}")
                    print(trial_table(trials))
    return out


def report(out: dict[str, list[dict]]) -> dict:
    """The steady trials' medians per tree, printed; returns them."""
    from raymcn.results.render import render_table

    summary = {name: {"items_s": {}, "cpu_s": {}} for name in out}
    for name, runs in out.items():
        st = [r["steady"] for r in runs]
        for key in ("wall_s", "fixed_s", "steps_s"):
            summary[name][key] = statistics.median(x[key] for x in st)
        for k in {k for x in st for k in x["items_s"]}:
            summary[name]["items_s"][k] = statistics.median(x["items_s"].get(k, 0.0) for x in st)
        for k in {k for x in st for k in x["cpu_s"]}:
            summary[name]["cpu_s"][k] = statistics.median(x["cpu_s"].get(k, 0.0) for x in st)
    names = []
    for runs in out.values():
        for t in runs[0]["trials"]:
            names += [k for k in t["items_s"] if k not in names]
    print("\nsteady trials (the middle ones of each sweep; median over runs), seconds per trial")
    print(render_table([{"item (s)": k, **{n: f"{summary[n]['items_s'].get(k, float('nan')):.2f}" for n in out}}
                        for k in names]
                       + [{"item (s)": lbl, **{n: f"{summary[n][key]:.2f}" for n in out}}
                          for lbl, key in (("trial wall", "wall_s"), ("steps", "steps_s"),
                                           ("fixed cost = wall - steps", "fixed_s"))], right=list(out)))
    kinds = [k for k in procstat.kinds_order() if any(summary[n]["cpu_s"].get(k, 0) >= 0.05 for n in out)]
    print("\nCPU seconds per steady trial, per kind of process")
    print(render_table([{"processes": k, **{n: f"{summary[n]['cpu_s'].get(k, 0.0):.1f}" for n in out}}
                        for k in kinds], right=list(out)))
    return summary


if __name__ == "__main__":
    sys.exit(main())
