"""The GPU run: gpu/h200_run.sh (install + one call) and the plan it runs (kvlab.plan, kvlab/plans/h200.yaml).

The plan's dry run is the same orchestrator, lanes, deadlines, store and summary on this CPU, with the
plan's `dry_run:` stand-ins (toy preset, tiny sizes); the runs here are small plans written for the test
and a one-job slice of the shipped plan, so the file takes about a minute, not the dry run's few.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pandas as pd
import psutil
import pytest
import yaml

from kvlab.lab.point import REFERENCES
from kvlab.plan import fit_new, job_seconds, load_plan, merge, points_of
from kvlab.plan_summary import read_data

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "gpu" / "h200_run.sh"


def kvlab_plan(*args, timeout=600, **env):
    env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    return subprocess.run([sys.executable, "-m", "kvlab", "plan", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def write_plan(path: Path, plan: dict) -> Path:
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


# -- the bash script ------------------------------------------------------------------------------
def test_bash_installs_and_makes_one_call():
    text = SCRIPT.read_text()
    code = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(text.splitlines()) <= 60
    assert "<<" not in text, "no heredocs: no program hidden in the bash"
    assert not any(" -c " in line or "python -" in line for line in code)
    calls = [line for line in code if "-m kvlab" in line]
    assert len(calls) == 1 and "-m kvlab plan" in calls[0] and calls[0].lstrip().startswith("exec ")
    assert sorted(path.name for path in (ROOT / "gpu").iterdir()) == ["h200_run.sh"]


def test_no_kv_size_oom_or_record_logic_outside_kvlab():
    lines = SCRIPT.read_text().lower().splitlines()
    text = "\n".join(line for line in lines if not line.lstrip().startswith("#"))  # the code, not its comments
    for word in ("kv_bytes", "head_dim", "num_key_value_heads", "outofmemory", "out of memory", "overhead",
                 "max_memory", "json", "records", "import ", "6.248", "3.125"):
        assert word not in text, word


def test_needs_out():
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "set OUT" in result.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: the real run would start")
def test_gpu_mode_refuses_to_install_without_a_gpu(tmp_path):
    marker = ROOT / ".legacy-tf" / "transformers-4.40.1.dist-info"
    before = marker.exists() and marker.stat().st_mtime
    env = dict(os.environ, OUT=str(tmp_path / "out"), SITE=str(tmp_path / "site"))
    result = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "no NVIDIA GPU" in result.stderr
    assert not (tmp_path / "site").exists() and not (tmp_path / "out" / "install.log").exists()
    assert (marker.exists() and marker.stat().st_mtime) == before


def test_list_prints_every_job_and_runs_nothing(tmp_path):
    # The interpreter running the tests: a checkout without .venv (conda, CI elsewhere) has no torch in python3.
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable)
    result = subprocess.run(["bash", str(SCRIPT), "--list"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    plan = load_plan("h200", devices_here=False)
    for phase in plan["phases"]:
        assert f"phase {phase['name']}" in result.stdout
        for job in phase["jobs"]:
            assert job["name"] in result.stdout
    assert list((tmp_path / "out").iterdir()) == []


# the 33 wheels that make papermill run on the GPU machine (shared/DESIGN.md section 5)
KERNEL_STACK = """asttokens comm debugpy entrypoints executing fastjsonschema ipykernel ipython ipython-pygments-lexers
jedi jsonschema jsonschema-specifications jupyter-client jupyter-core matplotlib-inline nbclient nbformat
nest-asyncio2 papermill parso pexpect platformdirs prompt-toolkit ptyprocess pure-eval pyzmq referencing
rpds-py stack-data tenacity tornado traitlets wcwidth""".split()


def pins(path: Path) -> dict[str, str]:
    """{normalized name: version} of a plain requirements file; each line name==version, each name once."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            requirement = Requirement(line)
            [spec] = requirement.specifier
            assert spec.operator == "==", f"{path.name}: {line} is not pinned exactly"
            name = canonicalize_name(requirement.name)
            assert name not in found, f"{path.name}: {name} pinned twice"
            found[name] = spec.version
    return found


def test_the_pins_the_script_installs():
    from packaging.utils import canonicalize_name

    from kvlab.lab.reference import RELEASES
    text = SCRIPT.read_text()
    kernel, legacy = (ROOT / "scripts" / "wheelhouse-kernel.txt", ROOT / "scripts" / "wheelhouse-legacy.txt")
    assert str(kernel.relative_to(ROOT)) in text and str(legacy.relative_to(ROOT)) in text
    assert sorted(pins(kernel)) == sorted(canonicalize_name(name) for name in KERNEL_STACK)
    assert pins(legacy) == dict(pin.split("==") for pin in RELEASES["4.40.1"][1])  # what kvlab.lab.reference wants
    locked = {canonicalize_name(line.split("==")[0]): line.split("==")[1].strip()
              for line in (ROOT / "requirements.lock").read_text().splitlines() if "==" in line and line[0] != "#"}
    for name, version in pins(kernel).items():
        assert locked.get(name, version) == version, f"{name}: {version} here, {locked[name]} in requirements.lock"


# -- the plan file ----------------------------------------------------------------------------------
def test_shipped_plan_and_its_dry_run():
    plan = load_plan("h200", devices_here=False)
    jobs = [job for phase in plan["phases"] for job in phase["jobs"]]
    points = [point for job in jobs for point in points_of(job)]
    assert {point["device"] for point in points} == {"cuda"} and {point["dtype"] for point in points} == {"bfloat16"}
    assert {point["preset"] for point in points} == {"llama2-7b", "mistral-7b"}
    references = {(p["cache"], p["loop"]) for p in points if p.get("kind") == "reference"}
    assert references == {("tuple", "v4.40"), ("dynamic", "v5"), ("static", "v5")} and references <= set(REFERENCES)
    dry = load_plan("h200", dry_run=True)
    dry_points = [point for phase in dry["phases"] for job in phase["jobs"] for point in points_of(job)]
    assert len(dry_points) == len(points)
    assert {p["device"] for p in dry_points} == {"cpu"} and {p["preset"] for p in dry_points} == {"toy"}
    assert {p["overrides"] for p in dry_points} == {"", "num_key_value_heads=2"}  # MHA and GQA stand-ins
    # the budget: phase 1's jobs fit its window, lane by lane, with the plan's own estimates
    window = plan["budget_s"] - plan["reserve_s"] - plan["phases"][0]["ends_before_s"]
    lanes = {}
    for job in plan["phases"][0]["jobs"]:
        lanes[job["lane"]] = lanes.get(job["lane"], 0) + job_seconds(job, plan["step_s"], plan["start_s"])
    assert max(lanes.values()) <= window, lanes


def test_design_figures_are_read_from_a_data_file_with_provenance():
    table = read_data(ROOT / "data" / "design" / "h200.csv")
    assert (ROOT / "data" / "design" / "provenance.json").exists()
    assert len(table) == 6 and set(table["kind"]) == {"reference"}
    # the stated ratios agree with the stated sizes (DESIGN rounds both)
    ratio = table["overhead_gib"] / table["kv_final_gib"]
    assert ((ratio / table["overhead_over_kv"] - 1).abs() < 0.005).all()
    assert set(zip(table["cache"], table["loop"])) <= set(REFERENCES)


def test_merge_patches_named_items_by_name():
    base = {"a": 1, "phases": [{"name": "p", "jobs": [{"name": "x", "point": {"batch": 8, "new": 500}},
                                                        {"name": "y"}]}]}
    patch = {"phases": [{"name": "p", "jobs": [{"name": "x", "point": {"batch": 2}}]}]}
    assert merge(base, patch) == {"a": 1, "phases": [{"name": "p", "jobs": [
        {"name": "x", "point": {"batch": 2, "new": 500}}, {"name": "y"}]}]}
    with pytest.raises(ValueError, match="does not have"):
        merge(base, {"phases": [{"name": "q"}]})


def test_fit_new_and_estimates():
    job = {"point": {"cache": "dynamic"}, "points": [{"cache": "prealloc"}, {"cache": "dynamic"}],
           "fit_new": {"max": 300, "multiple": 50, "min": 100}}
    # start 10 s + 2 s per point; then 2 points x 0.1 s per step
    assert job_seconds(job, 0.1, 10, new=100) == pytest.approx(10 + 2 * (2 + 100 * 0.1))
    assert fit_new(job, 80, 0.1, 10) == 300  # (80 - 14) / 0.2 = 330 → the max
    assert fit_new(job, 50, 0.1, 10) == 150  # (50 - 14) / 0.2 = 180 → a multiple of 50
    assert fit_new(job, 30, 0.1, 10) is None  # 80 < min
    storages = {"point": {}, "points": [{"new": 100, "track_storages": True}]}  # counted, then timed apart
    reference = {"point": {}, "points": [{"new": 100, "kind": "reference"}]}  # its own process, no build here
    assert job_seconds(storages, 0.1, 10) == pytest.approx(10 + 2 + 20)
    assert job_seconds(reference, 0.1, 10) == pytest.approx(2 + 10 + 10)


GOOD_JOB = {"name": "j1", "lane": "a", "points": [{"cache": "dynamic"}]}


@pytest.mark.parametrize("change, message", [
    ({"phases": []}, "no phases"),
    ({"budget": 3}, "unknown section"),
    ({"step_s": -1}, "step_s must be"),
    ({"parallel": 0}, "parallel must be"),
    ({"phases": [{"name": "p", "jobs": [{"name": "j1", "points": [{}]}]}]}, "needs a name and a lane"),
    ({"phases": [{"name": "p", "jobs": [GOOD_JOB, GOOD_JOB]}]}, "two jobs are named j1"),
    ({"phases": [{"name": "p", "jobs": [dict(GOOD_JOB, sweep={"file": "cpu-default"})]}]}, "either points or a sweep"),
    ({"phases": [{"name": "p", "jobs": [dict(GOOD_JOB, points=[{"cache": "nope"}])]}]}, "job j1: point .*cache"),
    ({"phases": [{"name": "p", "jobs": [dict(GOOD_JOB, points=[{"kind": "reference", "cache": "list"}])]}]},
     "no transformers release runs list/v5"),
    ({"phases": [{"name": "p", "jobs": [dict(GOOD_JOB, fit_new={"min": 4})]}]}, "fit_new has max"),
    ({"phases": [{"name": "p", "jobs": [dict(GOOD_JOB, lanes=2)]}]}, "unknown key"),
    ({"compare_with": [{"label": "x", "path": "data/nowhere.csv"}]}, "not found"),
    ({"dry_run": {"phases": [{"name": "p", "jobs": [{"name": "j9"}]}]}}, "does not have"),
])
def test_bad_plans_fail_before_anything_runs(tmp_path, change, message):
    plan = {"point": {"preset": "toy", "device": "cpu"}, "phases": [{"name": "p", "jobs": [GOOD_JOB]}], **change}
    with pytest.raises(ValueError, match=message):
        load_plan(write_plan(tmp_path / "bad.yaml", plan), dry_run=True)


def test_cli_errors_are_one_line(tmp_path, capsys):
    result = kvlab_plan("nowhere", "--dry-run", "--out", tmp_path / "out")
    assert result.returncode == 2 and result.stderr.startswith("kvlab plan: error: plan file 'nowhere' not found")
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    from kvlab.plan import main
    for args, message in ((["--budget", "10"], "leaves nothing after the"), (["--only", "zz"], "no job of")):
        with pytest.raises(SystemExit) as exit:
            main(["h200", "--dry-run", "--out", str(tmp_path / "out"), *args])
        assert exit.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("output, free", [("81000", 81000), ("81000\n40000", 81000), ("[N/A]", None),
                                          ("", None), ("NVIDIA-SMI has failed because it couldn't communicate", None)])
def test_free_memory_is_read_from_nvidia_smi_or_is_none(output, free):
    from kvlab.plan import free_memory_mib
    assert free_memory_mib(output) == free


@pytest.mark.parametrize("output, lanes", [("[N/A]", 1), ("", 1), ("81920", 3), ("30000", 1)])
def test_auto_parallel_falls_back_to_one_lane_when_nvidia_smi_gives_no_number(monkeypatch, output, lanes):
    import kvlab.plan
    monkeypatch.setattr(kvlab.plan.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(kvlab.plan, "_nvidia_smi", lambda query: output)
    logged = []
    # 80 GiB free, 24 GiB per lane: 3 of 4 lanes; an unreadable answer (MIG's [N/A]): one lane, and a log line
    assert kvlab.plan.lanes_at_once({"parallel": "auto", "gib_per_lane": 24}, 4, logged.append) == lanes
    assert bool(logged) == (output in ("[N/A]", ""))


def test_a_failed_worker_point_is_the_sweeps_failure_row(monkeypatch, capsys):
    """A point that raises is one row, made by kvlab.lab.store's own new_row / mark_failed (its error cut as the
    sweep cuts it), and the worker goes on."""
    import json
    import time

    import kvlab.lab.point
    import kvlab.models
    from kvlab.lab.point import normalize
    from kvlab.plan import ROW, work
    from kvlab.lab.runner import mark_failed, new_row
    message = "first words " + "x" * 600 + " last words"
    def fail(model, **params):
        raise RuntimeError(message)
    monkeypatch.setattr(kvlab.lab.point, "measure", fail)
    monkeypatch.setattr(kvlab.models, "build_model", lambda *args: None)
    point = dict(preset="toy", device="cpu", cache="dynamic", **TINY)
    work(dict(points=[point, dict(point, cache="tuple")], warmup=[], deadline=time.time() + 600, step_s=0.01,
              start_s=0, done=[]))
    rows = [json.loads(line[len(ROW):]) for line in capsys.readouterr().out.splitlines() if line.startswith(ROW)]
    assert [row["cache"] for row in rows] == ["dynamic", "tuple"]
    expected = mark_failed(new_row(normalize(**point)), "RuntimeError", message)
    assert rows[0]["status"] == expected["status"] == "failed"
    assert rows[0]["error"] == expected["error"] and rows[0]["error"].startswith("RuntimeError: first words")


# -- runs on this CPU -----------------------------------------------------------------------------------
TINY = dict(batch=2, prompt=8, new=8)


@pytest.mark.slow
def test_dry_run_of_a_small_plan_end_to_end(tmp_path):
    """A GPU plan (7B, cuda, bf16) run with its dry_run stand-ins: two lanes side by side (a reference and
    kvlab's loop; a one-point papermill sweep and a job too long for the time left), then a speed job
    alone with `new` fitted to the time left; the summary reads a data file; a rerun resumes."""
    data = tmp_path / "numbers.csv"  # a data file the summary must read, with a value found nowhere else
    pd.DataFrame([dict(preset="toy", overrides="", cache="tuple", loop="v4.40", strategy="greedy", dtype="float32",
                       **TINY, overhead_over_kv=1.2345)]).to_csv(data, index=False)
    plan = write_plan(tmp_path / "small.yaml", {
        "budget_s": 300, "reserve_s": 5, "step_s": 0.02, "start_s": 5, "parallel": 2,
        "point": {"preset": "llama2-7b", "device": "cuda", "dtype": "bfloat16", "batch": 8, "prompt": 300, "new": 500},
        "compare_with": [{"label": "from the file", "path": str(data)}],
        "phases": [
            {"name": "side-by-side", "ends_before_s": 60, "jobs": [
                {"name": "a-pair", "lane": "a", "points": [{"kind": "reference", "cache": "tuple", "loop": "v4.40"},
                                                           {"cache": "tuple", "loop": "v4.40"}]},
                {"name": "c-sweep", "lane": "b", "sweep": {"grid": {"preset": "llama2-7b", "cache": "dynamic"}}},
                {"name": "too-long", "lane": "b", "point": {"new": 100000}, "points": [{"cache": "dynamic"}]}]},
            {"name": "alone", "ends_before_s": 0, "jobs": [
                {"name": "d-speed", "lane": "s", "points": [{"cache": "prealloc"}, {"cache": "dynamic"}],
                 "warmup": [{"cache": "dynamic", "new": 2}], "fit_new": {"max": 16, "min": 4},
                 "compare_speed": "dynamic"}]}],
        "dry_run": {"point": {"device": "cpu", "dtype": "float32", **TINY},
                    "presets": {"llama2-7b": {"preset": "toy", "overrides": ""}},
                    "phases": [{"name": "side-by-side", "jobs": [
                        {"name": "c-sweep", "sweep": {"grid": {"device": "cpu", "dtype": "float32", "batch": 2,
                                                               "prompt": 8, "new": 4}}}]}]},
    })
    out = tmp_path / "out"
    result = kvlab_plan(plan, "--dry-run", "--out", out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    files = sorted(path.name for path in out.iterdir())
    assert files == ["env.txt", "provenance.json", "results.csv", "run.log", "summary.md", "sweep.tar.gz"]
    rows = pd.read_csv(out / "results.csv", dtype={"overrides": "string"})
    assert (rows["status"] == "ok").all(), rows[["job", "status", "error"]]
    assert sorted(rows["job"]) == ["a-pair", "a-pair", "c-sweep", "d-speed", "d-speed"]
    assert set(rows["device"]) == {"cpu"} and set(rows["preset"]) == {"toy"}
    pair = rows[rows["job"] == "a-pair"].set_index("kind")
    assert pair.loc["reference", "transformers_version"] == "4.40.1"
    # as tests/test_reference.py: kvlab's v4.40 loop within 1 % of 4.40.1's own generate()
    assert abs(pair.loc["kvlab", "overhead_bytes"] / pair.loc["reference", "overhead_bytes"] - 1) < 0.01
    speed = rows[rows["job"] == "d-speed"]
    assert set(speed["new"]) == {16} and speed["tokens_per_s"].notna().all()  # fitted: the max fits

    summary = (out / "summary.md").read_text()
    [line] = [line for line in summary.splitlines() if line.startswith("| a-pair | kvlab |")]
    assert "| 1.234 |" in line  # read from the data file, at the matching point
    assert "SKIPPED too-long" in summary and "× dynamic" in summary and "| 4.40.1 |" in summary
    with tarfile.open(out / "sweep.tar.gz") as archive:
        names = archive.getnames()
    assert any(name.startswith("sweep/c-sweep/notebooks/") and name.endswith(".ipynb") for name in names)

    again = kvlab_plan(plan, "--dry-run", "--only", "a-", "--out", out)  # a second call resumes
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already ok in results.csv" in (out / "run.log").read_text()
    assert len(pd.read_csv(out / "results.csv")) == len(rows)


@pytest.mark.slow
def test_a_second_call_does_not_rerun_a_sweep_jobs_points(tmp_path):
    """The sweep's own resume across plan calls: its folder is packed into sweep.tar.gz and unpacked again, so
    the second call's sweep finds its point ok and runs no notebook (the row keeps its first started_at)."""
    plan = write_plan(tmp_path / "sweeps.yaml", {
        "budget_s": 300, "reserve_s": 5, "step_s": 0.02, "start_s": 5, "parallel": 1,
        "phases": [{"name": "only", "ends_before_s": 0, "jobs": [
            {"name": "s", "lane": "a", "sweep": {"grid": {"preset": "toy", "device": "cpu", "cache": "dynamic",
                                                          **TINY, "new": 4}}}]}]})
    out = tmp_path / "out"
    for call in range(2):
        result = kvlab_plan(plan, "--out", out)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        if call == 0:
            first = pd.read_csv(out / "results.csv")
    assert "1 of 1 points already in" in result.stdout
    assert sorted(path.name for path in out.iterdir()) == sorted(
        ["env.txt", "provenance.json", "results.csv", "run.log", "summary.md", "sweep.tar.gz"])
    again = pd.read_csv(out / "results.csv")
    assert len(first) == 1 and (first["status"] == "ok").all()
    assert again[["point_id", "started_at"]].equals(first[["point_id", "started_at"]])
    with tarfile.open(out / "sweep.tar.gz") as archive:
        notebooks = [name for name in archive.getnames() if name.endswith(".ipynb")]
    assert len(notebooks) == 1


@pytest.mark.slow
def test_a_job_running_past_its_phase_deadline_is_killed_with_its_processes(tmp_path):
    # The estimate (a tiny step time) lets the job start; the decode is far longer than the phase.
    plan = write_plan(tmp_path / "late.yaml", {
        "budget_s": 20, "reserve_s": 0, "step_s": 0.00001, "start_s": 0, "parallel": 1,
        "point": {"preset": "toy", "device": "cpu", "batch": 1, "prompt": 4, "timing": False, "force": True},
        "phases": [{"name": "only", "ends_before_s": 0, "jobs": [
            {"name": "late", "lane": "a", "points": [{"cache": "dynamic", "new": 200000}]}]}]})
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    result = kvlab_plan(plan, "--out", out, timeout=120, TMPDIR=str(work))  # the job's spec file goes there
    assert result.returncode == 0, result.stderr[-3000:]
    assert "KILLED late" in (out / "summary.md").read_text()
    assert "START late" in (out / "run.log").read_text()
    assert not (out / "results.csv").exists()  # no row for a point that never ended
    workers = [p for p in psutil.process_iter(["cmdline"]) if str(work) in " ".join(p.info["cmdline"] or [])]
    assert workers == []


@pytest.mark.slow
def test_the_shipped_plan_dry_run_through_the_script(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), OMP_NUM_THREADS="1", PYTHON=sys.executable)
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--only", "a-emu-llama2-7b"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = pd.read_csv(out / "results.csv")
    assert list(rows["status"]) == ["ok"] and list(rows["cache"]) == ["tuple"] and list(rows["preset"]) == ["toy"]
    assert "H200, DESIGN §2" in (out / "summary.md").read_text()


@pytest.mark.parametrize("grid", [
    {"preset": "llama2-7b", "batch": 24, "new": 200, "force": True},  # the shipped plan's c-sweep
    {"preset": "toy", "overrides": "", "cache": ["dynamic", "prealloc"], "device": "cpu"},  # a dry run's stand-in
])
def test_a_sweep_jobs_points_are_what_its_command_runs(tmp_path, grid):
    """The points the plan estimates and validates for a sweep job are the ones `python -m kvlab sweep`
    lists for the command the plan starts (its own --dry-run, a separate process, is the witness)."""
    from kvlab.plan import sweep_command, sweep_points
    from kvlab.lab.grid import point_id, validate
    sweep = tmp_path / "mine.yaml"
    sweep.write_text(yaml.safe_dump({"fixed": {"overrides": "num_hidden_layers=1", "device": "meta", "prompt": 8},
                                     "grid": {"design": [{"cache": "tuple", "loop": "v4.40"},
                                                         {"cache": "dynamic", "loop": "v5"}], "batch": [1, 2]}}))
    job = {"name": "s", "lane": "s", "point": {}, "sweep": {"file": str(sweep), "grid": grid}}
    command = sweep_command(job, tmp_path / "out")
    listed = subprocess.run([*command, "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr[-2000:]
    ids = [line.split()[0] for line in listed.stdout.splitlines()[:-1]]
    assert sorted(point_id(p) for p in validate(sweep_points(job))) == sorted(ids)
