"""The Ray engine on a local Ray cluster with 2 CPUs: a grid killed midway (Ctrl-C) and resumed, a
failing point as one failure row, resources that follow the point's device.

One cluster for the module (starting Ray takes seconds); every point is tiny (one layer, batch 1,
prompt 8, a few new tokens): the cost is a fresh kernel per point.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlab.lab.engines import run_sweep
from kvlab.lab.grid import expand
from kvlab.lab.store import load_results
from kvlab.lab.ray_engine import point_resources

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(preset="toy", overrides="num_hidden_layers=1", batch=1, prompt=8, new=4, device="cpu")
TOO_BIG = "num_hidden_layers=1,vocab_size=1000000000000"  # ~1 PB of embedding: a real out-of-memory at once


@pytest.fixture(scope="module")
def cluster():
    """A local Ray instance with 2 CPUs and no GPU; its address, for drivers in other processes."""
    import logging
    ray.init(num_cpus=2, num_gpus=0, logging_level=logging.ERROR, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


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
def test_killed_midway_and_resumed_gives_four_ok_rows(cluster, tmp_path):
    grid = {**TINY, "cache": "tuple,dynamic", "new": "4,5"}
    command = [sys.executable, "-m", "kvlab", "sweep", "--engine", "ray", "--address", cluster, "--out", str(tmp_path)]
    for key, value in grid.items():
        command += ["--grid", f"{key}={value}"]
    results = tmp_path / "results.csv"
    # Ctrl-C's default action even if this test runs in the background (where SIGINT is ignored, and inherited so)
    driver = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and driver.poll() is None:
            if results.exists() and len(load_results(results)) >= 1:
                break
            time.sleep(0.2)
        assert driver.poll() is None, f"the sweep ended before it could be interrupted: {driver.stderr.read()}"
        driver.send_signal(signal.SIGINT)  # Ctrl-C
        _, stderr = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 130 and "interrupted; rerun the same command to resume" in stderr, stderr
    table = load_results(results)  # a valid CSV with the points that ended
    written = len(table)
    assert 1 <= written < 4 and (table["status"] == "ok").all() and table["point_id"].is_unique

    # The same grid again, from this process on the same cluster: only the missing points run.
    points = expand(dict(TINY), {"cache": ["tuple", "dynamic"], "new": [4, 5]})
    table = run_sweep(points, tmp_path, engine="ray", progress=False)
    assert len(table) == 4 and table["point_id"].is_unique and (table["status"] == "ok").all()
    assert sorted(zip(table["cache"], table["new"])) == [("dynamic", 4), ("dynamic", 5), ("tuple", 4), ("tuple", 5)]
    assert (table["overhead_bytes"] > 0).all() and (table["kv_final_bytes"] > 0).all()
    # Executed notebooks and records came back from the tasks into the folder, one per point.
    assert sorted(p.stem for p in (tmp_path / "notebooks").glob("*.ipynb")) == \
        sorted(Path(n).stem for n in table["notebook"])
    assert len(list((tmp_path / "records").glob("*.json"))) == 4
    runs = sweep_runs(tmp_path)
    assert [run["engine"] for run in runs] == ["ray", "ray"]
    assert runs[0]["ran"]["ok"] == written and runs[1]["ran"]["ok"] == 4 - written


@pytest.mark.slow
def test_a_failing_point_is_one_failure_row(cluster, tmp_path):
    points = [dict(TINY, overrides=TOO_BIG, force=True), dict(TINY, cache="tuple", loop="v4.40")]
    for run in range(2):  # the rerun retries the failed point and replaces its row
        table = run_sweep(points, tmp_path, engine="ray", progress=False)
        assert len(table) == 2 and table["point_id"].is_unique
        assert sorted(table["status"]) == ["ok", "oom"]
    failed = table[table["status"] == "oom"].iloc[0]
    assert "can't allocate memory" in failed["error"] and failed["overrides"] == TOO_BIG
    assert (tmp_path / failed["notebook"]).exists()  # the executed notebook, with the traceback, came back
    assert [run["ran"] for run in sweep_runs(tmp_path)] == [{"ok": 1, "oom": 1, "too-big": 0, "failed": 0},
                                                         {"ok": 0, "oom": 1, "too-big": 0, "failed": 0}]


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
