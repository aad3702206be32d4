"""The results folder: one CSV row per point, resume from it, and a provenance log of every run.

OUT/results.csv gets one row per point as soon as the point ends; OUT/provenance.json logs each run
(command, machine, versions, commit, timing). Several writers may share a folder (two sweeps, the
Ray driver and a local sweep): every read-modify-write holds a file lock (filelock), so none loses or
duplicates another's row.
"""

from __future__ import annotations

import csv
import datetime
import hashlib
import io
import json
import os
import tempfile
from pathlib import Path

from filelock import FileLock

from .point import DEFAULTS

# Fixed column order, so rows appended by different runs (and failure rows) stay aligned.
SWEEP_COLUMNS = ["point_id", "status", "error", "started_at", "elapsed_s", "notebook"]
PARAMETER_COLUMNS = list(DEFAULTS)
RECORD_COLUMNS = [
    "meter", "baseline_bytes", "peak_bytes", "overhead_bytes", "reserved_peak_bytes", "storages_peak_bytes",
    "kv_final_bytes", "overhead_over_kv", "predicted_overhead_bytes", "prediction_error", "kv_at_peak_bytes",
    "logits_at_peak_bytes", "other_at_peak_bytes", "seconds", "tokens_per_s", "graph_build_seconds", "device_name",
    "torch_version",
    "transformers_version", "kvlab_version", "python_version", "git_commit", "measured_at",
]
COLUMNS = SWEEP_COLUMNS + PARAMETER_COLUMNS + RECORD_COLUMNS
STATUSES = ("ok", "oom", "too-big", "failed")


def locked(path: str | os.PathLike) -> FileLock:
    """The lock that every writer (and reader) of `path` holds.

    It lives in this machine's temporary folder, named after the file's absolute path, not next to the file:
    results folders are archived and committed as they are. It orders the writers of one machine, which is
    where a sweep's driver writes for all its points (Ray's too).
    """
    folder = Path(tempfile.gettempdir()) / f"kvlab-locks-{os.getuid()}"
    folder.mkdir(exist_ok=True)
    return FileLock(folder / (hashlib.sha1(str(Path(path).resolve()).encode()).hexdigest()[:16] + ".lock"))


def _csv_line(row: dict, columns: list[str]) -> str:
    buffer = io.StringIO()
    csv.DictWriter(buffer, columns, extrasaction="ignore", lineterminator="\n").writerow(
        {key: "" if row.get(key) is None else row[key] for key in columns})
    return buffer.getvalue()


def _read_rows(path: Path) -> tuple[list[str], list[dict]]:
    if not path.exists() or path.stat().st_size == 0:
        return [], []
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        return list(reader.fieldnames or []), list(reader)


def replace_text(path: str | os.PathLike, text: str) -> None:
    """Replace the whole file at once (write a temporary file, then rename): a kill leaves old or new.
    Callers hold `locked(path)` when they read the file first, so no other writer slips in between."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("w", newline="") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _rewrite(path: Path, columns: list[str], kept: list[dict], added: list[dict]) -> None:
    replace_text(path, "".join(_csv_line(r, columns) for r in [dict(zip(columns, columns)), *kept, *added]))


def replace_rows(path: str | os.PathLike, rows: list[dict], replaced, columns: list[str]) -> None:
    """Write `rows` in place of the stored rows for which `replaced(row)` is true and keep the others, under
    the file's lock, the file replaced at once (the request stream, kvlab.encdec.stream, stores its rows so)."""
    path = Path(path)
    with locked(path):
        _rewrite(path, columns, [row for row in _read_rows(path)[1] if not replaced(row)], rows)


def append_row(path: str | os.PathLike, row: dict) -> None:
    """Add one point's row; a rerun point replaces its earlier failure rows instead of duplicating them."""
    path = Path(path)
    with locked(path):  # another writer's row lands before our read or after our write, never in between
        columns, rows = _read_rows(path)
        if not columns:
            columns = list(COLUMNS)
        extra = [key for key in row if key not in columns]
        previous = [r for r in rows if r.get("point_id") == row["point_id"]]
        if extra or previous or not path.exists():
            _rewrite(path, columns + extra, [r for r in rows if r.get("point_id") != row["point_id"]], [row])
            return
        # One write() of the whole line on an O_APPEND file: a kill cannot leave half a row.
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(descriptor, _csv_line(row, columns).encode())
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def done_point_ids(path: str | os.PathLike) -> set[str]:
    """The points measured already (status "ok"): a rerun skips them, and retries every failure."""
    with locked(path):
        return {row["point_id"] for row in _read_rows(Path(path))[1] if row.get("status") == "ok"}


def load_results(path: str | os.PathLike):
    """A results CSV (or the folder that holds results.csv) as a pandas DataFrame, one row per point."""
    import pandas as pd
    path = Path(path)
    if path.is_dir():
        path = path / "results.csv"
    table = pd.read_csv(path, dtype={"error": "string", "overrides": "string", "notebook": "string"})
    return table.assign(overrides=table["overrides"].fillna(""))  # no overrides is "", as in a record


def record_run(out: Path, command: str, points: int, counts: dict, started: datetime.datetime, device: str,
               **details) -> dict:
    """Append this run (command, machine, versions, commit, timing, engine details) to OUT/provenance.json."""
    return append_run(out, command, started, device, points_in_sweep=points, ran=counts, **details)


def append_run(out: str | os.PathLike, command: str, started: datetime.datetime, device: str, **details) -> dict:
    """Append one run of any kvlab command (command, machine, versions, commit, timing, `details`) to
    OUT/provenance.json, under the file's lock and replaced at once, so concurrent runs all stay logged."""
    from .point import provenance
    finished = datetime.datetime.now(datetime.timezone.utc)
    run = dict(command=command, **details,
               started_at=started.isoformat(timespec="seconds"), finished_at=finished.isoformat(timespec="seconds"),
               seconds=round((finished - started).total_seconds(), 1), device=device, **provenance(device),
               cpu_count=os.cpu_count(), load_average=[round(x, 2) for x in os.getloadavg()])
    run.pop("measured_at")
    path = Path(out) / "provenance.json"
    with locked(path):
        runs = json.loads(path.read_text())["runs"] if path.exists() else []
        replace_text(path, json.dumps({"results": "results.csv", "runs": runs + [run]}, indent=1) + "\n")
    return run
