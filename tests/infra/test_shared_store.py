"""A results folder that many sweeps share, and that others can write into: nothing lost, nothing followed.

Identical sweeps started together into one folder each run the points the others have not finished, in files of
their own, and a completed point is never replaced by another writer's failed attempt. A symbolic link planted
where a sweep writes (a temporary file's name, a record's, an executed notebook's) is refused in one line before
any point runs, and the file it points to outside the folder stays byte for byte as it was.
"""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab import cli
from kvlab.lab.grid import point_id, point_label, validate
from kvlab.lab.runner import POINT_NOTEBOOK, run_one
from kvlab.lab.store import append_row, replace_text
from kvlab.results import load_results

ROOT = Path(__file__).resolve().parents[2]
# The cheapest points there are: one layer, batch 1, prompt 8, 4 new tokens; three designs.
TINY = dict(preset="toy", overrides="num_hidden_layers=1", batch=1, prompt=8, new=4, device="cpu")
CACHES = ("tuple", "dynamic", "list")


def grid_arguments(**changes) -> list[str]:
    return [item for key, value in {**TINY, **changes}.items() for item in ("--grid", f"{key}={value}")]


def checksum(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_failed_attempt_never_replaces_a_completed_point(tmp_path):
    """Another writer's failure of a point this folder holds as ok (the two sweeps of the report) is dropped."""
    results = tmp_path / "results.csv"
    append_row(results, dict(point_id="p1", status="ok", error=None, batch=1))
    kept = append_row(results, dict(point_id="p1", status="failed", error="FileNotFoundError: gone", batch=1))
    assert kept["status"] == "ok"
    table = load_results(results)
    assert list(table["status"]) == ["ok"] and table["error"].isna().all()
    assert json.loads((tmp_path / "records" / "p1.json").read_text())["status"] == "ok"
    append_row(results, dict(point_id="p2", status="failed", error="first try"))  # a failure is still replaced
    append_row(results, dict(point_id="p2", status="ok", error=None))
    assert dict(zip(load_results(results)["point_id"], load_results(results)["status"])) == {"p1": "ok", "p2": "ok"}


@pytest.mark.slow
@pytest.mark.parametrize("writers", [2, 4])
def test_identical_sweeps_into_one_folder_end_with_every_point_ok_once(tmp_path, writers):
    command = [sys.executable, "-m", "kvlab", "sweep", "--out", str(tmp_path), *grid_arguments(cache=",".join(CACHES))]
    sweeps = [
        subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for _ in range(writers)
    ]
    errors = [process.communicate(timeout=900)[1] for process in sweeps]
    assert [process.returncode for process in sweeps] == [0] * writers, "\n".join(errors)
    table = load_results(tmp_path)
    assert len(table) == len(CACHES) and table["point_id"].is_unique and (table["status"] == "ok").all(), table
    assert sorted(table["cache"]) == sorted(CACHES)
    records = sorted(path.stem for path in (tmp_path / "records").iterdir())
    assert records == sorted(table["point_id"])  # one record each, and nothing else in records/
    notebooks = sorted(path.name for path in (tmp_path / "notebooks").iterdir())
    assert notebooks == sorted(Path(notebook).name for notebook in table["notebook"])
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "notebooks",
        "provenance.json",
        "records",
        "results.csv",
        "summary.md",
    ]  # no writer's temporary file or folder left
    print(f"{writers} writers: {len(table)} ok rows, {len(records)} records")


def planted() -> dict[str, Path]:
    """Where a sweep of the tiny tuple point writes, each name a link to a file outside its folder."""
    (params,) = validate([dict(TINY, cache="tuple")])
    return {
        "results.csv.tmp": Path("results.csv.tmp"),
        "a record's temporary file": Path("records") / f"{point_id(params)}.json.tmp",
        "the executed notebook": Path("notebooks") / f"{point_label(params)}.ipynb",
    }


@pytest.mark.parametrize("where", ["results.csv.tmp", "a record's temporary file", "the executed notebook"])
def test_a_planted_link_is_refused_and_nothing_outside_changes(tmp_path, capsys, where):
    out, outside = tmp_path / "out", tmp_path / "outside.txt"
    outside.write_text("a file the sweep must not touch\n")
    before = checksum(outside)
    link = out / planted()[where]
    link.parent.mkdir(parents=True)
    link.symlink_to(outside)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["sweep", "--out", str(out), *grid_arguments(cache="tuple")])
    error = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(error) == 1, error
    assert error[0] == (
        f"kvlab sweep: error: {link} is a symbolic link (to {outside}); kvlab writes only inside its folder and "
        f"never through a link: remove the link"
    )
    assert checksum(outside) == before and link.is_symlink()
    assert not (out / "results.csv").exists()  # refused before any point ran


def test_writes_replace_a_link_planted_after_the_check_instead_of_following_it(tmp_path):
    """The store and the runner refuse a link at the name they replace; any temporary file is new (O_EXCL)."""
    outside = tmp_path / "outside.txt"
    outside.write_text("outside\n")
    before = checksum(outside)
    out = tmp_path / "out"
    (out / "notebooks").mkdir(parents=True)
    (out / "results.csv").symlink_to(outside)
    with pytest.raises(ValueError, match="results.csv is a symbolic link"):
        replace_text(out / "results.csv", "point_id,status\n")
    (params,) = validate([dict(TINY, cache="tuple")])
    executed = out / "notebooks" / f"{point_label(params)}.ipynb"
    executed.symlink_to(outside)
    row = run_one(params, out, POINT_NOTEBOOK)
    assert row["status"] == "failed" and "is a symbolic link" in row["error"], row
    assert checksum(outside) == before
    assert sorted(path.name for path in (out / "notebooks").iterdir()) == [executed.name]  # no folder of ours left
