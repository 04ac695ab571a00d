"""Results layer: a Tune experiment directory -> per-trial and per-group tables (Markdown/CSV),
statistics, PNG plots and a live view.

Modules, each importing only those before it (no cycle): ``columns`` (names) -> ``render`` (the one
table printer) -> ``stats`` (intervals, tests) -> ``experiment`` (reading) -> ``plots`` (matplotlib)
-> ``table`` (tables, ``raymcn table``) -> ``watch`` (``raymcn watch``). Reads files only and never
imports Ray or torch. ``plots`` (matplotlib) is imported lazily so the table works without it.
"""

from raymcn.results.experiment import ExperimentError, load_experiment
from raymcn.results.render import render_table
from raymcn.results.table import add_table_arguments, format_table, group_table, main_table, run_table

__all__ = ["ExperimentError", "add_table_arguments", "format_table", "group_table", "load_experiment",
           "main_table", "render_table", "run_table", "write_plots"]


def __getattr__(name: str):
    if name == "write_plots":
        from raymcn.results.plots import write_plots

        return write_plots
    raise AttributeError(name)
