"""The results folder: OUT/records/<point_id>.json, each point's row, saved whole as the point ends (a kill or a full
disk loses at most that point): the one truth; OUT/results.csv, the table remade from them after every row (a
damaged one set aside); OUT/provenance.json, a log of every run. Every write holds a file lock, so writers sharing
a folder (two sweeps, the Ray driver and a local sweep) never lose or duplicate each other's rows.
"""

from __future__ import annotations

import csv
import datetime
import hashlib
import io
import json
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

from filelock import FileLock

from ..results import STATUSES, table_rows
from ..schema import DEFAULTS

# A point's record (kvlab.lab.point.measure): its parameters (those below), then these fields, in results.csv's
# column order.
RECORD_PARAMETERS = (
    "preset",
    "overrides",
    "cache",
    "loop",
    "kind",
    "runtime",
    "strategy",
    "batch",
    "prompt",
    "new",
    "restart_new",
    "restart_from",
    "num_beams",
    "device",
    "dtype",
)
RECORD_FIELDS = (
    "meter",
    "baseline_bytes",
    "peak_bytes",
    "overhead_bytes",
    "reserved_peak_bytes",
    "storages_peak_bytes",
    "kv_final_bytes",
    "overhead_over_kv",
    "predicted_overhead_bytes",
    "prediction_error",
    "kv_at_peak_bytes",
    "logits_at_peak_bytes",
    "other_at_peak_bytes",
    "kernels_at_peak_bytes",
    "seconds",
    "tokens_per_s",
    "graph_build_seconds",
    "device_name",
    "torch_version",
    "transformers_version",
    "kvlab_version",
    "python_version",
    "git_commit",
    "measured_at",
)


# Fixed column order, so rows appended by different runs (and failure rows) stay aligned.
COLUMNS = ["point_id", "status", "error", "started_at", "elapsed_s", "notebook", *DEFAULTS, *RECORD_FIELDS]
# A point writes its executed notebook (tens of kB) and its row: a sweep refuses to start with less free.
MIN_FREE_BYTES = 2**20


def locked(path: str | os.PathLike) -> FileLock:
    """The lock every writer (and reader) of `path` holds. It lives in this machine's temporary folder, not next
    to the file (results folders are archived and committed as they are), and orders the writers of one machine,
    which is where a sweep's driver writes for all its points (Ray's too)."""
    folder = Path(tempfile.gettempdir()) / f"kvlab-locks-{os.getuid()}"
    folder.mkdir(exist_ok=True)
    return FileLock(folder / (hashlib.sha1(str(Path(path).resolve()).encode()).hexdigest()[:16] + ".lock"))


def refuse_link(path: str | os.PathLike) -> None:
    """A symbolic link where kvlab writes is refused: a write through it would change a file outside the folder
    (anyone who can write the folder can plant one)."""
    if Path(path).is_symlink():
        raise ValueError(
            f"{path} is a symbolic link (to {os.readlink(path)}); kvlab writes only inside its folder and never "
            f"through a link: remove the link"
        )


def create_exclusive(folder: Path, prefix: str, suffix: str = ".tmp") -> tuple[int, Path]:
    """A new file in `folder` that no other writer has (a unique name, O_EXCL: never an existing file or a link
    planted at that name), open for writing: (descriptor, path). Permissions as the umask says, like any file."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    while True:
        path = folder / f".{prefix}.{os.getpid()}.{secrets.token_hex(4)}{suffix}"
        try:
            return os.open(path, flags, 0o666), path
        except FileExistsError:  # another writer drew the same name: draw again
            continue


def replace_text(path: str | os.PathLike, text: str) -> None:
    """Replace the whole file at once and durably (a temporary file of this writer's own, synced, renamed over
    the old one, the folder synced): a kill or a full disk leaves the old file or the new one, and a rename
    replaces a link planted at `path` instead of writing through it. Callers hold `locked(path)`, so no other
    writer slips in between their read and this write."""
    path = Path(path)
    refuse_link(path)
    descriptor, temporary = create_exclusive(path.parent, path.name)
    try:
        with open(descriptor, "w", newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        if isinstance(error, OSError):
            error.filename = str(path)  # a failed write() names no file: name the one it was replacing
        raise
    sync_folder(path.parent)


def sync_folder(folder: Path) -> None:
    """The renames in `folder` reach the disk."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def refuse_links(out: Path, folders=("notebooks", "records")) -> None:
    """Refuse a results folder holding a symbolic link where kvlab reads or writes (a subfolder, a file in the
    folder or in a subfolder), before anything runs: one line naming the first."""
    subfolders = [out / name for name in folders]
    for link in subfolders:
        refuse_link(link)
    for folder in [out, *subfolders]:
        for entry in os.scandir(folder) if folder.is_dir() else ():
            refuse_link(entry.path)


def prepare_folder(out: str | os.PathLike, folders=("notebooks", "records")) -> None:
    """Make OUT and its `folders` and check, before anything runs, that rows can be written there."""
    out = Path(out)
    if out.is_file():
        raise ValueError(f"{out} is a file; give a folder for the results")
    if folders:  # a sweep's folder: checked whole, as it may be shared
        refuse_links(out, folders)
    try:
        for folder in [out / name for name in folders] or [out]:
            folder.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=folder).close()
        free = shutil.disk_usage(out).free
    except OSError as error:
        where = f" ({error.filename})" if error.filename else ""
        raise ValueError(f"cannot write results to {out}: {error.strerror or error}{where}") from None
    if free < MIN_FREE_BYTES:
        raise ValueError(
            f"cannot write results to {out}: {free // 1024} KiB free on its file system, "
            f"a point needs about {MIN_FREE_BYTES // 1024} KiB"
        )


def _set_aside(path: Path, why: str, then: str) -> None:
    """Rename a damaged file out of the way (kept, never adopted) and say so in one line."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    aside, n = path.with_name(f"{path.name}.damaged-{stamp}"), 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}.damaged-{stamp}-{n}"), n + 1
    os.replace(path, aside)
    print(f"kvlab: {path} is damaged ({why}); kept as {aside.name}; {then}", file=sys.stderr)


def _save_row(records: Path, row: dict) -> None:
    records.mkdir(exist_ok=True)
    replace_text(records / f"{row['point_id']}.json", json.dumps(row, indent=1, default=str) + "\n")


def _rows(path: Path) -> list[dict]:
    """The folder's rows, from its records (the one truth), in the order they were saved; the table beside them
    checked, and set aside if damaged, since it is remade from them (hold the lock)."""
    records, saved, lost = path.parent / "records", {}, set()
    for record in sorted(records.glob("*.json"), key=lambda p: (p.stat().st_mtime_ns, p.name)):  # oldest first
        try:
            row = json.loads(record.read_text())
        except ValueError as error:  # not JSON, not text: a torn copy or a hand edit
            _set_aside(record, f"not JSON: {error}", "its point runs again")
            lost.add(record.stem)
            continue
        if isinstance(row, dict) and row.get("point_id") and row.get("status") in STATUSES:
            saved[row["point_id"]] = row
        else:  # JSON, but not a point's row: kept aside like a torn one
            _set_aside(record, "not a point's row (no point_id or an unknown status)", "its point runs again")
            lost.add(record.stem)
    table, damage = table_rows(path)
    if damage and not saved:  # nothing to remake it from: leave it as it is for a person to look at
        raise ValueError(
            f"{path} is damaged ({damage}) and {records} holds no rows to rebuild it from: "
            f"repair the file or move it away"
        )
    if damage:
        _set_aside(path, damage, f"the table is rebuilt from {records}")
    if orphans := [row["point_id"] for row in table if row["point_id"] not in saved.keys() | lost]:
        raise ValueError(
            f"{path} has rows with no record in {records} ({', '.join(orphans[:3])}"
            f"{', ...' if len(orphans) > 3 else ''}): the table is remade from the records, so those rows "
            f"would be lost; move the table away, or put their records back"
        )
    return list(saved.values())


def _write_table(path: Path, rows: list[dict], columns: list[str] = COLUMNS) -> None:
    columns = list(dict.fromkeys([*columns, *(key for row in rows for key in row)]))
    text = io.StringIO()
    writer = csv.DictWriter(text, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows({key: "" if row.get(key) is None else row[key] for key in columns} for row in rows)
    replace_text(path, text.getvalue())


def append_row(path: str | os.PathLike, row: dict) -> dict:
    """Save one point's row in the records beside `path` (a rerun point's row replaces its earlier one, except
    that a failed attempt never replaces a completed one: another writer's ok row stays), then rewrite the table
    `path` from the records. Returns the row the folder now holds for the point."""
    path = Path(path)
    with locked(path):  # another writer's row lands before our read or after our write, never in between
        saved = {row["point_id"]: row for row in _rows(path)}
        kept = saved.get(row["point_id"])
        if kept is not None and kept["status"] == "ok" and row["status"] != "ok":
            return kept
        saved.pop(row["point_id"], None)
        _save_row(path.parent / "records", row)
        _write_table(path, [*saved.values(), row])  # the newest record last, as _rows reads them
        return row


def point_done(path: str | os.PathLike, point: str) -> bool:
    """Whether the folder of the table `path` holds an ok row for `point` (a record another writer may have saved
    since this sweep started): read without the lock, as a record is replaced whole."""
    try:
        return json.loads((Path(path).parent / "records" / f"{point}.json").read_text()).get("status") == "ok"
    except (OSError, ValueError, AttributeError):  # absent, torn or not a row: not done
        return False


def rebuild(path: str | os.PathLike) -> list[dict]:
    """Bring the table `path` in line with the records beside it (a damaged table set aside) and return
    its rows. Every sweep does this at its start; `python -m kvlab sweep --out OUT --rebuild` does only this."""
    path = Path(path)
    with locked(path):
        rows = _rows(path)
        if rows:
            _write_table(path, rows)
        return rows


def done_point_ids(path: str | os.PathLike) -> set[str]:
    """The points measured already (status "ok"): a rerun skips them, and retries every failure."""
    return {row["point_id"] for row in rebuild(path) if row["status"] == "ok"}


def append_run(out: str | os.PathLike, command: str, started: datetime.datetime, device: str, **details) -> dict:
    """Append one run of any kvlab command (command, machine, versions, commit, timing, `details`) to
    OUT/provenance.json, under the file's lock and replaced at once, so concurrent runs all stay logged."""
    from .provenance import provenance

    finished = datetime.datetime.now(datetime.timezone.utc)
    run = dict(
        command=command,
        **details,
        started_at=started.isoformat(timespec="seconds"),
        finished_at=finished.isoformat(timespec="seconds"),
        seconds=round((finished - started).total_seconds(), 1),
        device=device,
        **provenance(device),
        cpu_count=os.cpu_count(),
        load_average=[round(x, 2) for x in os.getloadavg()],
    )
    run.pop("measured_at")
    path = Path(out) / "provenance.json"
    with locked(path):
        runs = json.loads(path.read_text())["runs"] if path.exists() else []
        replace_text(path, json.dumps({"results": "results.csv", "runs": runs + [run]}, indent=1) + "\n")
    return run
