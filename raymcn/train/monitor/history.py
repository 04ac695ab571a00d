"""A run's per-epoch metrics as a CSV beside its checkpoints (``metrics.csv``), for pandas and spreadsheets.

Rank 0 rewrites the file after every epoch's report (a few hundred bytes an epoch; a bucket has
no append), one row per epoch with every metric the epoch reported: the loss terms, R@1/5/10,
MedR, the timing phases, samples/s, the data counters. An epoch replayed after a restart
replaces its own row, so the file holds each epoch once, as the uninterrupted run would. No Ray.
"""

from __future__ import annotations

import csv
import io

from raymcn import storage
from raymcn.config import METRICS_FILE


def record_epoch(run_dir: str, metrics: dict[str, float]) -> None:
    """Add (or replace) the row of ``metrics["epoch"]`` in ``run_dir``/metrics.csv."""
    path = storage.join(run_dir, METRICS_FILE)
    try:
        rows = list(csv.DictReader(io.StringIO(storage.read_text(path))))
    except FileNotFoundError:
        rows = []
    rows = [r for r in rows if float(r.get("epoch") or "nan") != float(metrics["epoch"])]
    rows.append({k: repr(float(v)) for k, v in metrics.items()})
    rows.sort(key=lambda r: float(r["epoch"]))
    columns = ["epoch", *sorted({k for r in rows for k in r} - {"epoch"})]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, restval="")
    writer.writeheader()
    writer.writerows(rows)
    storage.write_text(path, out.getvalue())
