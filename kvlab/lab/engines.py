"""Running a sweep: the driver (resume, progress bar, one row per point as it ends, provenance) and
the engines that run the points: `local` (one after the other, here) and `ray` (a Ray task per point).

An engine is a generator: given the points still to run, it yields each point's row as the point ends,
having put the executed notebook into OUT/notebooks/. Everything else (which points are done, the rows
in OUT/records/ and the results table, the provenance log) is the driver's, the same for every engine.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from pathlib import Path

from ..results import STATUSES, load_results
from .grid import point_id, point_label, validate
from .runner import POINT_NOTEBOOK, kernel_environment, run_one
from .store import append_row, append_run, done_point_ids, point_done, prepare_folder
from .summary import write_summary

ENGINES = ("local", "ray")


def local_engine(
    todo: list[dict], out: Path, notebook: Path, kernel_name: str | None = None, point_timeout: int | None = None
):
    """Each point in turn, in a fresh kernel on this machine; a point another sweep into the same folder has
    completed since this one started is not run again (None in its place)."""
    with kernel_environment(todo):
        for params in todo:
            if point_done(out / "results.csv", point_id(params)):
                yield None
            else:
                yield run_one(params, out, notebook, kernel_name, point_timeout)


def check_kernel(kernel_name: str | None) -> None:
    """A kernel asked for by name is one Jupyter knows, or the sweep is refused before any point runs."""
    from jupyter_client.kernelspec import KernelSpecManager

    if kernel_name is None:
        return
    known = sorted(KernelSpecManager().find_kernel_specs())
    if kernel_name not in known:
        raise ValueError(f"unknown Jupyter kernel {kernel_name!r}; choose one of: {', '.join(known)}")


def _start(engine: str, todo: list[dict], out: Path, notebook: Path, kernel_name, point_timeout, options: dict):
    """The engine's generator of rows, for the points still to run."""
    if engine == "ray":
        from .ray_engine import run_on_ray  # Ray is an optional extra: imported only when asked for

        return run_on_ray(todo, out, notebook, kernel_name, point_timeout, **options)
    if options:
        raise ValueError(f"the local engine takes no {', '.join(sorted(options))}; those are for --engine ray")
    return local_engine(todo, out, notebook, kernel_name, point_timeout)


def run_sweep(
    points: list[dict],
    out,
    *,
    notebook: str | os.PathLike | None = None,
    kernel_name: str | None = None,
    progress: bool = True,
    command: str | None = None,
    engine: str = "local",
    point_timeout: int | None = None,
    **engine_options,
):
    """Run every point not yet done (all validated first) on `engine` (ray: address, num_cpus, num_gpus); return the
    folder's results table. `point_timeout`: seconds a cell of a point's notebook may run; past it the point is a
    "failed" row. The run is logged in OUT/provenance.json; OUT/summary.md gets `make compare`'s table."""
    from tqdm.auto import tqdm

    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    command = command or f"kvlab.lab.engines.run_sweep({points!r}, {str(Path(out))!r})"
    points = validate(points, devices_here=engine == "local")
    notebook = Path(notebook or POINT_NOTEBOOK).absolute()
    if not notebook.is_file():
        raise ValueError(f"point notebook {notebook} not found; pass notebook= (or --notebook)")
    if engine == "local":
        check_kernel(kernel_name)

    out = Path(out).absolute()  # each point's kernel runs in the project folder, not the caller's
    prepare_folder(out)  # a folder that cannot be written is refused before any point runs
    results = out / "results.csv"
    done = done_point_ids(results)  # the table checked against the records, rebuilt if damaged
    todo = [p for p in points if point_id(p) not in done]
    if progress and len(todo) < len(points):
        print(
            f"{len(points) - len(todo)} of {len(points)} points already in {results}; "
            + (f"running the other {len(todo)}" if todo else "nothing to run"),
            file=sys.stderr,
        )
    if not todo:  # a finished sweep: no engine is started (a local Ray instance takes seconds)
        return load_results(results)
    counts = dict.fromkeys([*STATUSES, "done elsewhere"], 0)
    started = datetime.datetime.now(datetime.timezone.utc)
    options = {key: value for key, value in engine_options.items() if value is not None}
    rows = _start(engine, todo, out, notebook, kernel_name, point_timeout, options)
    try:
        # closing(): an interrupt anywhere in this loop reaches the engine, which stops its running points.
        with (
            tqdm(total=len(todo), desc=f"sweep {out.name}", unit="point", disable=not progress) as bar,
            contextlib.closing(rows),
        ):
            for row in rows:  # in the order the points end
                bar.update()
                if row is None:  # completed by another sweep into this folder meanwhile
                    counts["done elsewhere"] += 1
                    continue
                append_row(results, row)
                counts[row["status"]] += 1
                bar.set_postfix_str(f"{row['cache']}/{row['loop']} b{row['batch']} p{row['prompt']} n{row['new']}")
                if row["status"] != "ok":
                    bar.write(f"{row['status']}: {point_label(row)}: {row['error']}")
    finally:  # an interrupted run is logged too, with what it managed
        counts = {status: n for status, n in counts.items() if n or status in STATUSES}
        if any(counts.values()):
            append_run(
                out,
                command,
                started,
                points[0]["device"],
                points_in_sweep=len(points),
                ran=counts,
                engine=engine,
                point_timeout_s=point_timeout,
                **options,
            )
    if progress:
        print(
            f"{results}: " + ", ".join(f"{n} {status}" for status, n in counts.items()) + " this run",
            file=sys.stderr,
        )
    table = load_results(results)
    write_summary(table, out / "summary.md", f"Sweep {out.name}")
    return table
