"""`python -m kvlab sweep`: a sweep file and/or --grid items → points → an engine; bad input is one line."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from .cli import Parser
from .point import DEFAULTS
from .engines import ENGINES, run_sweep
from .grid import SWEEPS_DIR, expand, load_sweep, merge_grid_items, point_id, point_label, read_sweep, validate
from .runner import POINT_NOTEBOOK
from .store import rebuild


def build_parser() -> argparse.ArgumentParser:
    shipped = ", ".join(sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml")))
    parser = Parser(prog="python -m kvlab sweep", description="Run a grid of experiment points with papermill: one "
                    "fresh kernel per point, resumable, failures are rows.")  # one-line errors, as every verb
    parser.add_argument("sweep", nargs="?", help=f"sweep YAML (fixed: + grid:), a path or one of: {shipped}")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                        help=f"grid values, repeatable; a single value fixes the key. Keys: {', '.join(DEFAULTS)}")
    parser.add_argument("--out", help="results folder (default: results/<sweep name>)")
    parser.add_argument("--notebook", default=None, help=f"point notebook (default: {POINT_NOTEBOOK.name})")
    parser.add_argument("--kernel", default=None, help="Jupyter kernel name (default: the notebook's)")
    parser.add_argument("--dry-run", action="store_true", help="validate and list the points, run nothing")
    parser.add_argument("--force", action="store_true", help="run points predicted not to fit in free memory too")
    parser.add_argument("--point-timeout", type=int, default=None, metavar="SECONDS",
                        help="seconds a cell of a point's notebook may run; past it the point is a failed row "
                        "(default: the sweep file's point_timeout_s, else no limit)")
    parser.add_argument("--rebuild", action="store_true",
                        help="remake OUT/results.csv from the rows in OUT/records/ and stop (every sweep does this first)")
    ray = parser.add_argument_group("engine", "where the points run (the results folder is the same for both)")
    ray.add_argument("--engine", default="local", metavar="{" + ",".join(ENGINES) + "}",
                     help="local: one point after the other here (default); ray: a Ray task per point")
    ray.add_argument("--address", default=None,
                     help="Ray cluster: auto (the one this node belongs to) or ray://HOST:PORT; default: start one here")
    ray.add_argument("--num-cpus", type=float, default=None, help="CPUs per point's Ray task (default 1)")
    ray.add_argument("--num-gpus", type=float, default=None, help="GPUs per point's Ray task (default: 1 for CUDA points, else 0)")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    args.file = args.sweep
    # A batch scheduler stops a job with SIGTERM (Slurm's scancel, its time limit): treat it as Ctrl-C.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if args.engine not in ENGINES:
            raise ValueError(f"unknown engine {args.engine!r}; choose one of {', '.join(ENGINES)}")
        if args.engine == "local" and (args.address or args.num_cpus is not None or args.num_gpus is not None):
            raise ValueError("--address, --num-cpus and --num-gpus are for --engine ray")
        fixed, grid = load_sweep(args.file) if args.file else ({}, {})
        fixed, grid = merge_grid_items(fixed, grid, args.grid)
        timeout = args.point_timeout
        if timeout is None and args.file:
            timeout = read_sweep(args.file).get("point_timeout_s")
        if timeout is not None and timeout < 1:
            raise ValueError(f"--point-timeout must be a positive number of seconds, got {timeout}")
        out = Path(args.out or Path("results") / (Path(args.file).stem if args.file else "sweep"))
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} is a file; give a folder for the results")
        if args.rebuild:
            if not out.is_dir():
                raise ValueError(f"no results folder {out} to rebuild; give it with --out")
            rows = rebuild(out / "results.csv")
            print(f"{out / 'results.csv'}: {len(rows)} rows, from {out / 'records'}", file=sys.stderr)
            return
        if not args.file and not args.grid:
            raise ValueError("give --file and/or --grid key=v1,v2,...")
        if args.force:
            grid.pop("force", None)
            fixed["force"] = True
        points = validate(expand(fixed, grid), devices_here=args.engine == "local")
        if args.dry_run:
            for params in points:
                print(point_id(params), point_label(params))
            print(f"{len(points)} point{'s' * (len(points) != 1)}; results would go to {out / 'results.csv'}"
                  + (f"; each cell of a point may run {timeout} s" if timeout else ""))
            return
        command = " ".join(["python -m kvlab sweep", *(argv if argv is not None else sys.argv[1:])])
        engine_options = dict(address=args.address, num_cpus=args.num_cpus, num_gpus=args.num_gpus)
        run_sweep(points, out, notebook=args.notebook, kernel_name=args.kernel, command=command,
                  engine=args.engine, point_timeout=timeout, **(engine_options if args.engine == "ray" else {}))
    except ValueError as error:
        print(f"kvlab sweep: error: {error}", file=sys.stderr)
        sys.exit(2)
    except OSError as error:  # the file system: full, read-only, a file where a folder is wanted
        where = f" ({error.filename})" if error.filename else ""
        print(f"kvlab sweep: error: {error.strerror or error}{where}; the rows saved so far are kept: "
              f"fix that and rerun the same command to resume", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # the rows written so far stay valid: a rerun resumes
        print("kvlab sweep: interrupted; rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
    finally:
        signal.signal(signal.SIGTERM, previous)
