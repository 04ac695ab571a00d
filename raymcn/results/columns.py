"""Names shared by the results modules: config keys, result columns, file names, cell formats.

The bottom of the results layer: imports only ``raymcn.config``, so ``table``, ``stats``, ``plots``
and ``watch`` all depend on it and never on each other in a circle.
"""

from __future__ import annotations

from raymcn.config import SWEEP_CONFIG_FILE, metric_of_column  # noqa: F401 - re-exported for the results modules

STAGE_KEY = "schedule.stage_order"
LR_KEY = "optim.lr"
EPOCHS_KEY = "schedule.epochs"
FRACTION_KEY = "schedule.stage1_fraction"
SEED_KEY = "run.seed"
# Derived per trial by table.load_experiment: the epoch at which a staged order adds its third
# modality. No dot in the name, so it is never taken for a swept key (see is_config_key).
SWITCH_EPOCH = "switch_epoch"
# Tune's own clocks look like our step timings (time_*_s) but are not per-step means.
TUNE_TIMES = frozenset({"time_total_s", "time_this_iter_s", "time_since_restore"})


def metric_mode(column: str) -> str:
    """The direction of the metric a column holds, from the table of metrics: ``"max"`` (higher is
    better, R@K) or ``"min"`` (the ranks); for its ``best_``/``final_`` columns too.

    Raises:
        KeyError: the column holds no listed metric.
    """
    m = metric_of_column(column)
    if m is None:
        raise KeyError(f"'{column}' holds no metric of the table (raymcn/config/metrics.py): no direction to order by")
    return m.direction


def is_config_key(col: str) -> bool:
    """A swept config key (``optim.lr``): config keys are dotted, result columns never are."""
    return "." in col


def is_timing_column(col: str) -> bool:
    """Per-step timing columns (``time_*_s``, ``samples_per_s``): CSV always, Markdown on request."""
    return (col.startswith("time_") and "_s" in col) or col.startswith("samples_per_s")


def is_result_column(col: str) -> bool:
    """A per-trial result that is averaged per group (metrics, losses, timings, wall time, epochs)."""
    if is_config_key(col):
        return False
    return col.startswith(("final_", "best_")) or col.endswith(("_loss", "_s")) or col == "epochs"


def cell_spec(col: str) -> str:
    """Format spec by column name: a metric's as its table says (R@K in percent points with 2
    decimals, ranks with 1), losses 4 significant digits, p-values 2 significant digits."""
    if col in ("p", "p_holm"):
        return ".2g"
    metric = metric_of_column(col)
    if metric is not None:
        return metric.spec
    if col.endswith("_loss"):
        return ".4g"
    if col in ("samples_per_s", "wall_s"):
        return ".1f"
    if col.startswith("time_"):
        return ".3g"
    return ".4g"
