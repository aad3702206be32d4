"""What a newcomer meets in the first hour: the Python API refuses what is not an integer, a notebook run that
fails destroys nothing, exit codes a script can trust, the command line from any folder, `make lab` as root.
"""

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvlab

ROOT = Path(__file__).resolve().parents[2]
KVLAB = [sys.executable, "-m", "kvlab"]
# One layer, batch 1, prompt 8, 4 new tokens: the cheapest point there is.
TINY = dict(preset="toy", overrides="num_hidden_layers=1", batch=1, prompt=8, new=4, device="cpu")


def grid(**changes) -> list[str]:
    return [item for key, value in {**TINY, **changes}.items() for item in ("--grid", f"{key}={value}")]


def run(command: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def project_status() -> str:
    return subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("batch", 2.7, "got 2.7 (float)"),
        ("batch", True, "got True (bool)"),
        ("batch", float("inf"), "got inf (float)"),
        ("batch", [1], "got [1] (list)"),
        ("prompt", "8", "got '8' (str)"),
        ("new", 0, "got 0"),
        ("batch", 2**40, "batch must be at most 16,777,216"),
    ],
)
def test_predict_refuses_what_is_not_a_size_naming_the_value(key, value, named):
    with pytest.raises(ValueError, match="^" + key) as refused:
        kvlab.predict("toy", **{key: value})
    assert named in str(refused.value) and "\n" not in str(refused.value)


def test_a_huge_generation_is_answered_at_once_not_walked():
    """10 million new tokens with the largest batch asked for: refused in one line, before any walk."""
    clock = time.perf_counter()
    with pytest.raises(ValueError, match="new must be at most 65,536: kvlab walks every decoding step"):
        kvlab.predict("llama2-7b", new=10**7, memory="80GiB", max_batch=True)
    assert time.perf_counter() - clock < 60  # a refusal, not a walk (which ran for minutes)


def test_a_failed_notebook_run_in_place_leaves_the_notebook_byte_for_byte(tmp_path):
    notebook = tmp_path / "A1_experiment_point.ipynb"
    shutil.copy(ROOT / "notebooks" / notebook.name, notebook)
    before = hashlib.sha256(notebook.read_bytes()).hexdigest()
    result = run([sys.executable, "-m", "kvlab.notebook", "run", str(notebook), "-k", "nope"], tmp_path)
    assert result.returncode == 1 and "NoSuchKernel" in result.stderr, result.stderr[-2000:]
    assert hashlib.sha256(notebook.read_bytes()).hexdigest() == before
    assert sorted(path.name for path in tmp_path.iterdir()) == [notebook.name]  # no temporary copy left


@pytest.mark.slow
def test_a_successful_trial_run_exits_zero(tmp_path):
    executed = tmp_path / "trial.ipynb"
    parameters = [item for key in ("new", "prompt") for item in ("-p", key, "4")]
    result = run(
        [sys.executable, "-m", "kvlab.notebook", "run", str(ROOT / "notebooks" / "A1_experiment_point.ipynb"),
         *parameters, "-o", str(executed)],
        tmp_path,
    )  # fmt: skip
    assert result.returncode == 0 and f"{executed}: clean" in result.stdout, result.stdout + result.stderr[-2000:]


@pytest.mark.slow
def test_a_sweep_from_another_folder_writes_there_and_exits_by_its_points(tmp_path):
    before = project_status()
    ok = run([*KVLAB, "sweep", "--out", "relative", *grid(cache="tuple")], tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (tmp_path / "relative" / "results.csv").read_text().count(",ok,") == 1
    # A point whose cell cannot finish in a second: a failed row, and the sweep says so in its exit status.
    failed = run([*KVLAB, "sweep", "--out", "slow", "--point-timeout", "1", *grid(cache="dynamic", new=64)], tmp_path)
    assert failed.returncode == 1 and "1 of 1 points not ok (1 failed)" in failed.stderr, failed.stderr[-2000:]
    assert project_status() == before  # nothing written into the checkout


@pytest.mark.slow
def test_compare_from_another_folder_with_a_relative_out(tmp_path):
    before = project_status()
    sizes = ["--preset", "toy", "--batch", "1", "--prompt", "8", "--new", "4", "--device", "cpu"]
    result = run([*KVLAB, "compare", *sizes, "--out", "here"], tmp_path, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "here" / "compare.png").is_file() and (tmp_path / "here" / "results.csv").is_file()
    assert project_status() == before


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="Jupyter refuses root only; this checks the make target as root")
def test_make_lab_starts_as_root_on_loopback(tmp_path):
    log = tmp_path / "lab.log"
    with log.open("w") as handle:
        lab = subprocess.Popen(
            ["make", "lab", f"LAB_ARGS=--no-browser --port 0 --ServerApp.root_dir={tmp_path}"],
            cwd=ROOT,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # make and Jupyter under it end together
        )
    try:
        deadline = time.monotonic() + 120
        while "is running at" not in log.read_text() and lab.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        text = log.read_text()
        assert "is running at" in text and "http://127.0.0.1:" in text, text[-3000:]
    finally:
        os.killpg(lab.pid, signal.SIGTERM)
        lab.wait(timeout=60)
