"""gpu/h200_run.sh in its CPU dry-run mode, and the wheelhouse lock it installs from.

The dry run is the same script the H200 runs (same orchestrator, lanes, deadlines and outputs), on
the `toy` preset with tiny sizes; here only a small part of its plan runs (ONLY=...), so the test
takes tens of seconds, not minutes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "gpu" / "h200_run.sh"
LOCK = ROOT / "scripts" / "wheelhouse.lock"
REQUIREMENTS = ROOT / "requirements.lock"

# the 33 wheels that make papermill run on the GPU machine (shared/DESIGN.md section 5)
KERNEL_STACK = """asttokens comm debugpy entrypoints executing fastjsonschema ipykernel ipython ipython-pygments-lexers
jedi jsonschema jsonschema-specifications jupyter-client jupyter-core matplotlib-inline nbclient nbformat
nest-asyncio2 papermill parso pexpect platformdirs prompt-toolkit ptyprocess pure-eval pyzmq referencing
rpds-py stack-data tenacity tornado traitlets wcwidth""".split()
LEGACY = {"transformers": "4.40.1", "tokenizers": "0.19.1", "huggingface_hub": "0.23.4"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def read_lock(path: Path) -> dict[str, list[tuple[str, str]]]:
    """{section: [(normalized name, version), ...]} of a `[section]` + `name==version` file."""
    sections, current = {}, None
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        if line.startswith("["):
            current = line.strip("[]")
            sections[current] = []
            continue
        assert current is not None, f"{path}: pin {line!r} before any [section]"
        name, sep, version = line.partition("==")
        assert sep and name and version, f"{path}: {line!r} is not name==version"
        sections[current].append((norm(name), version))
    return sections


def test_wheelhouse_lock_pins_exactly_one_version_of_each_package():
    sections = read_lock(LOCK)
    assert set(sections) == {"kernel", "legacy"}
    everything = [name for pins in sections.values() for name, _ in pins]
    assert len(everything) == len(set(everything)), "a package is pinned twice"
    kernel = dict(sections["kernel"])
    assert sorted(kernel) == sorted(norm(name) for name in KERNEL_STACK)
    assert dict(sections["legacy"]) == LEGACY
    # the lock agrees with requirements.lock wherever the same package appears there
    required = {}
    for line in REQUIREMENTS.read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and not name.startswith("#"):
            required[norm(name)] = version
    for name, version in kernel.items():
        assert required.get(name, version) == version, f"{name}: lock {version}, requirements.lock {required[name]}"


@pytest.mark.slow
def test_dry_run_writes_the_expected_files(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), DRY_RUN="1", PYTHON=sys.executable, BUDGET_S="240",
               ONLY="a-emu-legacy-llama2-7b,c-sweep,d", SPEED_MAX_NEW="8", TMPDIR=str(tmp_path),
               SWEEP_ARGS="--grid preset=toy --grid cache=dynamic --grid device=cpu --grid dtype=float32 "
                          "--grid batch=1 --grid prompt=4 --grid new=2")
    result = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    files = sorted(path.name for path in out.iterdir())
    assert files == ["env.txt", "records.csv", "records.jsonl", "run.log", "summary.md", "sweep.tar.gz",
                     "sweep_results.csv"]
    assert len(files) <= 8 and all(path.is_file() for path in out.iterdir())  # what the device tool brings back

    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert all(r["status"] == "ok" for r in records), records
    steps = {(r["step"], r["cache"]) for r in records if not r.get("warmup")}
    assert ("a", "tuple") in steps and ("c", "dynamic") in steps
    assert {("d", "dynamic"), ("d", "prealloc")} <= steps
    assert all(r["transformers_version"] for r in records if r["step"] != "c")

    summary = (out / "summary.md").read_text()
    assert "## (d) prealloc vs dynamic" in summary and "prealloc / dynamic tokens/s" in summary
    log = (out / "run.log").read_text()
    assert "SKIPPED a-ref-4.40.1-llama2-7b" not in log  # ONLY leaves it out of the plan, not skipped for time
    assert "finished in" in log
    import tarfile
    with tarfile.open(out / "sweep.tar.gz") as archive:
        names = archive.getnames()
    assert any(name.startswith("sweep/notebooks/") and name.endswith(".ipynb") for name in names)
    assert "sweep/results.csv" in names


def test_dry_run_needs_out(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    result = subprocess.run(["bash", str(SCRIPT), "--cpu"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "set OUT" in result.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: the real run would start")
def test_gpu_mode_refuses_to_install_without_a_gpu(tmp_path):
    marker = ROOT / ".legacy-tf" / "transformers-4.40.1.dist-info"
    before = marker.exists() and marker.stat().st_mtime
    env = dict(os.environ, OUT=str(tmp_path / "out"), SITE=str(tmp_path / "site"))
    env.pop("DRY_RUN", None)
    result = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "FATAL: no NVIDIA GPU" in result.stdout
    assert not (tmp_path / "site").exists()
    assert (marker.exists() and marker.stat().st_mtime) == before
