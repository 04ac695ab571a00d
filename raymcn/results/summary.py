"""The end of ``raymcn sweep``, on one screen: what ran, the answer's table and line, where the rest is.

The per-trial tables and the mean ± std of every metric run to 20 columns, more than 400
characters a line: a terminal wraps them into noise. So a finished sweep prints

* one line per phase: its trials, the errored ones, its folder; then the code, environment, data
  and hosts its runs had, named once (``origins.made_by``: each value with its runs where they differ);
* the table the answer rests on, at most :data:`MAX_WIDTH` characters wide: the confirmation's
  statistics per group (or, without a confirmation, the search's), the columns a reader needs
  to judge the answer (the rule and the notes stay in ``raymcn table``);
* the answer line (a confirmation's);
* where the plots and the full tables are: every table as CSV under ``EXP/tables/``, and
  ``raymcn table EXP`` prints them all as Markdown.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pandas as pd

from raymcn.results.columns import SEED_KEY, cell_spec
from raymcn.results.confirmation import load_confirmation
from raymcn.results.experiment import ExperimentError, load_experiment, sweep_objective
from raymcn.results.origins import made_by, run_origins
from raymcn.results.render import format_cell, render_table
from raymcn.results.table import (
    _ci,
    answer_line,
    compact,
    confirmation_caution,
    confirmation_grouped,
    group_key,
    group_table,
    search_caution,
    without_timing,
    write_tables,
)

MAX_WIDTH = 160  # characters: the widest line the end of a sweep prints
TABLES_DIR = "tables"


def phase_line(what: str, trials: pd.DataFrame, where: str | Path) -> str:
    """``search: 8 trials (0 errored) in EXP``: counted from the trials' folders, so a resumed or a
    confirmed sweep names each phase with its own numbers."""
    errored = int((trials["status"] == "error").sum()) if "status" in trials else 0
    return f"{what}: {len(trials)} trials ({errored} errored) in {where}"


def answer_table(grouped: pd.DataFrame, by: str, confirmation: bool, metric: str) -> str:
    """The group statistics of ``metric`` (the sweep's) a reader judges the answer by, as a
    Markdown table of at most :data:`MAX_WIDTH` characters (the widest group label permitting):
    n, mean, 95 % interval, the difference to the best group, its test and pairs, Holm's p and
    the detectable difference."""
    spec, best = cell_spec(metric), grouped[by].iloc[0]
    tested = grouped["test"] != ""
    counts = {"seeds": grouped["n_finished"]} if confirmation else {
        "trials": grouped["n"], "n (full budget)": grouped["n_finished"]}
    view = pd.DataFrame({
        by: grouped[by], **counts,
        "mean": [format_cell(v, spec) for v in grouped[f"{metric}_mean"]],
        "95% CI (t)": [_ci(lo, hi, spec) for lo, hi in zip(grouped["ci95_low"], grouped["ci95_high"])],
        f"Δ vs {best}": [format_cell(v, "+" + spec) for v in grouped["vs_best"]],
        "test": grouped["test"].where(tested, None),
        "pairs": grouped["pairs"].where(tested).astype("Int64"),
        "p (Holm)": [format_cell(v, ".2g") for v in grouped["p_holm"]],
        "detectable Δ": [format_cell(v, spec) for v in grouped["mde"]]})
    right = ("mean", "95% CI (t)", f"Δ vs {best}", "p (Holm)", "detectable Δ")
    for drop in ([], ["detectable Δ"], ["detectable Δ", "pairs"]):  # only if a group's label is very long
        table = render_table(view.drop(columns=drop), "md", right=right)
        if max(map(len, table.splitlines())) <= MAX_WIDTH:
            break
    return table


def seed_list(seeds: list[int]) -> str:
    """``seeds 2 and 3``, ``seeds 2, 3 and 4``, ``seed 2``: read as seeds, never as a count."""
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    return f"seeds {', '.join(map(str, seeds[:-1]))} and {seeds[-1]}"


def sweep_summary(exp_dir: str | Path, plots: bool = True) -> str:
    """The end of a finished (or interrupted) sweep in ``exp_dir`` (a local folder): see the module
    doc. Writes the CSV tables and (``plots``) the plots as ``raymcn table`` does."""
    exp_dir = Path(exp_dir).expanduser()
    try:
        trials, curves = load_experiment(exp_dir)
        target = sweep_objective(exp_dir)
    except ExperimentError as e:
        return f"no results yet: {e}\n"
    conf = load_confirmation(exp_dir)
    by = group_key(trials, None)
    origins = run_origins(exp_dir, trials["trial"])
    lines = [phase_line("search", trials, exp_dir)]
    if conf is not None:
        lines.append(phase_line("confirmation", conf.trials, exp_dir / "confirm"))
    lines += [*made_by({"search": origins, **({"confirmation": conf.origins} if conf is not None else {})}), ""]
    if conf is not None and len(conf.trials):
        s = conf.settings
        grouped = confirmation_grouped(conf)
        done = int((conf.trials["status"] == "done").sum())
        metric = conf.objective.column
        lines += [f"{metric} by {s.group_column}, confirmation over {seed_list(conf.seeds)}: "
                  f"{done} of {conf.planned} runs done", "",
                  answer_table(grouped, s.group_column, True, metric).rstrip("\n"), "",
                  answer_line(grouped, s.group_column, done, conf.planned, metric,
                              caution=confirmation_caution(conf)).rstrip("\n")]
    elif by is not None:
        metric = target.column
        grouped = group_table(trials, by, metric)
        if f"{metric}_mean" in grouped and not grouped[f"{metric}_mean"].isna().all():
            lines += [f"{metric} by {by}, search:", "", answer_table(grouped, by, False, metric).rstrip("\n")]
            if said := search_caution(trials, by, origins):
                lines += ["", *_wrapped(said)]
    else:
        view = without_timing(compact(trials, target))
        if target.column in view:
            view = view.sort_values(target.column, ascending=target.mode == "min", na_position="last")
        from raymcn.results.table import format_table

        lines += [f"the best trials by {target.column}:", "", format_table(view.head(10), "md").rstrip("\n")]
    written = []
    if plots:
        from raymcn.results.plots import write_plots  # matplotlib only when plots are written

        skipped = lambda msg: print(f"skipped {msg}", file=sys.stderr)  # noqa: E731
        written = write_plots(exp_dir, trials, curves, target, on_skip=skipped,
                              prefix="search_" if conf is not None else "")
        if conf is not None and len(conf.trials):
            written += write_plots(exp_dir, conf.trials, conf.curves, conf.objective, on_skip=skipped,
                                   by=conf.settings.group_column, pair_on=[SEED_KEY], phase="confirmation")
    tables = write_tables(exp_dir / TABLES_DIR, trials, by, conf, target)
    lines.append("")
    if written:
        lines += _wrapped(f"plots in {exp_dir}: " + ", ".join(p.name for p in written))
    lines += _wrapped(f"full tables (every trial and metric, CSV) in {exp_dir / TABLES_DIR}: "
                      + ", ".join(p.name for p in tables))
    # the command on a line of its own, to copy whole
    lines += ["every table, with the statistics' rules and notes:", f"  raymcn table {exp_dir}"]
    return "\n".join(lines) + "\n"


def _wrapped(text: str) -> list[str]:
    return textwrap.wrap(text, 100, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)
