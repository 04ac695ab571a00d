"""PNG plots of a sweep, written into its experiment directory.

Uses matplotlib's object API with the Agg canvas directly (never ``pyplot``): no GUI backend, no
global figure state, safe on a headless server and inside a caller that already uses pyplot.
Every plot colours trials by ``schedule.stage_order`` (the lab's research question) with one fixed
colour per order, so the three plots can be read side by side.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from raymcn.config import PRIMARY_METRIC, STAGE_ORDERS
from raymcn.results.table import LR_KEY, PRIMARY_BEST, STAGE_KEY

LEARNING_CURVES = "learning_curves.png"
BEST_BY_ORDER = "best_by_stage_order.png"
METRIC_VS_LR = "metric_vs_lr.png"
_ALL = "all trials"  # the single group when the stage order was not swept


def _groups(trials: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(label, trials) per stage order: the declared orders first, in STAGE_ORDERS order."""
    if STAGE_KEY not in trials:
        return [(_ALL, trials)]
    present = [str(v) for v in trials[STAGE_KEY].dropna().unique()]
    labels = [o for o in STAGE_ORDERS if o in present] + sorted(set(present) - set(STAGE_ORDERS))
    return [(o, trials[trials[STAGE_KEY].astype(str) == o]) for o in labels]


def _colour(label: str) -> str:
    # fixed per order (not per plot) so AV_T has the same colour in every figure
    known = list(STAGE_ORDERS) + [_ALL]
    return f"C{known.index(label)}" if label in known else f"C{len(known) + zlib.crc32(label.encode()) % 5}"


def _new_figure(width: float = 7.0, height: float = 4.5):
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    return path


def plot_learning_curves(trials: pd.DataFrame, curves: pd.DataFrame, path: Path) -> Path | str:
    """Primary metric vs epoch, one line per trial, one legend entry per stage order."""
    if PRIMARY_METRIC not in curves or curves[PRIMARY_METRIC].notna().sum() == 0:
        return f"no trial reported {PRIMARY_METRIC}"
    fig, ax = _new_figure()
    for label, group in _groups(trials):
        first = True
        for tid in group["trial"]:
            c = curves[(curves["trial"] == tid) & curves[PRIMARY_METRIC].notna()]
            if c.empty:
                continue
            ax.plot(c["epoch"], c[PRIMARY_METRIC], color=_colour(label), alpha=0.8, marker=".",
                    label=label if first else None)
            first = False
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
    ax.set(xlabel="epoch", ylabel=PRIMARY_METRIC, title="learning curves")
    ax.grid(alpha=0.3)
    ax.legend(title=STAGE_KEY if STAGE_KEY in trials else None)
    return _save(fig, path)


def plot_best_by_order(trials: pd.DataFrame, path: Path) -> Path | str:
    """Best primary metric per trial (points) and the per-order mean ± std (marker + error bar)."""
    if STAGE_KEY not in trials:
        return f"{STAGE_KEY} was not swept"
    if trials[PRIMARY_BEST].notna().sum() == 0:
        return f"no trial reported {PRIMARY_METRIC}"
    fig, ax = _new_figure()
    groups = _groups(trials)
    for x, (label, group) in enumerate(groups):
        y = group[PRIMARY_BEST].dropna().to_numpy(float)
        if y.size == 0:
            continue
        # deterministic spread so overlapping trials stay visible
        ax.scatter(x + np.linspace(-0.15, 0.15, y.size) if y.size > 1 else [x], y, color=_colour(label), alpha=0.6)
        std = y.std(ddof=1) if y.size > 1 else 0.0
        ax.errorbar([x + 0.3], [y.mean()], yerr=[std], fmt="D", color="black", capsize=4)
    # n = trials with a value / trials in the order (errored-before-reporting trials have none)
    ax.set_xticks(range(len(groups)), [f"{lab}\n(n={g[PRIMARY_BEST].notna().sum()}/{len(g)})" for lab, g in groups])
    ax.set(ylabel=PRIMARY_BEST, title="best per stage order (diamond: mean ± std, ddof=1)")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def plot_metric_vs_lr(trials: pd.DataFrame, path: Path) -> Path | str:
    """Best primary metric vs learning rate (log x), coloured by stage order."""
    if LR_KEY not in trials:
        return f"{LR_KEY} was not swept"
    lr = pd.to_numeric(trials[LR_KEY], errors="coerce")
    ok = lr.gt(0) & trials[PRIMARY_BEST].notna()
    if not ok.any():
        return f"no trial has both a positive {LR_KEY} and {PRIMARY_METRIC}"
    fig, ax = _new_figure()
    for label, group in _groups(trials[ok]):
        ax.scatter(pd.to_numeric(group[LR_KEY]), group[PRIMARY_BEST], color=_colour(label), label=label)
    ax.set_xscale("log")
    ax.set(xlabel=LR_KEY, ylabel=PRIMARY_BEST, title="best metric vs learning rate")
    ax.grid(alpha=0.3, which="both")
    ax.legend(title=STAGE_KEY if STAGE_KEY in trials else None)
    return _save(fig, path)


def write_plots(exp_dir: str | Path, trials: pd.DataFrame, curves: pd.DataFrame,
                on_skip: Callable[[str], None] | None = None) -> list[Path]:
    """Write ``learning_curves.png``, ``best_by_stage_order.png`` and ``metric_vs_lr.png`` into
    ``exp_dir`` and return the paths written. A plot whose column is absent (e.g. lr not swept) is
    skipped; ``on_skip`` receives "NAME: reason" (default: printed to stderr)."""
    exp_dir = Path(exp_dir)
    on_skip = on_skip or (lambda msg: print(f"skipped {msg}", file=sys.stderr))
    results = [(LEARNING_CURVES, plot_learning_curves(trials, curves, exp_dir / LEARNING_CURVES)),
               (BEST_BY_ORDER, plot_best_by_order(trials, exp_dir / BEST_BY_ORDER)),
               (METRIC_VS_LR, plot_metric_vs_lr(trials, exp_dir / METRIC_VS_LR))]
    written = []
    for name, outcome in results:
        if isinstance(outcome, Path):
            written.append(outcome)
        else:
            on_skip(f"{name}: {outcome}")
    return written
