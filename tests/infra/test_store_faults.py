"""The results store under damage: a torn or garbage table, a kill mid-write, a full or read-only disk,
a file where a folder is wanted, a sweep file that is not one. Afterwards every saved row is in the table
once, or the command stops before any point with one line that names the file and how to recover.

The rows are real: the first rows of data/cpu/results.csv, compared column by column with that file. The
full and read-only disks are real file systems (a small tmpfs, a read-only bind mount); mounting needs root,
so those tests are skipped without it.
"""

import csv
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from kvlab import cli
from kvlab.lab.store import append_row, done_point_ids, rebuild
from kvlab.results import load_results

ROOT = Path(__file__).resolve().parents[2]
MEASURED = ROOT / "data" / "cpu" / "results.csv"
TINY = [
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
]


def measured_rows(count=None):
    """Rows of data/cpu/results.csv as a sweep hands them to the store (no value: None)."""
    with MEASURED.open(newline="") as handle:
        rows = [{key: value or None for key, value in row.items()} for row in csv.DictReader(handle)]
    return rows[:count]


def same_as_measured(table):
    """The table's rows hold data/cpu's values for the same points (read by pandas, not by the store)."""
    expected = pd.read_csv(MEASURED).set_index("point_id").loc[list(table["point_id"])]
    for column in ("overhead_bytes", "kv_final_bytes", "peak_bytes", "cache", "loop", "batch", "new", "measured_at"):
        assert list(table[column]) == list(expected[column]), column
    return True


def folder_with_rows(out, count=5):
    out.mkdir(exist_ok=True)
    for row in measured_rows(count):
        append_row(out / "results.csv", row)
    return out


def sweep(argv, capsys):
    """`python -m kvlab sweep ARGV` in this process: (exit code, stderr lines)."""
    code = 0
    try:
        cli.main(["sweep", *argv])
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err.strip().splitlines()


def tear(path):
    """Cut the last line half-way, as a full disk, a bad copy or a hand edit does."""
    data = path.read_bytes()
    last_line = data.rstrip(b"\n").rfind(b"\n") + 1
    path.write_bytes(data[: last_line + (len(data) - last_line) // 2])


DAMAGE = {
    "torn last line": tear,
    "line short of fields": lambda path: path.write_text(
        "".join(
            line if n != 3 else ",".join(line.split(",")[:20]) + "\n"
            for n, line in enumerate(path.read_text().splitlines(keepends=True))
        )
    ),
    "text that is not a table": lambda path: path.write_text("lorem ipsum, dolor sit\namet\n" * 52),
    "binary": lambda path: path.write_bytes(bytes(range(256)) * 8 + b"\n"),
    "a row twice": lambda path: path.write_text(path.read_text() + path.read_text().splitlines(keepends=True)[1]),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_table_is_set_aside_and_rebuilt(tmp_path, capsys, damage):
    out = folder_with_rows(tmp_path / "out")
    results = out / "results.csv"
    DAMAGE[damage](results)
    damaged = results.read_bytes()
    with pytest.raises(ValueError, match=f"{results} is damaged .*--out {out} --rebuild"):
        load_results(out)  # never read as a table

    code, err = sweep(["--out", str(out), "--rebuild"], capsys)
    assert code is None or code == 0
    assert err[0].startswith(f"kvlab: {results} is damaged (") and "kept as results.csv.damaged-" in err[0]
    [aside] = out.glob("results.csv.damaged-*")
    assert aside.read_bytes() == damaged  # kept as it was
    table = load_results(out)  # rebuilt from the records, in the order they were saved
    assert sorted(table["point_id"]) == sorted(row["point_id"] for row in measured_rows(5)) and same_as_measured(table)

    append_row(results, measured_rows(6)[5])  # the next row lands in a sound table
    assert len(load_results(out)) == 6


def test_a_row_saved_onto_a_torn_table_keeps_every_row(tmp_path, capsys):
    """The next sweep's first row after a torn line: it used to be appended onto that line (73 fields)."""
    out = folder_with_rows(tmp_path / "out")
    tear(out / "results.csv")
    append_row(out / "results.csv", measured_rows(6)[5])
    assert f"{out / 'results.csv'} is damaged (its last line is cut off)" in capsys.readouterr().err
    table = load_results(out)
    assert sorted(table["point_id"]) == sorted(row["point_id"] for row in measured_rows(6)) and same_as_measured(table)


def test_a_damaged_record_is_set_aside_and_its_point_runs_again(tmp_path, capsys):
    """The records are the one truth: a record cut short loses its row (the table is remade without it), and the
    next sweep measures that point again."""
    out = folder_with_rows(tmp_path / "out", count=3)
    lost = measured_rows(2)[1]["point_id"]
    record = out / "records" / f"{lost}.json"
    record.write_bytes(record.read_bytes()[:300])  # cut short
    assert len(rebuild(out / "results.csv")) == 2
    assert f"kvlab: {record} is damaged (not JSON: " in capsys.readouterr().err
    assert len(list((out / "records").glob("*.json.damaged-*"))) == 1
    table = load_results(out)
    assert lost not in set(table["point_id"]) and len(table) == 2 and same_as_measured(table)
    assert lost not in done_point_ids(out / "results.csv")


def test_a_damaged_table_without_records_stops_the_sweep_in_one_line(tmp_path, capsys):
    """A damaged table and no records: nothing to remake it from, so nothing is touched or run."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(MEASURED, out / "results.csv")
    tear(out / "results.csv")
    damaged = (out / "results.csv").read_bytes()
    for argv in (["--rebuild"], [*TINY, "--grid", "new=4"]):
        code, err = sweep(["--out", str(out), *argv], capsys)
        assert code == 2 and len(err) == 1, err
        assert err[0] == (
            f"kvlab sweep: error: {out / 'results.csv'} is damaged (its last line is cut off) and "
            f"{out / 'records'} holds no rows to rebuild it from: repair the file or move it away"
        )
    assert (out / "results.csv").read_bytes() == damaged
    assert not list((out / "notebooks").glob("*")) and not list(out.glob("results.csv.*"))  # no point ran


def test_a_table_whose_rows_have_no_records_is_refused_not_lost(tmp_path):
    """The table is remade from the records: rows that only the table holds would vanish, so nothing is written."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(MEASURED, out / "results.csv")
    with pytest.raises(ValueError, match="has rows with no record in .*would be lost"):
        rebuild(out / "results.csv")
    assert (out / "results.csv").read_bytes() == Path(MEASURED).read_bytes()


# A writer that saves rows p0, p1, ... and prints each one's number once append_row returned. With KILL_AT
# set, it kills itself with SIGKILL right after that many fsyncs into row KILL_ROW: inside the write of
# that row's record (before or after its rename) or of the table (before or after its rename).
WRITER = """
import csv, os, signal, sys
from pathlib import Path
from kvlab.lab.store import append_row
out, start, kill_row, kill_at = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rows = [{k: v or None for k, v in row.items()} for row in csv.DictReader(open(sys.argv[5], newline=""))]
fsync, calls = os.fsync, []
def fsync_then_die(descriptor):
    fsync(descriptor)
    calls.append(descriptor)
    if len(calls) == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
for n in range(start, start + 10_000):
    if n == kill_row:
        os.fsync = fsync_then_die
    append_row(out / "results.csv", dict(rows[n % len(rows)], point_id=f"p{n}"))
    print(n, flush=True)
"""


def start_writer(out, start=0, kill_row=-1, kill_at=0):
    out.mkdir(exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(out), str(start), str(kill_row), str(kill_at), str(MEASURED)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def acknowledged_by(writer, first_line):
    """The rows a killed writer saw saved (its buffered first line included), once it has ended."""
    lines = first_line + writer.stdout.read()  # the same buffered reader as the first line
    writer.wait()
    return [f"p{int(n)}" for n in lines.split()]


def saved_ids(out):
    return list(load_results(out)["point_id"])


@pytest.mark.slow
def test_a_kill_mid_write_loses_at_most_the_row_being_written(tmp_path):
    """Killed at each step of saving row p3, and at random moments: the table is always sound, every row
    whose save returned is in it once, and only p3 (being written) may be missing; a rerun adds it."""
    fixed = {
        kill_at: start_writer(tmp_path / f"fsync{kill_at}", kill_row=3, kill_at=kill_at) for kill_at in (1, 2, 3, 4)
    }
    free = [start_writer(tmp_path / f"random{n}") for n in range(3)]
    first = [process.stdout.readline() for process in free]  # saving rows: now kill each anywhere
    assert all(first), [process.stderr.read() for process in free]
    for n, process in enumerate(free):
        time.sleep(0.05 + 0.17 * n)
        process.send_signal(signal.SIGKILL)
    for kill_at, process in fixed.items():
        acknowledged = [int(line) for line in process.communicate(timeout=300)[0].split()]
        assert process.returncode == -signal.SIGKILL and acknowledged == [0, 1, 2], process.stderr
        out = tmp_path / f"fsync{kill_at}"
        # fsync 1: p3's record not yet renamed; 2: renamed, table not written; 3: table written, not renamed;
        # 4: renamed (its folder synced). The table on disk is whole in every case.
        assert saved_ids(out) == ["p0", "p1", "p2"] + (["p3"] if kill_at == 4 else [])
        assert [row["point_id"] for row in rebuild(out / "results.csv")] == ["p0", "p1", "p2"] + (
            ["p3"] if kill_at >= 2 else []
        )
    for n, process in enumerate(free):
        acknowledged = acknowledged_by(process, first[n])
        out = tmp_path / f"random{n}"
        table = saved_ids(out)  # whole, without a rebuild
        assert table[: len(acknowledged)] == acknowledged and len(table) <= len(acknowledged) + 1
        in_flight = f"p{len(acknowledged)}"  # saved again, as a rerun does: it replaces a copy saved before the kill
        append_row(out / "results.csv", dict(measured_rows(1)[0], point_id=in_flight))
        assert saved_ids(out) == acknowledged + [in_flight]


@pytest.mark.slow
def test_writers_that_all_find_the_table_torn_set_it_aside_once(tmp_path):
    out = folder_with_rows(tmp_path / "out", count=3)
    tear(out / "results.csv")
    writers = [start_writer(out, start=100 * w) for w in range(1, 4)]
    first = [writer.stdout.readline() for writer in writers]
    assert all(first), [writer.stderr.read() for writer in writers]
    time.sleep(1)
    acknowledged = []
    for line, writer in zip(first, writers):
        writer.kill()
        acknowledged += acknowledged_by(writer, line)
    assert len(list(out.glob("results.csv.damaged-*"))) == 1
    table = [row["point_id"] for row in rebuild(out / "results.csv")]
    assert len(table) == len(set(table)) and set(table) >= {row["point_id"] for row in measured_rows(3)} | set(
        acknowledged
    )


@pytest.fixture
def mount_point(tmp_path):
    """A folder to mount a file system on, unmounted afterwards; skipped where mounting is not allowed."""
    target = tmp_path / "mount"
    target.mkdir()
    mounted = []

    def mount(*args):
        result = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount here (needs root): {result.stderr.strip()}")
        mounted.append(target)
        return target

    yield mount
    for _ in mounted:
        subprocess.run(["umount", str(target)], check=True)


@pytest.mark.slow
def test_a_full_disk_loses_at_most_the_row_being_written(mount_point, capsys):
    out = mount_point("-t", "tmpfs", "-o", "size=256k", "tmpfs")
    acknowledged = []
    with pytest.raises(OSError) as full:
        for n in range(10_000):
            append_row(out / "results.csv", dict(measured_rows(1)[0], point_id=f"p{n}"))
            acknowledged.append(f"p{n}")
    assert full.value.errno == 28 and str(out) in full.value.filename  # ENOSPC, naming the file
    assert len(acknowledged) > 5 and saved_ids(out) == acknowledged  # the table is whole
    assert not list(out.rglob("*.tmp"))  # no half-written file left behind

    # A sweep refuses to start there, and a rebuild that cannot write says so: one line each.
    code, err = sweep(["--out", str(out), *TINY, "--grid", "new=4"], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"kvlab sweep: error: cannot write results to {out}: ")
    assert "KiB free on its file system" in err[0] or "No space left on device" in err[0]
    (out / "results.csv").unlink()  # lost: the rows are in the records, but the disk is full again
    with pytest.raises(OSError), (out / "filler").open("wb") as filler:
        while True:
            filler.write(bytes(4096))
            filler.flush()
    code, err = sweep(["--out", str(out), "--rebuild"], capsys)
    assert code == 2 and len(err) == 1 and "No space left on device" in err[0] and str(out / "results.csv") in err[0]
    assert "rerun the same command to resume" in err[0]

    subprocess.run(["mount", "-o", "remount,size=16m", str(out)], check=True)  # space freed
    code, err = sweep(["--out", str(out), "--rebuild"], capsys)
    assert code in (0, None) and saved_ids(out)[: len(acknowledged)] == acknowledged
    assert len(saved_ids(out)) <= len(acknowledged) + 1  # plus the one being written, if its record was saved


@pytest.mark.slow
def test_a_read_only_folder_is_refused_before_any_point(tmp_path, mount_point, capsys):
    folder = folder_with_rows(tmp_path / "out", count=3)
    before = {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()}
    out = mount_point("--bind", "-o", "ro", str(folder))
    assert subprocess.run(["touch", str(out / "x")], capture_output=True).returncode != 0  # really read-only
    code, err = sweep(["--out", str(out), *TINY, "--grid", "new=4"], capsys)
    assert code == 2 and err == [
        f"kvlab sweep: error: cannot write results to {out}: Read-only file system ({out / 'notebooks'})"
    ]
    assert len(load_results(out)) == 3  # still readable
    with pytest.raises(OSError, match="Read-only file system"):
        append_row(out / "results.csv", measured_rows(4)[3])
    assert {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()} == before


@pytest.mark.parametrize(
    "where, message",
    [
        ("a file", "--out {out} is a file; give a folder for the results"),
        ("under a file", "cannot write results to {out}: Not a directory ({out}/notebooks)"),
    ],
)
def test_out_that_is_not_a_folder_is_refused_before_any_point(tmp_path, capsys, where, message):
    (tmp_path / "file").write_text("mine\n")
    out = tmp_path / "file" if where == "a file" else tmp_path / "file" / "results"
    for extra in ([], ["--dry-run"]) if where == "a file" else ([],):
        code, err = sweep(["--out", str(out), *TINY, "--grid", "new=4", *extra], capsys)
        assert code == 2 and err == ["kvlab sweep: error: " + message.format(out=out)]
    assert (tmp_path / "file").read_text() == "mine\n" and sorted(tmp_path.iterdir()) == [tmp_path / "file"]


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "{path} is a folder; give a sweep file (YAML)"),
        (
            "grid:\n  new: [4, 8\n  cache: tuple\n",
            "{path} is not valid YAML (line 3: expected ',' or ']', but got ':')",
        ),
        (
            "fixed: {batch: 1}\n\tgrid: {new: [4]}\n",
            "{path} is not valid YAML (line 2: found character '\\t' that cannot start any token)",
        ),
        (b"\xff\xfe\x00binary", "{path} is not a text file; give a sweep file (YAML)"),
    ],
)
def test_a_sweep_file_that_is_not_one_is_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "mine.yaml"
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    code, err = sweep([str(path), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and err == ["kvlab sweep: error: " + message.format(path=path)]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_real_sweep_rebuilds_its_torn_table_and_runs_only_the_new_point(tmp_path):
    """End to end, as the damage was found: a sweep, its table torn, a sweep with one more point."""
    out = tmp_path / "out"

    def run(*new):
        return subprocess.run(
            [sys.executable, "-m", "kvlab", "sweep", "--out", str(out), *TINY, "--grid", f"new={','.join(new)}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )

    first = run("4", "5")
    assert first.returncode == 0, first.stderr
    measured = load_results(out).set_index("point_id")
    tear(out / "results.csv")

    second = run("4", "5", "6")
    assert second.returncode == 0, second.stderr
    notice = [line for line in second.stderr.splitlines() if "is damaged" in line]
    assert notice == [
        f"kvlab: {out / 'results.csv'} is damaged (its last line is cut off); kept as "
        f"{next(out.glob('results.csv.damaged-*')).name}; the table is rebuilt from {out / 'records'}"
    ]
    assert "2 of 3 points already in" in second.stderr  # the torn row was not rerun, nor counted from the tear
    table = load_results(out)
    assert sorted(table["new"]) == [4, 5, 6] and table["point_id"].is_unique and (table["status"] == "ok").all()
    again = table.set_index("point_id").loc[measured.index]
    assert (again["overhead_bytes"] == measured["overhead_bytes"]).all()  # the first run's values, not NaN
    assert sorted(path.stem for path in (out / "records").glob("*.json")) == sorted(table["point_id"])
    assert not list((out / "notebooks").glob("*.json"))  # the notebooks' own records went into the rows
