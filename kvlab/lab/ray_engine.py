"""The Ray engine: one Ray task per point, on a local Ray instance or an existing cluster.

    python -m kvlab sweep cpu-default --engine ray                      # a local Ray instance, every core
    python -m kvlab sweep pr-batch --engine ray --address auto          # the cluster this node belongs to
    python -m kvlab sweep pr-batch --engine ray --address ray://head:10001

Each task runs the point notebook under papermill in a fresh kernel on whichever node Ray picks, in a
scratch folder there, and returns its row (the record in it) and the executed notebook: the driver writes
them into OUT (the nodes need kvlab installed, not a shared file system). A task asks for what its point's
device needs, one GPU for a CUDA point and one CPU otherwise (`num_gpus`/`num_cpus` override; a fraction,
e.g. `--num-gpus 0.25`, lets four points share one card): a task asking for a GPU the cluster does not have
would wait forever, so such a sweep is refused up front.
Ctrl-C cancels the tasks still running; the rows already written stay, and a rerun resumes.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

from .runner import kernel_environment, mark_failed, new_row, run_one


def point_resources(params: dict, num_cpus: float | None = None, num_gpus: float | None = None) -> dict:
    """The Ray resources of one point's task: a GPU for a CUDA point, a CPU for the rest, unless overridden."""
    cuda = str(params["device"]).startswith("cuda")
    return dict(num_cpus=1 if num_cpus is None else num_cpus,
                num_gpus=(1 if cuda else 0) if num_gpus is None else num_gpus)


def run_point_task(params: dict, notebook_text: str, kernel_name: str | None = None,
                   timeout: int | None = None) -> tuple[dict, str | None]:
    """Inside a Ray task, on any node: one point in a scratch folder → (row, executed notebook)."""
    with tempfile.TemporaryDirectory(prefix="kvlab-point-") as scratch:
        scratch = Path(scratch)
        (scratch / "notebooks").mkdir()
        notebook = scratch / "point.ipynb"
        notebook.write_text(notebook_text)
        with kernel_environment([params]):
            row = run_one(params, scratch, notebook, kernel_name, timeout)
        executed = scratch / row["notebook"] if row["notebook"] else None
        return row, executed.read_text() if executed and executed.exists() else None


def run_on_ray(todo: list[dict], out: Path, notebook: Path, kernel_name: str | None = None,
               point_timeout: int | None = None, *,
               address: str | None = None, num_cpus: float | None = None, num_gpus: float | None = None):
    """Submit every point as a task and yield each row as its task ends (see the module's docstring).

    Uses the Ray instance already initialized in this process if there is one; else connects to `address`
    ("auto", "ray://host:port") or, without one, starts a local instance and stops it at the end.
    """
    try:
        import ray
    except ImportError:
        raise ValueError("the ray engine needs Ray: pip install 'kvlab[ray]'") from None

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    pending = {}
    try:
        needed = max(point_resources(p, num_cpus, num_gpus)["num_gpus"] for p in todo)
        available = ray.cluster_resources().get("GPU", 0)
        if needed > available:
            raise ValueError(f"CUDA points need {needed:g} GPU per task but the Ray cluster has {available:g} GPUs: "
                             f"its tasks would wait forever; run on a cluster with GPUs (--address) or pass --num-gpus 0")
        task = ray.remote(run_point_task)
        notebook_text = Path(notebook).read_text()
        for params in todo:
            ref = task.options(**point_resources(params, num_cpus, num_gpus), max_retries=0,
                               name=f"kvlab point {params['cache']}/{params['loop']}").remote(params, notebook_text,
                                                                                             kernel_name, point_timeout)
            pending[ref] = (params, time.perf_counter())
        while pending:
            [ref], _ = ray.wait(list(pending), num_returns=1)
            params, submitted = pending.pop(ref)
            try:
                row, executed = ray.get(ref)
            except ray.exceptions.RayError as error:  # the task itself died (worker or node lost): a failure row
                cause = getattr(error, "cause", None) or error
                row = mark_failed(new_row(params), type(cause).__name__, str(cause))
                row["elapsed_s"] = round(time.perf_counter() - submitted, 2)
            else:
                if executed is not None:
                    (out / row["notebook"]).write_text(executed)
            yield row
    finally:  # Ctrl-C, an error or a closed generator: stop what still runs
        for ref in pending:
            ray.cancel(ref)
        if started_here:
            ray.shutdown()
