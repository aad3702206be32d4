"""A results table: one row per measured point (its parameters, what the meter saw: kvlab.schema's fields), as a
sweep's store writes it (`kvlab.lab.store`, which keeps each point's record and remakes the table from them). Read
here, checked whole: the lessons read the committed tables with `load_results`.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

STATUSES = ("ok", "oom", "too-big", "failed")


def load_results(path: str | os.PathLike):
    """A results CSV (or the folder that holds results.csv) as a pandas DataFrame, one row per point; a damaged
    file is refused, with the command that rebuilds it."""
    import pandas as pd

    path = Path(path)
    if path.is_dir():
        path = path / "results.csv"
    if damage := table_rows(path)[1]:
        raise ValueError(
            f"{path} is damaged ({damage}); rebuild it from its records: "
            f"python -m kvlab sweep --out {path.parent} --rebuild"
        )
    table = pd.read_csv(path, dtype={"error": "string", "overrides": "string", "notebook": "string"})
    return table.assign(overrides=table["overrides"].fillna(""))  # no overrides is "", as in a record


def table_rows(path: Path) -> tuple[list[dict], str | None]:
    """A results table's rows, or why it is damaged: each line whole, with the header's number of fields,
    a point id seen once and a known status."""
    data = path.read_bytes() if path.exists() else b""
    if not data:
        return [], None
    if not data.endswith(b"\n"):
        return [], "its last line is cut off"
    try:
        reader = csv.reader(io.StringIO(data.decode(), newline=""))
        header = next(reader)
        if header[:2] != ["point_id", "status"]:
            return [], "its first line is not a results header (point_id,status,...)"
        rows = []
        for fields in reader:
            row = dict(zip(header, fields))
            if len(fields) != len(header):
                return [], f"line {reader.line_num} has {len(fields)} fields, the header {len(header)}"
            if not row["point_id"] or row["status"] not in STATUSES:
                return [], f"line {reader.line_num} has no point id or an unknown status {row['status']!r}"
            rows.append(row)
    except (UnicodeDecodeError, csv.Error) as error:
        return [], f"it is not CSV text: {error}"
    if len({row["point_id"] for row in rows}) < len(rows):
        return [], "a point id appears twice"
    return rows, None
