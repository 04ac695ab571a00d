"""The retrieval metrics, in one table: for each, what it measures, which way is better, how a cell
shows it and how it is computed from the ranks. Nothing else in raymcn knows a metric: the
evaluation computes what :data:`METRICS` lists, the results table and the console format and order
by it, and ``sweep.metric`` (:func:`objective`) chooses among it. Stdlib only.

Adding a metric is a row of :data:`METRICS` (its formula included) and its reference value in
``tests/test_metrics.py``.

The ranks: the evaluation scores every text query against every gallery clip (video + audio) and
ranks each query's own clip among them, 0-based (the count of clips scoring strictly higher). A
formula receives those ranks as a 1-D numpy integer array, one per query *present* in the eval
set, and ``total``, the count of queries the protocol evaluates. The two differ on MSR-VTT: its
protocol counts 1000 test queries, but only 968 clips have audio, so 32 are absent. Each metric
says which count it is over (:attr:`Metric.over_all_queries`):

* R@K over all 1000 queries: an absent query counts as a miss (the protocol's fixed denominator);
* MedR over the 968 present queries, as the original MCN code computes it;
* MeanR likewise over the present queries: an absent query has no rank to average, and giving it
  one (say the last, 1000) would invent a value the model never produced.

On YouCook2 and the synthetic split every query is present, so the two counts agree.
"""

from __future__ import annotations

import functools
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Callable

from raymcn.config.names import METRIC_PREFIX

MAX, MIN = "max", "min"  # a metric's direction, in Tune's words (TuneConfig's mode)
BEST, FINAL = "best_", "final_"  # a results table's columns per trial: its best epoch's value, its last's


def _recall(k: int, ranks: Any, total: int) -> float:
    """R@K: the percentage of all ``total`` queries whose own clip ranks among the first K."""
    return 100.0 * float((ranks < k).sum()) / total


def _median_rank(ranks: Any, total: int) -> float:
    """MedR: the median 1-based rank of the present queries (``total`` unused)."""
    return float(statistics.median(ranks.tolist())) + 1.0


def _mean_rank(ranks: Any, total: int) -> float:
    """MeanR: the mean 1-based rank of the present queries (``total`` unused)."""
    return float(statistics.fmean(ranks.tolist())) + 1.0


@dataclass(frozen=True)
class Metric:
    """One row of the table.

    ``short``: the name in console lines and headings (``R@10``); :attr:`name` is what an epoch
    reports (``text_to_video_R@10``). ``direction``: :data:`MAX` (higher is better) or :data:`MIN`.
    ``spec``: the format of a table cell and a console value (``".2f"``). ``over_all_queries``:
    True when the value is over all the protocol's queries (an absent one counts against it),
    False when over the present queries only (module doc). ``formula(ranks, total)``: the value
    from the present queries' 0-based ranks (1-D numpy integers) and the protocol's query count.
    ``compact``: also a column of the compact per-trial table (``raymcn watch``, a confirmation's
    runs) beside the sweep's own metric.
    """

    short: str
    meaning: str
    direction: str
    spec: str
    over_all_queries: bool
    formula: Callable[[Any, int], float]
    compact: bool = False

    @property
    def name(self) -> str:
        """The name every epoch reports it under, and the column of the per-epoch curves."""
        return f"{METRIC_PREFIX}_{self.short}"

    @property
    def sign(self) -> int:
        """+1 when higher is better, -1 when lower is: ``sign * value`` is larger for a better value."""
        return 1 if self.direction == MAX else -1

    @property
    def worst(self) -> float:
        """A value worse than any the metric takes, and finite (Ray stores reported metrics as JSON,
        where an infinity becomes null): what a mid-epoch checkpoint reports, so that Ray's
        retention by this metric keeps it only while it is the latest."""
        return -self.sign * sys.float_info.max

    def compute(self, ranks: Any, total: int) -> float:
        return float(self.formula(ranks, total))


# The table. Its order is the order of the results table's columns and of ``raymcn eval``'s output.
METRICS: tuple[Metric, ...] = (
    *(Metric(f"R@{k}", f"recall at {k}: the percentage of the protocol's queries whose clip ranks among the "
                       f"first {k} (an absent query counts as a miss)",
             MAX, ".2f", over_all_queries=True, formula=functools.partial(_recall, k)) for k in (1, 5, 10, 50)),
    Metric("MedR", "the median rank of a query's clip (1 = first), over the present queries",
           MIN, ".1f", over_all_queries=False, formula=_median_rank, compact=True),
    Metric("MeanR", "the mean rank of a query's clip (1 = first), over the present queries",
           MIN, ".1f", over_all_queries=False, formula=_mean_rank),
)
# What a sweep optimizes unless sweep.metric says otherwise: each trial's best R@10.
DEFAULT_OBJECTIVE = f"{BEST}{METRIC_PREFIX}_R@10"


def metric_table() -> tuple[Metric, ...]:
    """The table as it is now (read at every call, so that a test may extend it)."""
    return METRICS


def metric_names() -> tuple[str, ...]:
    """Every listed metric's reported name, in the table's order."""
    return tuple(m.name for m in metric_table())


def metric(name: str) -> Metric:
    """The listed metric reported as ``name`` (``text_to_video_MedR``).

    Raises:
        KeyError: no listed metric has that name; the message lists them.
    """
    for m in metric_table():
        if m.name == name:
            return m
    raise KeyError(f"{name!r} is not a listed metric ({', '.join(metric_names())})")


def metric_of_column(column: str) -> Metric | None:
    """The listed metric whose value a column holds: its reported name, or a results table's
    ``best_``/``final_`` column of it; None for any other column (a loss, a timing)."""
    for m in metric_table():
        if column in (m.name, BEST + m.name, FINAL + m.name):
            return m
    return None


def best_values(best: dict[str, float], metrics: dict[str, float]) -> dict[str, float]:
    """Each listed metric's best value so far, by its ``best_`` name (``best_text_to_video_R@10``):
    for every metric in ``metrics`` (this epoch's) the better of it and ``best``'s (the previous
    epochs'), in the metric's direction; a NaN never replaces a number. A metric this epoch lacks
    keeps its best. What every epoch reports beside its own values: a trial's ``best_`` value of its
    last epoch is then the results table's ``best_`` column, and Tune's best trial by
    ``sweep.metric`` is the one whose last result is best, whichever form it names."""
    out = dict(best)
    for m in metric_table():
        value = metrics.get(m.name)
        if value is None or value != value:  # absent, or NaN
            continue
        before = out.get(BEST + m.name)
        if before is None or before != before or m.sign * float(value) > m.sign * before:
            out[BEST + m.name] = float(value)
    return out


# MLflow refuses '@' in a metric's name and TensorBoard's writer (tensorboardX) turns it into '_':
# both show every reported value under this one spelling of its name, in runs and in sweeps.
TRACKER_AT = "_at_"


def tracker_name(name: str) -> str:
    """The name MLflow and TensorBoard show a reported value under: ``name`` with ``@`` spelled
    :data:`TRACKER_AT` (``text_to_video_R@10`` -> ``text_to_video_R_at_10``, ``best_text_to_video_R@10``
    -> ``best_text_to_video_R_at_10``); any other name unchanged."""
    return name.replace("@", TRACKER_AT)


def retrieval_values(ranks: Any, total: int) -> dict[str, float]:
    """Every listed metric of the present queries' 0-based ``ranks`` (1-D numpy integers) with the
    protocol's ``total`` queries, by reported name."""
    return {m.name: m.compute(ranks, total) for m in metric_table()}


@dataclass(frozen=True)
class Objective:
    """What a sweep optimizes (``sweep.metric``): a listed metric, and which of a trial's values
    counts, its best epoch's (``best_text_to_video_R@10``) or its last epoch's
    (``text_to_video_R@10``, the name each epoch reports it under).

    Tune's searcher and scheduler see every epoch's value (:attr:`reported`) in the metric's
    direction (:attr:`mode`); a finished trial is scored by :attr:`column` of the results table,
    which is also what Tune's best trial is picked by (:attr:`scope`). Every epoch also reports
    the best so far under its ``best_`` name (:func:`best_values`), so a trial's last result holds
    both forms of :attr:`name`: Ray's own ``get_best_result(metric=name, mode=mode)`` picks the
    results table's best trial."""

    metric: Metric
    best: bool

    @property
    def name(self) -> str:
        """The setting's value."""
        return (BEST if self.best else "") + self.metric.name

    @property
    def reported(self) -> str:
        """The name each epoch reports the metric under: Tune's metric, the curves' column."""
        return self.metric.name

    @property
    def column(self) -> str:
        """The results table's per-trial column a trial is judged by."""
        return (BEST if self.best else FINAL) + self.metric.name

    @property
    def mode(self) -> str:
        return self.metric.direction

    @property
    def scope(self) -> str:
        """Tune's scope of a trial's results: ``all`` (its best epoch) or ``last``."""
        return "all" if self.best else "last"


def objective_choices() -> tuple[str, ...]:
    """Every value ``sweep.metric`` takes: per listed metric its best epoch's name, then its last's."""
    return tuple(name for m in metric_table() for name in (BEST + m.name, m.name))


def objective(name: str) -> Objective:
    """``sweep.metric``'s value as an :class:`Objective`.

    Raises:
        ValueError: ``name`` is none of :func:`objective_choices`; the message lists them.
    """
    for m in metric_table():
        if name in (m.name, BEST + m.name):
            return Objective(m, best=name != m.name)
    raise ValueError(f"sweep.metric={name!r}: allowed values are {', '.join(objective_choices())}")
