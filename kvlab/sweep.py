"""Run a grid of experiment points with papermill: one fresh kernel per point, resumable, failures are rows.

    python -m kvlab sweep cpu-default --out results/cpu-default
    python -m kvlab sweep cpu-new-tokens --grid batch=2 --dry-run
    python -m kvlab.sweep --grid cache=tuple,dynamic --grid new=64,128 --out results/mine

Each point executes `notebooks/03_experiment_point.ipynb` in a new kernel, so one point's memory (or
crash) never leaks into the next. The executed notebook is kept under OUT/notebooks/, and one row per
point is appended to OUT/results.csv as soon as the point ends. Rerunning the same command skips the
points already measured (status "ok"), so a killed sweep resumes where it stopped; a point that ran
out of memory or failed becomes a row with its status and error, and the sweep goes on. A point whose
predicted peak exceeds the free memory of its device is not run at all: its row has status "too-big"
(retried on a rerun, like every failure); `force=true` (or --force) runs it anyway.

A sweep file (YAML) has `fixed:` parameters shared by every point and `grid:` lists whose product
gives the points. A grid entry whose values are mappings sets several parameters together, e.g.
`design: [{cache: tuple, loop: v4.40}, {cache: dynamic, loop: v5}]`.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import hashlib
import io
import itertools
import json
import os
import sys
import time
from pathlib import Path

import yaml

from .experiment import DEFAULTS, normalize
from .models import parse_value
from .predict import TooBig, check_fits

PACKAGE_DIR = Path(__file__).resolve().parent
SWEEPS_DIR = PACKAGE_DIR / "sweeps"
POINT_NOTEBOOK = PACKAGE_DIR.parent / "notebooks" / "03_experiment_point.ipynb"

# Fixed column order, so rows appended by different runs (and failure rows) stay aligned.
SWEEP_COLUMNS = ["point_id", "status", "error", "started_at", "elapsed_s", "notebook"]
PARAMETER_COLUMNS = list(DEFAULTS)
RECORD_COLUMNS = [
    "meter", "baseline_bytes", "peak_bytes", "overhead_bytes", "reserved_peak_bytes", "storages_peak_bytes",
    "kv_final_bytes", "overhead_over_kv", "predicted_overhead_bytes", "prediction_error", "kv_at_peak_bytes",
    "logits_at_peak_bytes", "other_at_peak_bytes", "seconds", "tokens_per_s", "device_name", "torch_version",
    "transformers_version", "kvlab_version", "python_version", "git_commit", "measured_at",
]
COLUMNS = SWEEP_COLUMNS + PARAMETER_COLUMNS + RECORD_COLUMNS
STATUSES = ("ok", "oom", "too-big", "failed")
# The kernel's own log lines (unencrypted TCP, shutdown) would break the progress bar; errors reach the row.
QUIET_KERNEL = ["--IPKernelApp.log_level=CRITICAL"]
OOM_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory")


# -- what to run -------------------------------------------------------------------------------
def parse_grid_item(item: str) -> tuple[str, list]:
    """`"new=64,128"` → ("new", [64, 128]); `"overrides=num_hidden_layers=1"` keeps the text after the first `=`."""
    key, sep, values = item.partition("=")
    key = key.strip()
    parts = [part.strip() for part in values.split(",")] if key != "overrides" else [values.strip()]
    if not sep or not key or not all(parts):
        raise ValueError(f"grid item {item!r} is not of the form key=v1,v2,...; valid keys: {', '.join(DEFAULTS)}")
    return key, [parse_value(part) for part in parts]


def sweep_file(name: str | os.PathLike) -> Path:
    """A sweep file's path: an existing path, or the name of one shipped in kvlab/sweeps/."""
    path = Path(name)
    if path.exists():
        return path
    shipped = SWEEPS_DIR / f"{Path(name).stem}.yaml"
    if shipped.exists():
        return shipped
    choices = ", ".join(sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml")))
    raise ValueError(f"sweep file {str(name)!r} not found; give a path or one of: {choices}")


def load_sweep(path: str | os.PathLike) -> tuple[dict, dict]:
    """(fixed, grid) from a YAML sweep file."""
    text = sweep_file(path).read_text()
    spec = yaml.safe_load(text) or {}
    if not isinstance(spec, dict) or set(spec) - {"fixed", "grid", "description"}:
        raise ValueError(f"{path}: a sweep file has the sections fixed, grid (and description)")
    fixed, grid = spec.get("fixed") or {}, spec.get("grid") or {}
    if not isinstance(fixed, dict) or not isinstance(grid, dict):
        raise ValueError(f"{path}: `fixed` and `grid` must be mappings of parameter names")
    return fixed, {key: values if isinstance(values, list) else [values] for key, values in grid.items()}


def expand(fixed: dict | None = None, grid: dict | None = None) -> list[dict]:
    """The points of a grid: every combination of its values, on top of the fixed parameters."""
    fixed, grid = dict(fixed or {}), dict(grid or {})
    for key, values in grid.items():
        if not values:
            raise ValueError(f"grid key {key!r} has no values")
    points = []
    for combination in itertools.product(*grid.values()):
        point = dict(fixed)
        for key, value in zip(grid, combination):
            if isinstance(value, dict):  # a group of parameters set together, e.g. cache + loop
                point.update(value)
            else:
                point[key] = value
        points.append(point)
    return points


def validate(points: list[dict]) -> list[dict]:
    """Every point normalized (defaults filled, choices checked) before anything runs, each once."""
    if not points:
        raise ValueError("the sweep has no points")
    checked = []
    for point in points:
        try:
            checked.append(normalize(**point))
        except ValueError as error:
            raise ValueError(f"point {json.dumps(point)}: {error}") from None
    return list({point_id(params): params for params in checked}.values())  # a grid may name a point twice


def point_id(params: dict) -> str:
    """A stable id from the normalized parameters: the same point gets the same id in every rerun."""
    # `force` changes whether a point runs, not what it measures: a forced rerun replaces a "too-big" row.
    canonical = json.dumps({key: params[key] for key in DEFAULTS if key != "force"}, sort_keys=True, default=str)
    return hashlib.sha1(canonical.encode()).hexdigest()[:12]


def point_label(params: dict) -> str:
    """A readable file name for a point's notebook and record."""
    overrides = "".join(ch if ch.isalnum() else "-" for ch in params["overrides"])
    parts = [params["preset"].replace("/", "-"), overrides, params["cache"], params["loop"], params["strategy"],
             f"b{params['batch']}", f"p{params['prompt']}", f"n{params['new']}"]
    return "_".join(part for part in parts if part) + f"_{point_id(params)}"


# -- the results table -------------------------------------------------------------------------
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


def _rewrite(path: Path, columns: list[str], rows: list[dict]) -> None:
    """Replace the whole file at once (write a temporary file, then rename): a kill leaves old or new."""
    temporary = path.with_suffix(".csv.tmp")
    with temporary.open("w", newline="") as handle:
        handle.write(_csv_line(dict(zip(columns, columns)), columns))
        for row in rows:
            handle.write(_csv_line(row, columns))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def append_row(path: Path, row: dict) -> None:
    """Add one point's row; a rerun point replaces its earlier failure rows instead of duplicating them."""
    columns, rows = _read_rows(path)
    if not columns:
        columns = list(COLUMNS)
    extra = [key for key in row if key not in columns]
    previous = [r for r in rows if r.get("point_id") == row["point_id"]]
    if extra or previous or not path.exists():
        kept = [r for r in rows if r.get("point_id") != row["point_id"]]
        _rewrite(path, columns + extra, kept + [row])
        return
    # One write() of the whole line on an O_APPEND file: a kill cannot leave half a row.
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(descriptor, _csv_line(row, columns).encode())
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def done_point_ids(path: Path) -> set[str]:
    return {row["point_id"] for row in _read_rows(Path(path))[1] if row.get("status") == "ok"}


def load_results(path: str | os.PathLike):
    """A results CSV (or the folder that holds results.csv) as a pandas DataFrame, one row per point."""
    import pandas as pd
    path = Path(path)
    if path.is_dir():
        path = path / "results.csv"
    table = pd.read_csv(path, dtype={"error": "string", "overrides": "string", "notebook": "string"})
    return table.assign(overrides=table["overrides"].fillna(""))  # no overrides is "", as in a record


def record_run(out: Path, command: str, points: int, counts: dict, started: datetime.datetime, device: str) -> dict:
    """Append this run (command, machine, versions, commit, timing) to OUT/provenance.json."""
    from .experiment import provenance
    finished = datetime.datetime.now(datetime.timezone.utc)
    run = dict(command=command, points_in_sweep=points, ran=counts,
               started_at=started.isoformat(timespec="seconds"), finished_at=finished.isoformat(timespec="seconds"),
               seconds=round((finished - started).total_seconds(), 1), device=device, **provenance(device),
               cpu_count=os.cpu_count(), load_average=[round(x, 2) for x in os.getloadavg()])
    run.pop("measured_at")
    path = out / "provenance.json"
    runs = json.loads(path.read_text())["runs"] if path.exists() else []
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps({"results": "results.csv", "runs": runs + [run]}, indent=1) + "\n")
    os.replace(temporary, path)
    return run


# -- running -----------------------------------------------------------------------------------
def failure_status(name: str, message: str) -> str:
    """"oom" for torch.OutOfMemoryError (CUDA) or an allocation the CPU refused, else "failed"."""
    if name.endswith("OutOfMemoryError") or any(text in message.lower() for text in OOM_MESSAGES):
        return "oom"
    return "failed"


@contextlib.contextmanager
def _kernel_environment(points: list[dict]):
    """Kernels inherit our environment: put this kvlab first on their path even if it is not installed,
    and on CPU use one OpenMP thread unless told otherwise: the small CPU models gain nothing from threads,
    and threads spinning against other processes on a shared machine make each matmul many times slower."""
    root = str(PACKAGE_DIR.parent)
    changes = {"PYTHONPATH": root + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    if all(point["device"] == "cpu" for point in points) and "OMP_NUM_THREADS" not in os.environ:
        changes["OMP_NUM_THREADS"] = "1"
    before = {key: os.environ.get(key) for key in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_one(params: dict, out: Path, notebook: Path, kernel_name: str | None = None) -> dict:
    """Execute the point notebook for one point in a fresh kernel; return its results row."""
    import papermill

    label = point_label(params)
    executed = out / "notebooks" / f"{label}.ipynb"
    record_path = out / "records" / f"{label}.json"
    record_path.unlink(missing_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    row = dict(params, point_id=point_id(params), started_at=started.isoformat(timespec="seconds"),
               notebook=os.path.relpath(executed, out))
    clock = time.perf_counter()
    try:
        if not params["force"]:
            check_fits(params)  # refuse before a kernel starts and allocates
        parameters = dict(params, record_path=str(record_path))
        papermill.execute_notebook(str(notebook), str(executed), parameters=parameters,
                                   kernel_name=kernel_name, progress_bar=False, log_output=False,
                                   cwd=str(PACKAGE_DIR.parent), extra_arguments=QUIET_KERNEL)
        row.update(json.loads(record_path.read_text()), status="ok", error=None)
    except TooBig as error:  # refused: no notebook was run
        row.update(status="too-big", error=str(error), notebook=None)
    except Exception as error:  # a failed point is a row, not the end of the sweep
        name = getattr(error, "ename", type(error).__name__)
        message = str(getattr(error, "evalue", error)).strip().splitlines()
        row.update(status=failure_status(name, " ".join(message)), error=f"{name}: {' '.join(message)[:500]}")
    row["elapsed_s"] = round(time.perf_counter() - clock, 2)
    return row


def run_sweep(points_or_grid, out, *, fixed: dict | None = None, notebook: str | os.PathLike | None = None,
              kernel_name: str | None = None, progress: bool = True, command: str | None = None):
    """Run every point not yet done; return the results table (pandas DataFrame) of the whole folder.

    `points_or_grid`: a list of parameter dicts, a grid {key: [values]} (product, on top of `fixed`),
    or the path / shipped name of a sweep file. Every point is validated before the first one runs.
    Each run is logged in OUT/provenance.json with `command` (default: this call, spelled out).
    """
    from tqdm.auto import tqdm

    if isinstance(points_or_grid, (str, os.PathLike)):
        file_fixed, grid = load_sweep(points_or_grid)
        points = expand({**file_fixed, **(fixed or {})}, grid)
    elif isinstance(points_or_grid, dict):
        points = expand(fixed, points_or_grid)
    else:
        points = [{**(fixed or {}), **point} for point in points_or_grid]
    points = validate(points)
    notebook = Path(notebook or POINT_NOTEBOOK)
    if not notebook.exists():
        raise ValueError(f"point notebook {notebook} not found; pass notebook= (or --notebook)")

    out = Path(out)
    (out / "notebooks").mkdir(parents=True, exist_ok=True)
    (out / "records").mkdir(exist_ok=True)
    results = out / "results.csv"
    done = done_point_ids(results)
    todo = [p for p in points if point_id(p) not in done]
    if progress and len(todo) < len(points):
        print(f"{len(points) - len(todo)} of {len(points)} points already in {results}; running the other {len(todo)}",
              file=sys.stderr)
    counts = dict.fromkeys(STATUSES, 0)
    started = datetime.datetime.now(datetime.timezone.utc)
    try:
        with _kernel_environment(todo), tqdm(todo, desc=f"sweep {out.name}", unit="point", disable=not progress) as bar:
            for params in bar:
                bar.set_postfix_str(f"{params['cache']}/{params['loop']} b{params['batch']} p{params['prompt']} "
                                    f"n{params['new']}")
                row = run_one(params, out, notebook, kernel_name)
                append_row(results, row)
                counts[row["status"]] += 1
                if row["status"] != "ok":
                    bar.write(f"{row['status']}: {point_label(params)}: {row['error']}")
    finally:  # an interrupted run is logged too, with what it managed
        if any(counts.values()):
            record_run(out, command or f"kvlab.sweep.run_sweep({points_or_grid!r}, {str(out)!r})", len(points),
                       counts, started, points[0]["device"])
    if progress:
        print(f"{results}: " + ", ".join(f"{n} {status}" for status, n in counts.items()) + " this run", file=sys.stderr)
    return load_results(results)


# -- command line ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    shipped = ", ".join(sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml")))
    parser = argparse.ArgumentParser(prog="python -m kvlab sweep", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", nargs="?", help=f"sweep YAML (fixed: + grid:), a path or one of: {shipped}")
    parser.add_argument("--file", help="the same, as an option")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                        help=f"grid values, repeatable; a single value fixes the key. Keys: {', '.join(DEFAULTS)}")
    parser.add_argument("--out", help="results folder (default: results/<sweep name>)")
    parser.add_argument("--notebook", default=None, help=f"point notebook (default: {POINT_NOTEBOOK.name})")
    parser.add_argument("--kernel", default=None, help="Jupyter kernel name (default: the notebook's)")
    parser.add_argument("--dry-run", action="store_true", help="validate and list the points, run nothing")
    parser.add_argument("--force", action="store_true", help="run points predicted not to fit in free memory too")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    args.file = args.file or args.sweep
    try:
        fixed, grid = load_sweep(args.file) if args.file else ({}, {})
        for item in args.grid:  # the command line wins over the file, key by key
            key, values = parse_grid_item(item)
            fixed.pop(key, None)
            grid.pop(key, None)
            for group, values_of_group in grid.items():  # also out of groups like `design: [{cache: ...}]`
                grid[group] = [{k: v for k, v in value.items() if k != key} if isinstance(value, dict) else value
                               for value in values_of_group]
            if len(values) == 1:
                fixed[key] = values[0]
            else:
                grid[key] = values
        if not args.file and not args.grid:
            raise ValueError("give --file and/or --grid key=v1,v2,...")
        if args.force:
            grid.pop("force", None)
            fixed["force"] = True
        points = validate(expand(fixed, grid))
        name = Path(args.file).stem if args.file else "sweep"
        out = Path(args.out or Path("results") / name)
        if args.dry_run:
            for params in points:
                print(point_id(params), point_label(params))
            print(f"{len(points)} points; results would go to {out / 'results.csv'}")
            return
        command = " ".join(["python -m kvlab sweep", *(argv if argv is not None else sys.argv[1:])])
        run_sweep(points, out, notebook=args.notebook, kernel_name=args.kernel, command=command)
    except ValueError as error:
        print(f"kvlab sweep: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
