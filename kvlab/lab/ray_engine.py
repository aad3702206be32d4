"""The Ray engine: one Ray task per point, on a local Ray instance (127.0.0.1 only) or a cluster (`--address auto`,
`ray://HEAD:10001`: docs/cluster.md). A task runs the point notebook under papermill in a fresh kernel on its node and
returns its row and executed notebook for the driver to write into OUT; it asks for a GPU for a CUDA point, else a CPU
(a sweep whose tasks would wait forever for a GPU the cluster lacks is refused). Ctrl-C or SIGTERM stops the tasks.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

from .runner import kernel_environment, mark_failed, new_row, run_one
from .store import replace_text


def point_resources(params: dict, num_cpus: float | None = None, num_gpus: float | None = None) -> dict:
    """The Ray resources of one point's task: a GPU for a CUDA point, a CPU for the rest, unless overridden."""
    cuda = str(params["device"]).startswith("cuda")
    return dict(num_cpus=1 if num_cpus is None else num_cpus, num_gpus=int(cuda) if num_gpus is None else num_gpus)


def init_ray(address: str | None = None, **options) -> None:
    """Connect to the Ray cluster at `address` (else $RAY_ADDRESS's) or start one on 127.0.0.1 only, without a dashboard
    (whoever reaches Ray's ports runs code here); Ray's cluster mode off meanwhile, else it swaps in the network IP."""
    import ray
    from ray._private import ray_constants as constants

    address = address or os.environ.get("RAY_ADDRESS")
    if address is None:
        options.update(_node_ip_address="127.0.0.1", include_dashboard=False, dashboard_host="127.0.0.1")
    loopback = address is None or address.split("://")[-1].rsplit(":", 1)[0] in ("127.0.0.1", "localhost")
    clusters, constants.ENABLE_RAY_CLUSTER = constants.ENABLE_RAY_CLUSTER, constants.ENABLE_RAY_CLUSTER and not loopback
    try:
        try:
            ray.init(address, logging_level=logging.ERROR, log_to_driver=False, **options)
        except (
            Exception
        ) as error:  # Ray waits a fixed 30 s for its new node; a loaded machine may need longer: once more
            if address is not None or "timed out during startup" not in str(error):
                raise
            ray.shutdown()
            ray.init(address, logging_level=logging.ERROR, log_to_driver=False, **options)
    finally:
        constants.ENABLE_RAY_CLUSTER = clusters


def hold_interrupts(caught: list, saved: dict) -> None:
    """Note Ctrl-C and SIGTERM in `caught` (main thread only) until `saved` is restored: the driver stops Ray in order,
    between Ray calls, not wherever a signal lands (a second Ctrl-C too). Again after ray.init, which sets its own."""
    if threading.current_thread() is threading.main_thread():
        for number in (signal.SIGINT, signal.SIGTERM):  # one ignored (nohup, a background job) stays ignored
            ignored = saved.setdefault(number, signal.getsignal(number)) is signal.SIG_IGN
            signal.signal(number, signal.SIG_IGN if ignored else lambda number, frame: caught.append(number))


def run_point_task(params: dict, notebook_text: str, kernel_name: str | None = None, timeout: int | None = None):
    """Inside a Ray task, on any node: one point in a scratch folder → (row, executed notebook)."""
    with tempfile.TemporaryDirectory(prefix="kvlab-point-") as scratch, kernel_environment([params]):
        scratch = Path(scratch)
        (scratch / "notebooks").mkdir()
        (scratch / "point.ipynb").write_text(notebook_text)
        row = run_one(params, scratch, scratch / "point.ipynb", kernel_name, timeout)
        executed = scratch / row["notebook"] if row["notebook"] else None
        return row, executed.read_text() if executed and executed.exists() else None


def run_on_ray(
    todo: list[dict],
    out: Path,
    notebook: Path,
    kernel_name=None,
    point_timeout=None,
    *,
    address: str | None = None,
    num_cpus: float | None = None,
    num_gpus: float | None = None,
):
    """Submit every point as a task and yield each row as its task ends. Uses the Ray instance of this process if
    there is one, else `init_ray(address)`: an instance started here is stopped at the end."""
    try:
        import ray
    except ImportError:
        raise ValueError("the ray engine needs Ray: pip install 'kvlab[ray]'") from None
    started_here, pending, caught, saved = not ray.is_initialized(), {}, [], {}
    hold_interrupts(caught, saved)
    try:
        if started_here:
            init_ray(address)
            hold_interrupts(caught, saved)
        needed = max(point_resources(p, num_cpus, num_gpus)["num_gpus"] for p in todo)
        if needed > (available := ray.cluster_resources().get("GPU", 0)):
            raise ValueError(
                f"CUDA points need {needed:g} GPU per task but the Ray cluster has {available:g} GPUs: "
                f"its tasks would wait forever; run on a cluster with GPUs (--address) or pass --num-gpus 0"
            )
        task, notebook_text = ray.remote(run_point_task), Path(notebook).read_text()
        for params in todo:
            ref = task.options(
                **point_resources(params, num_cpus, num_gpus),
                max_retries=0,
                name=f"kvlab point {params['cache']}/{params['loop']}",
            ).remote(params, notebook_text, kernel_name, point_timeout)
            pending[ref] = (params, time.perf_counter())
        while pending and not caught:  # a short wait, so that a noted Ctrl-C is seen at once
            for ref in ray.wait(list(pending), num_returns=1, timeout=0.2)[0]:
                params, submitted = pending.pop(ref)
                try:
                    row, executed = ray.get(ref)
                    if executed is not None:
                        replace_text(out / row["notebook"], executed)  # never through a link
                except ray.exceptions.RayError as error:  # the task itself died (worker or node lost): a failure row
                    cause = getattr(error, "cause", None) or error
                    row = dict(
                        mark_failed(new_row(params), type(cause).__name__, str(cause)),
                        elapsed_s=round(time.perf_counter() - submitted, 2),
                    )
                yield row
    finally:  # an interrupt, an error or a closed generator: stop what still runs, then Ray if started here
        if pending:  # force: each worker killed, not sent a KeyboardInterrupt somewhere inside papermill
            for ref in ray.wait(list(pending), num_returns=len(pending), timeout=0)[1]:
                ray.cancel(ref, force=True)
            ray.wait(list(pending), num_returns=len(pending), timeout=60)  # all settled: a late reply crashes Ray
        if started_here:
            ray.shutdown()
        for number, handler in saved.items():
            signal.signal(number, handler)
    if caught:  # noted while Ray ran: raised now that it is stopped
        raise KeyboardInterrupt
