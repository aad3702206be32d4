"""The Ray engine on a local Ray instance with 2 CPUs, started as kvlab starts one: it listens on 127.0.0.1
only; a sweep interrupted again and again (Ctrl-C, SIGTERM) exits cleanly each time, keeps its rows and
resumes; a finished sweep's rerun starts no Ray; a failing point is one failure row; resources follow the
point's device.

One instance for the module (starting Ray takes seconds); every point is tiny (one layer, batch 1,
prompt 8, a few new tokens): the cost is a fresh kernel per point.
"""

import contextlib
import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlab.lab.engines import run_sweep
from kvlab.lab.grid import expand, point_id, validate
from kvlab.lab.ray_engine import init_ray, point_resources
from kvlab.lab.store import append_row
from kvlab.results import load_results

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

# One pytest-xdist worker runs the whole module: its Ray instances start one after another, not side by side.
pytestmark = pytest.mark.xdist_group("ray")
ROOT = Path(__file__).resolve().parents[2]
TINY = dict(preset="toy", overrides="num_hidden_layers=1", batch=1, prompt=8, new=4, device="cpu")
TOO_BIG = "num_hidden_layers=1,vocab_size=1000000000000"  # ~1 PB of embedding: a real out-of-memory at once
INTERRUPTED = "kvlab sweep: interrupted; rerun the same command to resume"


@pytest.fixture(scope="module")
def cluster():
    """A local Ray instance with 2 CPUs and no GPU, started by kvlab's own function; its address, for drivers
    in other processes."""
    init_ray(num_cpus=2, num_gpus=0)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def sweep_command(out, grid, *options):
    command = [sys.executable, "-m", "kvlab", "sweep", "--out", str(out), *options]
    for key, value in grid.items():
        command += ["--grid", f"{key}={value}"]
    return command


def wait_for(condition, what, driver, timeout=240):
    """Until condition() holds, the driver still running: no fixed sleep, whatever the machine's load."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert driver.poll() is None, f"the sweep ended before {what}: {driver.stderr.read()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def point_workers(root: int) -> set[int]:
    """Processes under `root` that run a point (Ray names a task's worker process `ray::<task name>`)."""
    found = set()
    for process in psutil.Process(root).children(recursive=True):
        with contextlib.suppress(psutil.Error):  # one that ended meanwhile
            if " ".join(process.cmdline()).startswith("ray::kvlab point"):
                found.add(process.pid)
    return found


def test_resources_follow_the_device():
    assert point_resources(dict(device="cuda")) == dict(num_cpus=1, num_gpus=1)
    assert point_resources(dict(device="cuda:0")) == dict(num_cpus=1, num_gpus=1)
    assert point_resources(dict(device="cpu")) == dict(num_cpus=1, num_gpus=0)
    assert point_resources(dict(device="meta")) == dict(num_cpus=1, num_gpus=0)
    assert point_resources(dict(device="cuda"), num_cpus=4, num_gpus=0.5) == dict(num_cpus=4, num_gpus=0.5)


@pytest.mark.slow
def test_cuda_points_on_a_cluster_without_gpus_are_refused(cluster, tmp_path):
    """A task asking for a GPU there would wait forever: the sweep says so before submitting anything."""
    with pytest.raises(ValueError, match="has 0 GPUs: its tasks would wait forever"):
        run_sweep([dict(TINY, device="cuda")], tmp_path, engine="ray", progress=False)
    assert not (tmp_path / "results.csv").exists()


@pytest.mark.slow
def test_every_ray_process_listens_on_loopback_only(cluster):
    """Whoever reaches a Ray port can run code on the machine: the instance kvlab starts (its GCS, raylet,
    agents, workers and this driver) listens on 127.0.0.1 and nowhere else, dashboard included."""
    assert cluster.startswith("127.0.0.1:") and ray._private.worker.global_worker.node.node_ip_address == "127.0.0.1"
    assert ray.get(ray.remote(lambda: os.getpid()).remote()) != os.getpid()  # a worker process runs too
    ours = {p.pid for p in psutil.Process().children(recursive=True)} | {os.getpid()}
    listening = [c.laddr for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN and c.pid in ours]
    assert len(listening) >= 4, listening  # the GCS, the raylet's two servers, the worker (at least)

    def loopback(ip):  # gRPC listens on IPv6 sockets: 127.0.0.1 reads ::ffff:127.0.0.1 there
        address = ipaddress.ip_address(ip)
        return (getattr(address, "ipv4_mapped", None) or address).is_loopback

    assert all(loopback(address.ip) for address in listening), listening


@pytest.mark.slow
def test_interrupted_again_and_again_then_resumed_gives_one_ok_row_per_point(cluster, tmp_path):
    """Ctrl-C or SIGTERM of a Ray sweep, three times at different moments, on the module's instance and on the
    local instance a sweep starts itself: each time exit 130 and one line, rows kept; then a rerun completes it."""
    grid = {**TINY, "cache": "tuple,dynamic", "new": "2,3,4"}
    records = tmp_path / "records"
    saved = lambda: len(list(records.glob("*.json")))  # a point's row, saved whole (renamed into place)
    rounds = [  # (start Ray itself?, signal, sent when): as a row is saved, or once a task runs a point
        (False, signal.SIGINT, "row"),
        (False, signal.SIGTERM, "task"),
        (True, signal.SIGINT, "row"),
    ]
    for local, number, moment in rounds:
        command = sweep_command(tmp_path, grid, "--engine", "ray", *([] if local else ["--address", cluster]))
        before, workers_before = saved(), point_workers(os.getpid())
        # Its own process group, as a terminal's job (Ctrl-C reaches the whole group); Ctrl-C's default action
        # even if this test runs in the background (where SIGINT is ignored, and inherited so).
        driver = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            if moment == "row":
                wait_for(lambda: saved() > before, "a new row", driver)  # noqa: B023 (waited for within this iteration)
            else:
                wait_for(  # noqa: B023 (the lambda is waited for within this iteration)
                    lambda: point_workers(driver.pid if local else os.getpid()) - workers_before,  # noqa: B023
                    "a running point",
                    driver,
                )
            os.killpg(driver.pid, number) if local else driver.send_signal(number)
            _, stderr = driver.communicate(timeout=120)
        finally:
            if driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
        assert driver.returncode == 130 and stderr.splitlines()[-1] == INTERRUPTED, stderr
        assert not any(crash in stderr for crash in ("unexpected system", "Check failed", "Traceback")), stderr
        table = load_results(tmp_path / "results.csv")  # a valid table of the points that ended
        assert len(table) == saved() >= before and (table["status"] == "ok").all() and table["point_id"].is_unique
    assert saved() < 6, "every point ended before the last interrupt"

    # The same grid again, from this process on the module's instance: only the missing points run.
    points = validate(expand(dict(TINY), {"cache": ["tuple", "dynamic"], "new": [2, 3, 4]}))
    table = run_sweep(points, tmp_path, engine="ray", progress=False)
    assert len(table) == 6 and table["point_id"].is_unique and (table["status"] == "ok").all()
    assert sorted(table["point_id"]) == sorted(point_id(p) for p in points)
    assert (table["overhead_bytes"] > 0).all() and (table["kv_final_bytes"] > 0).all()
    # Executed notebooks and records came back from the tasks into the folder, one per point.
    assert sorted(p.stem for p in (tmp_path / "notebooks").glob("*.ipynb")) == sorted(
        Path(n).stem for n in table["notebook"]
    )
    assert saved() == 6
    runs = sweep_runs(tmp_path)  # every run that saved rows is logged, and no point was counted twice
    assert {run["engine"] for run in runs} == {"ray"} and sum(run["ran"]["ok"] for run in runs) == 6


@pytest.mark.parametrize("engine", ["ray", "local"])
def test_a_finished_sweep_reruns_nothing_and_starts_no_ray(tmp_path, engine):
    """Every point already ok: the rerun says so and exits 0, without starting Ray (that takes seconds)."""
    grid = dict(TINY, cache="tuple", loop="v4.40")
    [point] = validate([grid])
    (tmp_path / "out").mkdir()
    append_row(tmp_path / "out" / "results.csv", dict(point, point_id=point_id(point), status="ok"))
    ray_folder = tmp_path / "ray"  # where a Ray started by the sweep would keep its session
    result = subprocess.run(
        sweep_command(tmp_path / "out", grid, "--engine", engine),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, RAY_TMPDIR=str(ray_folder)),
    )
    assert result.returncode == 0 and "1 of 1 points already in" in result.stderr, result.stderr
    assert "nothing to run" in result.stderr and not ray_folder.exists()
    assert len(load_results(tmp_path / "out" / "results.csv")) == 1


@pytest.mark.slow
def test_a_failing_point_is_one_failure_row(cluster, tmp_path):
    points = [dict(TINY, overrides=TOO_BIG, force=True), dict(TINY, cache="tuple", loop="v4.40")]
    for _ in range(2):  # the rerun retries the failed point and replaces its row
        table = run_sweep(points, tmp_path, engine="ray", progress=False)
        assert len(table) == 2 and table["point_id"].is_unique
        assert sorted(table["status"]) == ["ok", "oom"]
    failed = table[table["status"] == "oom"].iloc[0]
    assert "can't allocate memory" in failed["error"] and failed["overrides"] == TOO_BIG
    assert (tmp_path / failed["notebook"]).exists()  # the executed notebook, with the traceback, came back
    assert [run["ran"] for run in sweep_runs(tmp_path)] == [
        {"ok": 1, "oom": 1, "too-big": 0, "failed": 0},
        {"ok": 0, "oom": 1, "too-big": 0, "failed": 0},
    ]


@pytest.mark.slow
def test_a_task_whose_worker_dies_is_one_failure_row(cluster, tmp_path):
    """A worker (or its node) lost mid-point: Ray raises for that task; the driver writes a "failed" row
    and the other points go on."""
    import threading

    import psutil

    def kill_the_tuple_point():  # Ray names a task's worker process `ray::<task name>`
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for process in psutil.process_iter(["cmdline"]):
                if " ".join(process.info["cmdline"] or []).startswith("ray::kvlab point tuple/"):
                    process.kill()
                    return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_the_tuple_point, daemon=True)
    killer.start()
    points = [dict(TINY, cache="tuple", new=400), dict(TINY, cache="dynamic")]
    table = run_sweep(points, tmp_path, engine="ray", progress=False)
    killer.join(timeout=1)
    assert len(table) == 2 and table["point_id"].is_unique
    failed, measured = table.set_index("cache").loc["tuple"], table.set_index("cache").loc["dynamic"]
    assert failed["status"] == "failed" and failed["error"].startswith("WorkerCrashedError: ")
    assert measured["status"] == "ok" and measured["overhead_bytes"] > 0


def sweep_runs(out):
    import json

    return json.loads((out / "provenance.json").read_text())["runs"]
