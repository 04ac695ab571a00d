"""PNG plots of a sweep, written into its experiment directory.

Uses matplotlib's object API with the Agg canvas directly (never ``pyplot``): no GUI backend, no
global figure state, safe on a headless server and inside a caller that already uses pyplot.
Every plot colours trials by ``schedule.stage_order`` (the lab's research question) with one fixed
colour per order, so the plots can be read side by side. Files are replaced atomically, so a
viewer that reloads them while ``raymcn watch`` rewrites them never sees half a PNG.
"""

from __future__ import annotations

import math
import os
import sys
import zlib
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from raymcn.config import STAGE_ORDERS, Objective
from raymcn.results.columns import LR_KEY, STAGE_KEY, SWITCH_EPOCH
from raymcn.results.stats import counted, group_statistics

LEARNING_CURVES = "learning_curves.png"
BEST_BY_ORDER = "best_by_stage_order.png"
METRIC_VS_LR = "metric_vs_lr.png"
_ALL = "all trials"  # the single group when the stage order was not swept
_JOINS = {"AV_T": "text", "VT_A": "audio", "AT_V": "video"}  # the modality stage 2 adds


def _groups(trials: pd.DataFrame, by: str = STAGE_KEY) -> list[tuple[str, pd.DataFrame]]:
    """(label, trials) per value of ``by``: the declared stage orders first, in STAGE_ORDERS order
    (a confirmation's candidates "AV_T #2" sort with their order)."""
    if by not in trials:
        return [(_ALL, trials)]
    def place(label: str) -> tuple[int, str]:
        order = _order_of(label)
        return STAGE_ORDERS.index(order) if order in STAGE_ORDERS else len(STAGE_ORDERS), label

    labels = sorted((str(v) for v in trials[by].dropna().unique()), key=place)
    return [(o, trials[trials[by].astype(str) == o]) for o in labels]


def _order_of(label: str) -> str:
    """The stage order a label names: itself, or the order of a candidate label "AV_T #2"."""
    return label.split(" #")[0]


def _colour(label: str) -> str:
    # fixed per order (not per plot) so AV_T has the same colour in every figure
    known = list(STAGE_ORDERS) + [_ALL]
    label = label if label in known else _order_of(label)
    return f"C{known.index(label)}" if label in known else f"C{len(known) + zlib.crc32(label.encode()) % 5}"


def _new_figure(width: float = 7.0, height: float = 4.5) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path) -> Path:
    """Write to a hidden temporary file beside ``path``, then rename over it (atomic on POSIX)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fig.savefig(tmp, dpi=110, format="png")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _mark_switch(ax, label: str, switches: pd.Series) -> None:
    """Shade stage 1 and draw a dashed line at each distinct switch epoch of the panel's trials,
    labelled with the modality that joins (``+ text`` for AV_T)."""
    values = sorted({round(float(s), 6) for s in switches.dropna()})
    for i, s in enumerate(values):
        ax.axvspan(ax.get_xlim()[0] if i == 0 else values[i - 1], s, color="0.5", alpha=0.08, lw=0)
        ax.axvline(s, color="0.25", ls="--", lw=1.2)
        joins = f"+ {_JOINS[_order_of(label)]}" if _order_of(label) in _JOINS else "stage 2"
        ax.annotate(f"{joins} (epoch {s:g})", xy=(s, 1.0), xycoords=("data", "axes fraction"), xytext=(4, -4),
                    textcoords="offset points", ha="left", va="top", fontsize=8.5, color="0.2")


def learning_curves_figure(trials: pd.DataFrame, curves: pd.DataFrame, target: Objective, by: str = STAGE_KEY,
                           phase: str = "") -> Figure | str:
    """The sweep's metric (``target``) vs epoch: one panel per stage order (per value of ``by``;
    shared axes), one line per trial; a staged order's panel shades stage 1 and marks the switch
    epoch (``switch_epoch`` column). ``phase`` ("confirmation") goes into the title."""
    metric = target.reported
    if metric not in curves or curves[metric].notna().sum() == 0:
        return f"no trial reported {metric}"
    groups = _groups(trials, by)
    ncols = 1 if len(groups) == 1 else 2
    nrows = math.ceil(len(groups) / ncols)
    fig = _new_figure(7.0 if ncols == 1 else 11.0, 1.0 + 3.2 * nrows)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False)).ravel()
    last_epoch = max(1, int(curves["epoch"].max()))
    for ax, (label, group) in zip(axes, groups):
        drawn = 0
        for tid in group["trial"]:
            c = curves[(curves["trial"] == tid) & curves[metric].notna()]
            if not c.empty:
                ax.plot(c["epoch"], c[metric], color=_colour(label), alpha=0.75, lw=1.4, marker=".", ms=4)
                drawn += 1
        ax.set_xlim(0.5, last_epoch + 0.5)
        if SWITCH_EPOCH in group:
            _mark_switch(ax, label, group[SWITCH_EPOCH])
        count = f"{drawn} trial{'s' if drawn != 1 else ''}"
        title = count if label == _ALL else f"{label}: {count}" + (" (one stage)" if label == "joint" else "")
        ax.set_title(title, fontsize=10, color=_colour(label), loc="left")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
    for ax in axes[len(groups):]:
        ax.set_visible(False)
    fig.supxlabel("epoch")
    fig.supylabel(metric + " (lower is better)" * (target.mode == "min"))
    staged = SWITCH_EPOCH in trials and trials[SWITCH_EPOCH].notna().any()
    fig.suptitle(f"{phase} learning curves".strip().capitalize()
                 + (" (shaded: stage 1, dashed: stage switch)" if staged else ""))
    return fig


def best_by_order_figure(trials: pd.DataFrame, target: Objective, by: str = STAGE_KEY,
                         pair_on: list[str] | None = None, phase: str = "") -> Figure | str:
    """The sweep's metric per trial (``target.column``; filled dots: finished trials, the ones
    counted; hollow: running or errored) and per order the mean with its 95 % t-interval (black
    diamond and error bar; none for n = 1); tick labels give n and the Holm-adjusted p-value of the
    test against the best order (by the metric's direction), "(W)" when it is Welch's. The y range
    follows the dots and the intervals of n >= 3; a wider interval (n = 2: t(0.975, 1) = 12.7) is
    cut at the edge and its end printed there.
    ``by``, ``pair_on``: the groups and the pairing (a confirmation: candidates, paired on the
    seed); ``phase`` goes into the title."""
    if by not in trials:
        return f"{by} was not swept"
    column = target.column
    if trials[column].notna().sum() == 0:
        return f"no trial reported {target.reported}"
    stats = group_statistics(trials, by, column, pair_on=pair_on)
    stats.index = stats.index.map(str)
    best = stats.index[0]
    fig = _new_figure(8.0, 5.0)
    ax = fig.add_subplot()
    groups = _groups(trials, by)
    rng = np.random.default_rng(0)  # fixed jitter: the same picture on every refresh
    ticks, bars, span = [], [], list(trials[column].dropna().to_numpy(float))
    for x, (label, group) in enumerate(groups):
        s = stats.loc[label]
        ticks.append(f"{label}\nn={int(s['n'])}" + _p_label(label, best, s))
        is_counted = counted(group).to_numpy()
        y = group[column].to_numpy(float)
        jitter = x - 0.12 + rng.uniform(-0.08, 0.08, y.size)
        ax.scatter(jitter[is_counted], y[is_counted], color=_colour(label), alpha=0.65, s=28, zorder=2)
        ax.scatter(jitter[~is_counted], y[~is_counted], facecolors="none", edgecolors=_colour(label), s=28, zorder=2)
        if s["n"] == 0:
            continue
        mean, low, high = s["mean"], s["ci95_low"], s["ci95_high"]
        bars.append((x + 0.14, mean, low, high))
        if s["n"] >= 3:
            span += [low, high]
        ax.errorbar([x + 0.14], [mean], yerr=None if math.isnan(low) else [[mean - low], [high - mean]],
                    fmt="D", color="black", ms=6, capsize=5, lw=1.5, zorder=3)
        if math.isnan(low):
            ax.annotate("no CI (n=1)", (x + 0.14, mean), xytext=(6, 0), textcoords="offset points",
                        va="center", fontsize=8, color="0.3")
    _clip_y(ax, span, bars)
    ax.set_xticks(range(len(groups)), ticks)
    ax.set_xlim(-0.5, len(groups) - 0.5)
    # the x axis is categorical, so its label is free to say what the p under each order means
    sharing = "seed" if pair_on else "seed and config"
    ax.set_xlabel(f"p: Holm-adjusted, two-sided, against {best} (paired t-test over trials sharing {sharing};"
                  "\n(W): Welch's t-test, no pairs)", fontsize=8.5, color="0.25")
    ax.set_ylabel(column + " (lower is better)" * (target.mode == "min"))
    ax.set_title(f"{phase}: " * bool(phase) + f"{'best' if target.best else 'final'} {target.reported} per stage order"
                 + (" (each point one seed, full budget)" if phase else ""), fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    handles = [Line2D([], [], ls="", marker="o", color="0.5", alpha=0.65, label="one trial at the full budget"),
               Line2D([], [], ls="-", marker="D", color="black", label="mean and 95% CI (t-interval)")]
    if not counted(trials[trials[column].notna()]).all():
        handles.insert(1, Line2D([], [], ls="", marker="o", markerfacecolor="none", color="0.4",
                                 label="stopped early, running or errored (not counted)"))
    ax.legend(handles=handles, loc="best", fontsize=8.5)
    return fig


def _clip_y(ax, span: list[float], bars: list[tuple[float, float, float, float]]) -> None:
    """y range = ``span`` + 8 % padding; the end of an interval beyond it is printed at the edge."""
    lo, hi = float(np.nanmin(span)), float(np.nanmax(span))
    pad = 0.08 * (hi - lo) if hi > lo else max(1.0, 0.05 * abs(hi))
    bottom, top = lo - pad, hi + pad
    ax.set_ylim(bottom, top)
    for x, _, low, high in bars:
        for end, edge, va, sign in ((low, bottom, "bottom", "↓"), (high, top, "top", "↑")):
            if not math.isnan(end) and (end < edge if sign == "↓" else end > edge):
                ax.annotate(f"{sign} {end:.3g}", (x, edge), xytext=(5, 3 if sign == "↓" else -3),
                            textcoords="offset points", ha="left", va=va, fontsize=8, color="0.3")


def _p_label(label: str, best: str, s: pd.Series) -> str:
    if label == best:
        return "\nbest mean"
    if not s["test"] or pd.isna(s["p_holm"]):
        return "\nno test"
    return f"\np={s['p_holm']:.2g}" + ("" if s["test"].startswith("paired") else " (W)")


def metric_vs_lr_figure(trials: pd.DataFrame, target: Objective) -> Figure | str:
    """The sweep's metric per trial (``target.column``) vs learning rate (log x), coloured by stage order."""
    if LR_KEY not in trials:
        return f"{LR_KEY} was not swept"
    column = target.column
    lr = pd.to_numeric(trials[LR_KEY], errors="coerce")
    ok = lr.gt(0) & trials[column].notna()
    if not ok.any():
        return f"no trial has both a positive {LR_KEY} and {target.reported}"
    if lr[ok].nunique() < 2:  # one column of dots says nothing about the learning rate
        return f"{LR_KEY} has a single value"
    fig = _new_figure()
    ax = fig.add_subplot()
    for label, group in _groups(trials[ok]):
        ax.scatter(pd.to_numeric(group[LR_KEY]), group[column], color=_colour(label), label=label, alpha=0.75)
    ax.set_xscale("log")
    ax.set(xlabel=LR_KEY, ylabel=column + " (lower is better)" * (target.mode == "min"),
           title=f"{'best' if target.best else 'final'} metric vs learning rate")
    ax.grid(alpha=0.3, which="both")
    ax.legend(title=STAGE_KEY if STAGE_KEY in trials else None)
    return fig


def write_plots(exp_dir: str | Path, trials: pd.DataFrame, curves: pd.DataFrame, target: Objective,
                on_skip: Callable[[str], None] | None = None, *, prefix: str = "", by: str = STAGE_KEY,
                pair_on: list[str] | None = None, phase: str = "") -> list[Path]:
    """Write ``learning_curves.png``, ``best_by_stage_order.png`` and ``metric_vs_lr.png`` (each
    name behind ``prefix``) of the sweep's metric ``target`` into ``exp_dir`` and return the paths
    written. A plot whose column is
    absent (e.g. lr not swept) is skipped; ``on_skip`` receives "NAME: reason" (default: printed to
    stderr). Each figure is built by ``<name>_figure``, which returns the reason instead when it
    cannot be drawn. ``by``, ``pair_on``, ``phase``: see :func:`best_by_order_figure`; a
    confirmation (``phase``) has one configuration per group, so no learning-rate plot."""
    exp_dir = Path(exp_dir)
    on_skip = on_skip or (lambda msg: print(f"skipped {msg}", file=sys.stderr))
    figures = [(LEARNING_CURVES, learning_curves_figure(trials, curves, target, by, phase)),
               (BEST_BY_ORDER, best_by_order_figure(trials, target, by, pair_on, phase))]
    if not phase:
        figures.append((METRIC_VS_LR, metric_vs_lr_figure(trials, target)))
    written = []
    for name, outcome in figures:
        if isinstance(outcome, Figure):
            written.append(_save(outcome, exp_dir / f"{prefix}{name}"))
        else:
            on_skip(f"{prefix}{name}: {outcome}")
    return written
