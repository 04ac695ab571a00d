"""The one table renderer: rows -> a Markdown pipe table or CSV.

Every table raymcn prints (results, and the benchmarks' tables as they move over) goes through
:func:`render_table`, so alignment, missing values and escaping are decided once. Knows nothing
about raymcn's columns: callers pass a format spec per column.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

MISSING = "-"
Spec = Callable[[str], str] | Mapping[str, str] | None


def _spec_for(spec: Spec, col: str) -> str:
    if spec is None:
        return ".4g"
    if callable(spec):
        return spec(col)
    return spec.get(col, ".4g")


def format_cell(value: Any, spec: str = ".4g") -> str:
    """One Markdown cell: None/NaN -> ``-``; bool -> ``True``/``False``; int -> its digits; float ->
    ``format(value, spec)`` (inf as ``inf``); anything else -> ``str`` with ``|`` escaped (a bare
    pipe would split the cell)."""
    if value is None or (isinstance(value, (float, np.floating)) and math.isnan(value)):
        return MISSING
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return format(float(value), spec)
    if value is pd.NA or value is pd.NaT:
        return MISSING
    return str(value).replace("|", "\\|")


def render_table(rows: pd.DataFrame | Sequence[Mapping[str, Any]], fmt: str = "md", spec: Spec = None,
                 right: Iterable[str] = ()) -> str:
    """Render ``rows`` (a DataFrame, or a list of dicts with the same keys) as a table string.

    ``md``: a Markdown pipe table, one header line, one alignment line, one line per row, ending
    in a newline. Cells go through :func:`format_cell` with ``spec`` (a function of the column
    name, a dict column -> spec, or None for ``.4g``). Numeric columns and the columns named in
    ``right`` (e.g. pre-formatted "12.3 ± 1.2" cells) are right-aligned (``---:``).
    ``csv``: ``DataFrame.to_csv(index=False)``, every value at full precision; ``spec`` ignored.

    Raises:
        ValueError: ``fmt`` is neither ``md`` nor ``csv``.
    """
    df = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    if fmt == "csv":
        return df.to_csv(index=False)
    if fmt != "md":
        raise ValueError(f"unknown table format {fmt!r}: allowed md, csv")
    right = set(right)
    header, align, columns = [], [], []
    for col in df.columns:
        numeric = pd.api.types.is_numeric_dtype(df[col]) and not pd.api.types.is_bool_dtype(df[col])
        header.append(str(col).replace("|", "\\|"))
        align.append("---:" if numeric or col in right else "---")
        s = _spec_for(spec, str(col))
        columns.append([format_cell(v, s) for v in df[col].tolist()])
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(cells[i] for cells in columns) + " |" for i in range(len(df))]
    return "\n".join(lines) + "\n"
