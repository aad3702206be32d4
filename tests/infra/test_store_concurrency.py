"""The results store under concurrency: several processes writing one folder keep every row, once.

Without the file lock, a writer that rewrites results.csv (a rerun point replacing its failure row, a
new column) from what it read a moment before drops the rows others appended in between, and two
writers share one temporary file: this test then loses rows.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlab.lab.store import COLUMNS
from kvlab.results import load_results

ROOT = Path(__file__).resolve().parents[2]
WRITERS, POINTS = 4, 12

# One writer: for each of its points a failure row, then the ok row that replaces it (a whole-file rewrite),
# every fifth row with a column the file does not have yet (another rewrite); then one provenance run.
WRITER = """
import datetime, sys, time
from pathlib import Path
from kvlab.lab.store import append_row, append_run
out, writer, points = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
(out / f"ready{writer}").touch()  # imports done: start together, so that the writes overlap
while not (out / "go").exists():
    time.sleep(0.01)
for n in range(points):
    point = f"w{writer}p{n}"
    append_row(out / "results.csv", dict(point_id=point, status="failed", error="first try"))
    extra = {f"extra_{writer}_{n}": n} if n % 5 == 0 else {}
    append_row(out / "results.csv", dict(point_id=point, status="ok", error=None, batch=n, **extra))
started = datetime.datetime.now(datetime.timezone.utc)
append_run(out, f"writer {writer}", started, "cpu", points_in_sweep=points, ran=dict(ok=points))
"""


@pytest.mark.slow
def test_concurrent_writers_keep_every_row_once(tmp_path):
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), str(w), str(POINTS)],
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(WRITERS)
    ]
    deadline = time.monotonic() + 240
    while len(list(tmp_path.glob("ready*"))) < WRITERS and time.monotonic() < deadline:
        assert all(writer.poll() is None for writer in writers), "a writer died before starting"
        time.sleep(0.05)
    (tmp_path / "go").touch()
    for writer in writers:
        assert writer.wait(timeout=300) == 0, writer.stderr.read()
    table = load_results(tmp_path / "results.csv")
    expected = {f"w{w}p{n}" for w in range(WRITERS) for n in range(POINTS)}
    assert len(table) == WRITERS * POINTS and set(table["point_id"]) == expected  # none lost, none twice
    assert (table["status"] == "ok").all()
    assert list(table.columns[: len(COLUMNS)]) == COLUMNS
    extras = {column for column in table.columns if column.startswith("extra_")}
    assert len(extras) == WRITERS * len(range(0, POINTS, 5))  # every new column kept, with its value
    for column in extras:
        _, w, n = column.split("_")
        assert table.loc[table["point_id"] == f"w{w}p{n}", column].item() == int(n)
    runs = json.loads((tmp_path / "provenance.json").read_text())["runs"]
    assert sorted(run["command"] for run in runs) == [f"writer {w}" for w in range(WRITERS)]
    assert sorted(path.name for path in tmp_path.iterdir() if not path.name.startswith(("ready", "go"))) == [
        "provenance.json",
        "records",
        "results.csv",
    ]  # no temporary file left, and the locks are elsewhere
    assert sorted(path.stem for path in (tmp_path / "records").iterdir()) == sorted(expected)  # one row file each


@pytest.mark.slow
def test_two_sweeps_into_one_folder_keep_every_row(tmp_path):
    """Two `python -m kvlab sweep` processes at once, two points each, one results folder."""
    tiny = [
        "--grid",
        "preset=toy",
        "--grid",
        "overrides=num_hidden_layers=1",
        "--grid",
        "batch=1",
        "--grid",
        "prompt=8",
        "--grid",
        "device=cpu",
        "--grid",
        "cache=tuple,dynamic",
    ]
    sweeps = [
        subprocess.Popen(
            [sys.executable, "-m", "kvlab", "sweep", "--out", str(tmp_path), *tiny, "--grid", f"new={new}"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for new in (4, 5)
    ]
    for process in sweeps:
        assert process.wait(timeout=300) == 0, process.stderr.read()
    table = load_results(tmp_path)
    assert len(table) == 4 and table["point_id"].is_unique and (table["status"] == "ok").all()
    assert sorted(zip(table["cache"], table["new"])) == [("dynamic", 4), ("dynamic", 5), ("tuple", 4), ("tuple", 5)]
    assert len(list((tmp_path / "notebooks").glob("*.ipynb"))) == 4
    runs = json.loads((tmp_path / "provenance.json").read_text())["runs"]
    assert sorted(run["command"].split()[-1] for run in runs) == ["new=4", "new=5"]
