"""``raymcn watch EXP``: a live view of a sweep that a person leaves open in a terminal.

Every ``--interval`` seconds it re-reads the experiment directory (files only, like ``raymcn
table``: no Ray, safe beside a running sweep), prints the status counts, a compact per-trial table
and the grouped statistics, and rewrites the PNG plots when a trial's files changed. Trials that
are still running are shown with their latest epoch and left out of the statistics; below the
table, each running trial's position inside its epoch (step / steps, samples/s, ETAs: the progress
mark its run writes every few seconds), since an epoch of the lab's size lasts hours. Ctrl-C stops
it cleanly (exit 0); ``--once`` prints one refresh and exits (scripts, tests).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, TextIO

from raymcn.config import CONFIRM_DIR, PROGRESS_FILE
from raymcn.results.columns import SEED_KEY, SWEEP_CONFIG_FILE
from raymcn.results.confirmation import load_confirmation
from raymcn.results.experiment import STATUSES, ExperimentError, load_experiment, sweep_objective
from raymcn.results.table import GroupKeyError, confirmation_report, group_key, report, search_heading

CLEAR = "\x1b[H\x1b[2J"  # cursor home + erase screen: each refresh replaces the last on a terminal
_WATCHED = ("params.json", "result.json", "error.txt")
Signature = tuple[tuple[str, int, int], ...]


def add_watch_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of ``raymcn watch``; returns ``parser``."""
    parser.add_argument("experiment_dir", help="Tune experiment directory (holds raymcn_sweep.yaml and trial dirs)")
    parser.add_argument("--interval", type=_positive, default=5.0, metavar="SECONDS",
                        help="seconds between refreshes (default 5)")
    parser.add_argument("--once", action="store_true", help="print one refresh and exit")
    parser.add_argument("--group-by", metavar="KEY", default=None,
                        help="statistics per value of KEY (default: schedule.stage_order when swept)")
    parser.add_argument("--no-plots", action="store_true", help="do not (re)write the PNG plots")
    return parser


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def signature(exp_dir: Path) -> Signature:
    """(path, mtime_ns, size) of every file the table reads: equal signatures mean equal plots."""
    out = []
    phases = [exp_dir, *[p for p in [exp_dir / CONFIRM_DIR] if p.is_dir()]]
    for path in [exp_dir / SWEEP_CONFIG_FILE, *(f for e in phases for f in e.glob("experiment_state-*.json")),
                 *(d / name for e in phases for d in e.iterdir() if d.is_dir() for name in _WATCHED)]:
        try:
            st = path.stat()
        except OSError:  # absent, or removed while we looked
            continue
        out.append((str(path.relative_to(exp_dir)), st.st_mtime_ns, st.st_size))
    return tuple(sorted(out))


def refresh(exp_dir: Path, by: str | None, plots: bool, last: Signature | None,
            now: str) -> tuple[str, Signature | None]:
    """The text of one refresh and the signature the plots now reflect (``last`` when they were
    not rewritten).

    Raises:
        GroupKeyError: ``by`` is not a column (a usage error, not a state of the sweep).
    """
    head = f"raymcn watch {exp_dir}  ({now})"
    try:
        target = sweep_objective(exp_dir)
    except ExperimentError as e:  # its sweep file names a metric the table does not list
        return f"{head}\n{e}\n", last
    try:
        sig = signature(exp_dir)
        trials, curves = load_experiment(exp_dir)
    except ExperimentError:
        return f"{head}\nno trial in {exp_dir} yet: waiting for the sweep's first trial\n", last
    except OSError as e:  # a file vanished between listing and reading: the next refresh will do
        return f"{head}\ncould not read {exp_dir} ({e}); retrying\n", last
    counts = trials["status"].value_counts()
    conf = load_confirmation(exp_dir)
    lines = [head, f"{len(trials)} trials: " + ", ".join(f"{int(counts.get(s, 0))} {s}" for s in STATUSES), "",
             report(trials, group_key(trials, by), target, brief=True,
                    heading=search_heading(trials, group_key(trials, by), conf))]
    if conf is not None:
        lines += [confirmation_report(conf)]
    inside = in_epoch_lines(exp_dir, sorted(trials.loc[trials["status"] == "running", "trial"]), time.time())
    if inside:
        lines += ["", "inside the epoch (running trials):", *inside]
    if plots:
        if sig != last:
            from raymcn.results.plots import write_plots  # matplotlib only when plots are wanted

            skipped: list[str] = []
            written = write_plots(exp_dir, trials, curves, target, on_skip=skipped.append,
                                  prefix="search_" if conf is not None else "")
            if conf is not None and len(conf.trials):
                written += write_plots(exp_dir, conf.trials, conf.curves, conf.objective, on_skip=skipped.append,
                                       by=conf.settings.group_column, pair_on=[SEED_KEY], phase="confirmation")
            lines.append(f"plots rewritten at {now}: " + ", ".join(p.name for p in written) + f" in {exp_dir}")
            lines += [f"skipped {s}" for s in skipped]
            last = sig
        else:
            lines.append("plots unchanged (no trial reported since the last refresh)")
    lines.append(f"TensorBoard: tensorboard --logdir {exp_dir}")
    return "\n".join(lines) + "\n", last


def in_epoch_lines(exp_dir: Path, trial_ids: list[str], now: float) -> list[str]:
    """One line per trial with a progress mark (``train/train-<id>/raymcn_progress.json``, whose
    ``line`` is the run's own progress line), with the mark's age."""
    lines = []
    for tid in trial_ids:
        try:
            mark = json.loads((exp_dir / "train" / f"train-{tid}" / PROGRESS_FILE).read_text())
            line = str(mark["line"])
        except (OSError, ValueError, KeyError, TypeError):  # none yet, or caught mid-write
            continue
        age = max(0.0, now - float(mark.get("time", now)))
        lines.append(f"trial {tid}: {line}  ({age:.0f} s ago)")
    return lines


def run_watch(args: argparse.Namespace, sleep: Callable[[float], None] = time.sleep,
              out: TextIO | None = None, clock: Callable[[], str] = lambda: time.strftime("%H:%M:%S")) -> int:
    """Refresh until Ctrl-C (or once with ``--once``). 0 on Ctrl-C or after ``--once``; 2 when the
    directory does not exist or ``--group-by`` names no column. ``sleep``, ``out`` and ``clock``
    are injectable for tests."""
    out = out or sys.stdout
    exp_dir = Path(args.experiment_dir).expanduser()
    if not exp_dir.is_dir():
        print(f"raymcn watch: experiment directory {exp_dir} does not exist", file=sys.stderr)
        return 2
    clear = not args.once and out.isatty()
    last: Signature | None = None
    try:
        while True:
            try:
                text, last = refresh(exp_dir, args.group_by, not args.no_plots, last, clock())
            except GroupKeyError as e:
                print(f"raymcn watch: {e.args[0]}", file=sys.stderr)
                return 2
            if args.once:
                out.write(text)
                return 0
            out.write((CLEAR if clear else "\n") + text + f"refresh every {args.interval:g} s; Ctrl-C to stop\n")
            out.flush()
            sleep(args.interval)
    except KeyboardInterrupt:
        out.write(f"\nstopped watching {exp_dir}\n")
        out.flush()
        return 0


def main_watch(argv: list[str] | None = None) -> int:
    """``raymcn watch EXPERIMENT_DIR [--interval S] [--once] [--group-by KEY] [--no-plots]``."""
    parser = add_watch_arguments(argparse.ArgumentParser(prog="raymcn watch", description=__doc__.splitlines()[0]))
    return run_watch(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover - `python -m raymcn.results.watch EXP`
    sys.exit(main_watch())
