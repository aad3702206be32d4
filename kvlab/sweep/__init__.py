"""Run a grid of experiment points with papermill: one fresh kernel per point, resumable, failures are rows.

    python -m kvlab sweep cpu-default --out results/cpu-default
    python -m kvlab sweep cpu-new-tokens --grid batch=2 --dry-run
    python -m kvlab sweep --grid cache=tuple,dynamic --grid new=64,128 --out results/mine
    python -m kvlab sweep cpu-default --engine ray [--address auto|ray://HOST:PORT]

Each point executes the point notebook (`POINT_NOTEBOOK`) in a new kernel, so one point's memory (or
crash) never leaks into the next. The executed notebook is kept under OUT/notebooks/, and one row per
point is appended to OUT/results.csv as soon as the point ends. Rerunning the same command skips the
points already measured (status "ok"), so a killed sweep resumes where it stopped; a point that ran
out of memory or failed becomes a row with its status and error, and the sweep goes on. A point whose
predicted peak exceeds the free memory of its device is not run at all: its row has status "too-big"
(retried on a rerun, like every failure); `force=true` (or --force) runs it anyway.

One idea per module:
    grid        sweep files and --grid items → points, validated, with stable ids
    store       results.csv rows (file-locked), resume, provenance.json
    point       one point: the notebook under papermill in a fresh kernel → a row; failure statuses
    engines     the driver and the local engine; ray_engine: a Ray task per point
    cli         the command line
"""

from .cli import build_parser, main
from .engines import ENGINES, local_engine, run_sweep
from .grid import (SWEEPS_DIR, expand, load_sweep, merge_grid_items, parse_grid_item, point_id, point_label, points_of,
                   sweep_file, validate)
from .point import (OOM_MESSAGES, PACKAGE_DIR, POINT_NOTEBOOK, QUIET_KERNEL, failure_status, kernel_environment,
                    mark_failed, new_row, run_one)
from .store import (COLUMNS, PARAMETER_COLUMNS, RECORD_COLUMNS, STATUSES, SWEEP_COLUMNS, append_row, append_run,
                    done_point_ids, load_results, locked, record_run, replace_text)
