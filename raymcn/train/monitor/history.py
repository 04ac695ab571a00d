"""A run's per-epoch metrics as a CSV beside its checkpoints (``metrics.csv``), for pandas and spreadsheets.

Rank 0 rewrites the file after every epoch's report (a few hundred bytes an epoch; a bucket has
no append), one row per epoch with every metric the epoch reported: the loss terms, the
retrieval metrics, the timing phases, samples/s, the data counters. An epoch replayed after a
restart replaces its own row, so the file holds each epoch once, as the uninterrupted run would,
and a row whose write failed is written with the next epoch's (:class:`EpochTable`). No Ray.
"""

from __future__ import annotations

import csv
import io

from raymcn import storage
from raymcn.config import METRICS_FILE


class EpochTable:
    """A run's metrics.csv, held by rank 0: the rows of the file as it found it (a resumed run's),
    plus every epoch since, rewritten whole after each epoch. A write that fails (storage full or
    read-only for a while) loses nothing: the next epoch's write carries the row it could not."""

    def __init__(self, run_dir: str):
        self.run_dir, self.path = run_dir, storage.join(run_dir, METRICS_FILE)
        try:
            self.rows = {float(r["epoch"]): r for r in csv.DictReader(io.StringIO(storage.read_text(self.path)))}
        except (OSError, ValueError, KeyError):  # none yet (FileNotFoundError), or unreadable: start afresh
            self.rows = {}

    def record(self, metrics: dict[str, float]) -> None:
        """Add (or replace) the row of ``metrics["epoch"]`` and write the file.

        Raises:
            OSError: the write failed; the row is kept for the next one.
        """
        self.rows[float(metrics["epoch"])] = {k: repr(float(v)) for k, v in metrics.items()}
        rows = [self.rows[e] for e in sorted(self.rows)]
        columns = ["epoch", *sorted({k for r in rows for k in r} - {"epoch"})]
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
        storage.write_text(self.path, out.getvalue())

