"""The sweep runner: resume after a kill, failures as rows, bad grids refused up front, the CSV schema.

Every point is tiny (one layer, batch 1, prompt 8, 4 new tokens); the cost is papermill starting a
fresh kernel per point, a few seconds each.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlab import cli
from kvlab.lab.engines import run_sweep
from kvlab.lab.grid import SWEEPS_DIR, expand, load_sweep, parse_grid_item, point_id, validate
from kvlab.lab.runner import failure_status
from kvlab.lab.store import COLUMNS, done_point_ids
from kvlab.results import load_results
from kvlab.schema import DEFAULTS

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(preset="toy", overrides="num_hidden_layers=1", batch=1, prompt=8, new=4, device="cpu")
# vocab_size 10**12 asks the allocator for ~1 PB for the embedding: a real out-of-memory, at once
# (with force=True; without it the point is refused before it runs, as predicted not to fit).
TOO_BIG = "num_hidden_layers=1,vocab_size=1000000000000"


def sweep_command(out, *grid):
    args = [sys.executable, "-m", "kvlab", "sweep", "--out", str(out)]
    for key, value in {**TINY, **dict(grid)}.items():
        args += ["--grid", f"{key}={value}"]
    return args


def rows_of(path):
    return load_results(path)


def test_grid_items_parse():
    assert parse_grid_item("new=4,8") == ("new", [4, 8])
    assert parse_grid_item("cache=tuple") == ("cache", ["tuple"])
    assert parse_grid_item("overrides=num_hidden_layers=1,vocab_size=500") == (
        "overrides",
        ["num_hidden_layers=1,vocab_size=500"],
    )


def test_grid_groups_set_parameters_together():
    points = expand(
        {"batch": 1},
        {"design": [{"cache": "tuple", "loop": "v4.40"}, {"cache": "dynamic", "loop": "v5"}], "new": [4, 8]},
    )
    assert len(points) == 4
    assert {(p["cache"], p["loop"], p["new"]) for p in points} == {
        ("tuple", "v4.40", 4),
        ("tuple", "v4.40", 8),
        ("dynamic", "v5", 4),
        ("dynamic", "v5", 8),
    }
    assert all(p["batch"] == 1 for p in points)


@pytest.mark.parametrize(
    "grid, message",
    [
        (["--grid", "colour=red,blue"], "valid"),  # unknown key: names the valid keys
        (["--grid", "cache=tuple,paged"], "choose one of"),  # unknown cache: names the designs
        (["--grid", "new=4,0"], "positive"),  # non-positive size
        (["--grid", "batch=-1"], "positive"),
        (["--grid", "new"], "key=v1,v2"),  # malformed
        (["--grid", "new=4,,8"], "key=v1,v2"),
        (["no-such-sweep"], "cpu-default"),  # names the shipped sweeps
        (["--grid", "new=4", "--address", "auto"], "--engine ray"),  # Ray's options without the Ray engine
        (["--grid", "new=4", "--engine", "dask"], "choose one of local, ray"),
    ],
)
def test_bad_grid_exits_before_running(tmp_path, capsys, grid, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["sweep", "--out", str(out), *grid])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and error.startswith("kvlab sweep: error:") and message in error
    assert not out.exists()  # nothing ran, nothing written


def test_bad_grid_from_the_command_line(tmp_path):
    result = subprocess.run(
        sweep_command(tmp_path / "out", ("cache", "dynamic,paged")),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "unknown cache 'paged'" in result.stderr and "tuple, dynamic, list, static, prealloc" in result.stderr
    assert not (tmp_path / "out").exists()


def listed(listing: str) -> list[tuple]:
    """(cache, loop, new) of each point a dry run lists (`<id> <preset>_<cache>_<loop>_<strategy>_b.._p.._n<new>_<id>`),
    after checking that its closing line counts them."""
    points = [
        re.fullmatch(r"\w+ [\w.-]+?_(\w+)_(v[\d.]+)_\w+_b\d+_p\d+_n(\d+)_\w+", line)
        for line in listing.splitlines()
        if not line.endswith("results.csv")
    ]
    assert all(points), listing
    assert f"\n{len(points)} points; " in f"\n{listing}", listing
    return [(match[1], match[2], int(match[3])) for match in points]


def shipped(name: str) -> dict:
    import yaml

    return yaml.safe_load((SWEEPS_DIR / f"{name}.yaml").read_text())


def test_shipped_sweep_by_name_from_the_cli(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "kvlab", "sweep", "cpu-default", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    sweep = shipped("cpu-default")  # one point per design the file names, at its size
    new = sweep["fixed"]["new"]
    assert sorted(listed(result.stdout)) == sorted((d["cache"], d["loop"], new) for d in sweep["grid"]["design"])


def test_command_line_values_win_over_the_file(capsys):
    cli.main(["sweep", "cpu-default", "--grid", "cache=dynamic", "--grid", "new=64", "--dry-run"])
    points = listed(capsys.readouterr().out)
    loops = {d["loop"] for d in shipped("cpu-default")["grid"]["design"] if d["cache"] == "dynamic"}
    assert sorted(points) == sorted(("dynamic", loop, 64) for loop in loops)  # each of the file's loops once


def test_shipped_sweeps_are_valid():
    for path in sorted(SWEEPS_DIR.glob("*.yaml")):
        fixed, grid = load_sweep(path)
        points = expand(fixed, grid)
        assert points, path.name
        validate(points, devices_here=False)  # CUDA is absent here; the rest must still validate


@pytest.mark.slow
def test_resume_after_kill_gives_one_row_per_point(tmp_path):
    out = tmp_path / "resume"
    command = sweep_command(out, ("cache", "tuple,dynamic"), ("new", "4,5"))
    results = out / "results.csv"
    first = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )  # its own process group: the kernels die with it
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and first.poll() is None:
            if results.exists() and len(rows_of(results)) >= 1:
                break
            time.sleep(0.5)
        assert first.poll() is None, "the sweep ended before it could be killed"
        time.sleep(2)  # well inside the second point
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    written = len(rows_of(results))
    assert 1 <= written < 4

    second = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert f"{written} of 4 points already in" in second.stderr
    table = rows_of(results)
    assert len(table) == 4 and table["point_id"].is_unique
    assert (table["status"] == "ok").all()
    assert sorted(zip(table["cache"], table["new"])) == [("dynamic", 4), ("dynamic", 5), ("tuple", 4), ("tuple", 5)]
    assert len(list((out / "notebooks").glob("*.ipynb"))) == 4

    third = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert third.returncode == 0 and "4 of 4 points already in" in third.stderr
    assert len(rows_of(results)) == 4


@pytest.mark.slow
def test_out_of_memory_point_is_a_row_and_the_sweep_goes_on(tmp_path):
    out = tmp_path / "oom"
    points = [dict(TINY, overrides=TOO_BIG, force=True), dict(TINY, cache="tuple", loop="v4.40")]
    table = run_sweep(points, out, progress=False)

    # The schema: fixed columns in a fixed order, sweep provenance first, every parameter, every record field.
    assert list(table.columns) == COLUMNS
    assert set(DEFAULTS) <= set(table.columns)
    for field in (
        "overhead_bytes",
        "kv_final_bytes",
        "overhead_over_kv",
        "predicted_overhead_bytes",
        "tokens_per_s",
        "device_name",
        "git_commit",
        "measured_at",
        "torch_version",
    ):
        assert field in table.columns

    assert list(table["status"]) == ["oom", "ok"]
    failed, measured = table.iloc[0], table.iloc[1]
    assert "can't allocate memory" in failed["error"] and failed["overrides"] == TOO_BIG
    assert (out / failed["notebook"]).exists()  # the executed notebook shows the traceback
    assert measured["overhead_bytes"] > 0 and measured["kv_final_bytes"] > 0
    ratio = measured["overhead_bytes"] / measured["kv_final_bytes"]
    assert measured["overhead_over_kv"] == pytest.approx(ratio, abs=1e-3)
    assert measured["device"] == "cpu" and measured["loop"] == "v4.40"

    # A rerun retries only the failed point and replaces its row instead of adding one.
    table = run_sweep(points, out, progress=False, command="rerun")
    assert list(table["status"]) == ["ok", "oom"] and table["point_id"].is_unique

    runs = json.loads((out / "provenance.json").read_text())["runs"]
    assert [run["ran"] for run in runs] == [
        {"ok": 1, "oom": 1, "too-big": 0, "failed": 0},
        {"ok": 0, "oom": 1, "too-big": 0, "failed": 0},
    ]
    assert runs[1]["command"] == "rerun" and runs[0]["device"] == "cpu" and runs[0]["git_commit"]


def test_a_point_predicted_not_to_fit_is_a_too_big_row_and_rerun(tmp_path, monkeypatch):
    """Refused before any kernel starts (fast); the row names both numbers and is retried on a rerun."""
    import papermill

    def no_kernel(*args, **kwargs):
        raise AssertionError("a refused point started a kernel")

    monkeypatch.setattr(papermill, "execute_notebook", no_kernel)
    points = [dict(TINY, overrides=TOO_BIG)]
    table = run_sweep(points, tmp_path, progress=False)
    [row] = table.itertuples()
    assert row.status == "too-big" and row.overrides == TOO_BIG and not row.force
    assert row.error.startswith("predicted peak ") and " free on cpu; pass --force" in row.error
    assert done_point_ids(tmp_path / "results.csv") == set()  # a failure: retried on a rerun
    table = run_sweep(points, tmp_path, progress=False)
    assert list(table["status"]) == ["too-big"]
    runs = json.loads((tmp_path / "provenance.json").read_text())["runs"]
    assert [run["ran"]["too-big"] for run in runs] == [1, 1]


def test_point_ids_of_stored_results_stay():
    """Parameters added later (kind, runtime) at their defaults leave ids as they were: data/cpu's rows
    (measured before those existed) keep their ids, so they still join and a rerun still skips them."""
    stored = load_results(ROOT / "data" / "cpu" / "results.csv")
    assert "029bfa443c7c" in set(stored["point_id"])
    [point] = validate(
        [
            dict(
                preset="llama2-7b-twin",
                cache="tuple",
                loop="v4.40",
                batch=8,
                prompt=300,
                new=500,
                device="cpu",
                dtype="bfloat16",
            )
        ]
    )
    assert point_id(point) == "029bfa443c7c"
    assert point_id(dict(point, runtime="jit-trace")) != "029bfa443c7c"


def test_force_does_not_change_the_point_id():
    point = validate([TINY])[0]
    assert point_id(point) == point_id(dict(point, force=True))


def test_unknown_engine_is_refused(tmp_path):
    with pytest.raises(ValueError, match="choose one of local, ray"):
        run_sweep([TINY], tmp_path, engine="dask", progress=False)
    assert not (tmp_path / "results.csv").exists()


def test_cuda_points_validated_for_other_machines():
    """The Ray driver may have no GPU: its CUDA points keep `cuda` and CUDA's defaults (the allocator
    counts, no storage tracking; kernels timed), and every other parameter is still checked."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the driver without a GPU")
    [point] = validate([dict(TINY, device="cuda")], devices_here=False)
    assert point["device"] == "cuda" and point["track_storages"] is False and point["timing"] is True
    with pytest.raises(ValueError, match="no CUDA GPU is available"):
        validate([dict(TINY, device="cuda")])
    with pytest.raises(ValueError, match="unknown cache"):
        validate([dict(TINY, device="cuda", cache="paged")], devices_here=False)


def test_failure_status():
    assert failure_status("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB") == "oom"
    assert failure_status("RuntimeError", "DefaultCPUAllocator: can't allocate memory") == "oom"
    assert failure_status("ValueError", "unknown cache") == "failed"


@pytest.mark.slow
def test_a_point_past_its_time_limit_is_a_failed_row_and_the_sweep_goes_on(tmp_path):
    """papermill's execution_timeout: a point still decoding after 2 s is stopped, its kernel shut down, and
    becomes a "failed" row saying so; the next point (refused as too big, so no kernel and no clock) still
    gets its row."""
    import psutil

    endless = dict(TINY, new=65_536, timing=False)  # the most steps a point takes: a minute of decoding or more
    table = run_sweep([endless, dict(TINY, overrides=TOO_BIG)], tmp_path, point_timeout=2, progress=False)
    assert list(table["status"]) == ["failed", "too-big"]
    timed_out = table.iloc[0]
    assert timed_out["error"].startswith("TimeoutError: timed out after 2 s") and timed_out["new"] == 65_536
    assert timed_out["elapsed_s"] < 120  # stopped, not run to the end
    kernels = [p for p in psutil.Process().children(recursive=True) if "ipykernel" in " ".join(p.cmdline())]
    assert kernels == []
    assert json.loads((tmp_path / "provenance.json").read_text())["runs"][0]["point_timeout_s"] == 2
    assert "- failed: toy kvlab dynamic/v5" in (tmp_path / "summary.md").read_text()
