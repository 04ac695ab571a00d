"""Results layer: a Tune experiment directory -> per-trial table (Markdown/CSV) and PNG plots.

Reads files only and never imports Ray. ``plots`` (matplotlib) is imported lazily so the table
works without paying for matplotlib.
"""

from raymcn.results.table import (
    ExperimentError,
    add_table_arguments,
    format_table,
    group_table,
    load_experiment,
    main_table,
    run_table,
)

__all__ = ["ExperimentError", "add_table_arguments", "format_table", "group_table", "load_experiment",
           "main_table", "run_table", "write_plots"]


def __getattr__(name: str):
    if name == "write_plots":
        from raymcn.results.plots import write_plots

        return write_plots
    raise AttributeError(name)
