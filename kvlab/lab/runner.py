"""One point of a sweep: the point notebook executed by papermill in a fresh kernel → one results row.

A fresh kernel per point means one point's memory (or crash) never leaks into the next. Both engines
(local and Ray) run a point through `run_one`; a point that fails is a row with its status and error.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from ..planner.plan import TooBig, check_fits
from .grid import point_id, point_label
from .kernel import QUIET_KERNEL
from .kernel import kernel_name as notebook_kernel  # `kvlab` where make registered it, else python3
from .store import refuse_link

PACKAGE_DIR = Path(__file__).resolve().parents[1]
# The folder holding notebooks/ and data/: the checkout kvlab runs from (an editable install, make), else the copies
# a wheel carries inside the package (pyproject.toml maps them to kvlab/notebooks and kvlab/data).
PROJECT_DIR = next(
    (
        folder
        for folder in (PACKAGE_DIR.parent, PACKAGE_DIR)
        if (folder / "notebooks" / "A1_experiment_point.ipynb").exists()
    ),
    PACKAGE_DIR.parent,  # neither: run_sweep names the missing notebook, and --notebook gives another
)
# The notebook every point runs; named here only (scripts ask: python -c "from kvlab.lab.runner import POINT_NOTEBOOK").
POINT_NOTEBOOK = PROJECT_DIR / "notebooks" / "A1_experiment_point.ipynb"
OOM_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory")


def failure_status(name: str, message: str) -> str:
    """ "oom" for torch.OutOfMemoryError (CUDA) or an allocation the CPU refused, else "failed"."""
    if name.endswith("OutOfMemoryError") or any(text in message.lower() for text in OOM_MESSAGES):
        return "oom"
    return "failed"


def new_row(params: dict, notebook: str | None = None) -> dict:
    """The sweep's own columns of a point's row, before it runs."""
    started = datetime.datetime.now(datetime.timezone.utc)
    return dict(params, point_id=point_id(params), started_at=started.isoformat(timespec="seconds"), notebook=notebook)


def mark_failed(row: dict, name: str, message: str) -> dict:
    """A failed point's status ("oom" or "failed") and one-line error, in its row."""
    message = " ".join(str(message).strip().splitlines())
    return dict(row, status=failure_status(name, message), error=f"{name}: {message[:500]}")


@contextlib.contextmanager
def kernel_environment(points: list[dict]):
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


def run_one(
    params: dict, out: Path, notebook: Path, kernel_name: str | None = None, timeout: int | None = None
) -> dict:
    """Execute the point notebook for one point in a fresh kernel (into OUT/notebooks/); return its row.
    `timeout`: seconds each cell may run (papermill's execution_timeout); past it the point is a "failed" row.
    The kernel writes into a folder of this writer's own, moved into place once the point has run: two sweeps
    running one point at once never share a file, and a link planted at the notebook's name is replaced, not
    followed."""
    out = Path(out).absolute()  # the kernel runs in PROJECT_DIR: a relative path would land there
    executed = out / "notebooks" / f"{point_label(params)}.ipynb"
    row = new_row(params, notebook=os.path.relpath(executed, out))
    clock = time.perf_counter()
    private = Path(tempfile.mkdtemp(prefix=".point-", dir=executed.parent))  # new, ours alone (mode 0700)
    try:
        refuse_link(executed)
        if not params["force"]:
            check_fits(params)  # refuse before a kernel starts and allocates
        row.update(_execute(params, private, notebook, kernel_name, timeout), status="ok", error=None)
        os.replace(private / executed.name, executed)
    except TooBig as error:  # refused: no notebook was run
        row.update(status="too-big", error=str(error), notebook=None)
    except TimeoutError:  # nbclient's CellTimeoutError, raised by papermill's execution_timeout
        row = mark_failed(row, "TimeoutError", f"timed out after {timeout} s (a cell of the point notebook)")
        _keep_failed_notebook(private / executed.name, executed)
    except Exception as error:  # a failed point is a row, not the end of the sweep
        row = mark_failed(row, getattr(error, "ename", type(error).__name__), getattr(error, "evalue", error))
        _keep_failed_notebook(private / executed.name, executed)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    row["elapsed_s"] = round(time.perf_counter() - clock, 2)
    return row


def _execute(params: dict, folder: Path, notebook: Path, kernel_name: str | None, timeout: int | None) -> dict:
    """Run the point notebook with papermill into `folder` (as <label>.ipynb); return the record it wrote."""
    import papermill

    record_path = folder / f"{point_label(params)}.json"
    papermill.execute_notebook(
        str(notebook),
        str(folder / f"{point_label(params)}.ipynb"),
        parameters=dict(params, record_path=str(record_path)),
        kernel_name=kernel_name or notebook_kernel(),
        progress_bar=False,
        log_output=False,
        cwd=str(PROJECT_DIR),
        extra_arguments=QUIET_KERNEL,
        execution_timeout=timeout,
    )
    return json.loads(record_path.read_text())


def _keep_failed_notebook(partial: Path, executed: Path) -> None:
    """A failed point's notebook, as far as it ran, where its row says (it shows the error)."""
    with contextlib.suppress(OSError):
        os.replace(partial, executed)
