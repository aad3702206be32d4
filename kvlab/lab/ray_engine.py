"""The Ray engine: one Ray task per point, on a local Ray instance that listens on 127.0.0.1 only, or on a cluster
(`--address auto`, `ray://HEAD:10001`: docs/cluster.md). Each task runs the point notebook under papermill in a
fresh kernel, in a scratch folder of the node Ray picks, and returns its row and executed notebook, which the
driver writes into OUT (nodes need kvlab installed, not a shared file system). A task asks for one GPU for a CUDA
point, else one CPU (`num_gpus`/`num_cpus` override; 0.25 GPU lets four points share a card); tasks that would
wait forever for a GPU the cluster lacks are refused up front. Ctrl-C (or SIGTERM) stops the tasks still running;
the rows already written stay, and a rerun resumes.
"""

from __future__ import annotations

import logging
import signal
import tempfile
import threading
import time
from pathlib import Path

from .runner import kernel_environment, mark_failed, new_row, run_one

def point_resources(params: dict, num_cpus: float | None = None, num_gpus: float | None = None) -> dict:
    """The Ray resources of one point's task: a GPU for a CUDA point, a CPU for the rest, unless overridden."""
    cuda = str(params["device"]).startswith("cuda")
    return dict(num_cpus=1 if num_cpus is None else num_cpus,
                num_gpus=(1 if cuda else 0) if num_gpus is None else num_gpus)


def start_local_ray(**options) -> None:
    """Start a Ray instance for this process, on 127.0.0.1 only and without a dashboard: whoever reaches Ray's ports
    can run code here. (Ray on Linux swaps 127.0.0.1 for the machine's network address unless clusters are off.)"""
    import ray
    from ray._private import ray_constants
    clusters, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    try:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, dashboard_host="127.0.0.1",
                 logging_level=logging.ERROR, log_to_driver=False, **options)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = clusters


def hold_interrupts(caught: list, saved: dict) -> None:
    """Note Ctrl-C and SIGTERM in `caught` (main thread only) until `saved` is restored: raised inside a Ray call or
    ray.shutdown, KeyboardInterrupt can crash Ray's C++ core. Again after ray.init, whose SIGTERM handler exits."""
    if threading.current_thread() is threading.main_thread():
        for number in (signal.SIGINT, signal.SIGTERM):
            saved.setdefault(number, signal.signal(number, lambda number, frame: caught.append(number)))


def run_point_task(params: dict, notebook_text: str, kernel_name: str | None = None, timeout: int | None = None):
    """Inside a Ray task, on any node: one point in a scratch folder → (row, executed notebook)."""
    with tempfile.TemporaryDirectory(prefix="kvlab-point-") as scratch, kernel_environment([params]):
        scratch = Path(scratch)
        (scratch / "notebooks").mkdir()
        (scratch / "point.ipynb").write_text(notebook_text)
        row = run_one(params, scratch, scratch / "point.ipynb", kernel_name, timeout)
        executed = scratch / row["notebook"] if row["notebook"] else None
        return row, executed.read_text() if executed and executed.exists() else None


def run_on_ray(todo: list[dict], out: Path, notebook: Path, kernel_name: str | None = None,
               point_timeout: int | None = None, *,
               address: str | None = None, num_cpus: float | None = None, num_gpus: float | None = None):
    """Submit every point as a task and yield each row as its task ends. Uses the Ray instance of this process if
    there is one, else connects to `address` ("auto", "ray://host:port") or starts a local one, stopped at the end."""
    try:
        import ray
    except ImportError:
        raise ValueError("the ray engine needs Ray: pip install 'kvlab[ray]'") from None
    if not todo:
        return
    started_here, pending, caught, saved = not ray.is_initialized(), {}, [], {}
    hold_interrupts(caught, saved)
    try:
        if started_here:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False) if address else start_local_ray()
            hold_interrupts(caught, saved)
        needed = max(point_resources(p, num_cpus, num_gpus)["num_gpus"] for p in todo)
        available = ray.cluster_resources().get("GPU", 0)
        if needed > available:
            raise ValueError(f"CUDA points need {needed:g} GPU per task but the Ray cluster has {available:g} GPUs: "
                             f"its tasks would wait forever; run on a cluster with GPUs (--address) or pass --num-gpus 0")
        task, notebook_text = ray.remote(run_point_task), Path(notebook).read_text()
        for params in todo:
            ref = task.options(**point_resources(params, num_cpus, num_gpus), max_retries=0,
                               name=f"kvlab point {params['cache']}/{params['loop']}").remote(params, notebook_text,
                                                                                             kernel_name, point_timeout)
            pending[ref] = (params, time.perf_counter())
        while pending and not caught:  # a short wait, so that a noted Ctrl-C is seen at once
            for ref in ray.wait(list(pending), num_returns=1, timeout=0.2)[0]:
                params, submitted = pending.pop(ref)
                try:
                    row, executed = ray.get(ref)
                    if executed is not None:
                        (out / row["notebook"]).write_text(executed)
                except ray.exceptions.RayError as error:  # the task itself died (worker or node lost): a failure row
                    cause = getattr(error, "cause", None) or error
                    row = dict(mark_failed(new_row(params), type(cause).__name__, str(cause)),
                               elapsed_s=round(time.perf_counter() - submitted, 2))
                yield row
    finally:  # an interrupt, an error or a closed generator: stop what still runs, then Ray if started here
        if pending:  # force: a worker is killed, not sent a KeyboardInterrupt somewhere inside papermill
            for ref in ray.wait(list(pending), num_returns=len(pending), timeout=0)[1]:
                ray.cancel(ref, force=True)
            ray.wait(list(pending), num_returns=len(pending), timeout=60)  # every task settled before Ray stops
        if started_here:
            ray.shutdown()
        for number, handler in saved.items():
            signal.signal(number, handler)
    if caught:  # noted while Ray ran: raised now that it is stopped
        raise KeyboardInterrupt
