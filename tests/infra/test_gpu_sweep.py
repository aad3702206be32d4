"""The GPU reproduction: the shipped sweep `h200`, its dry run on this CPU, and gpu/run.sh (install + one call).

The dry run is the ordinary sweep with toy stand-ins given as --grid items: every point of the GPU sweep at a
tiny size, the real releases' own generate() included, through papermill, ending in summary.md.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import transformers

from kvlab.lab.grid import expand, load_sweep, read_sweep, validate
from kvlab.schema import DESIGNS, REFERENCES

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "gpu" / "run.sh"
STAND_INS = ["preset=toy", "device=cpu", "dtype=float32", "batch=2", "prompt=16", "new=8"]


def test_the_shipped_sweep_covers_every_design_and_the_measured_h200_points():
    points = validate(expand(*load_sweep("h200")), devices_here=False)  # CUDA is absent here
    assert {(p["device"], p["dtype"], p["batch"], p["prompt"], p["new"], p["strategy"]) for p in points} == {
        ("cuda", "bfloat16", 8, 300, 500, "greedy")
    }
    for preset in ("llama2-7b", "mistral-7b"):
        ours = [p for p in points if p["preset"] == preset]
        assert {(p["cache"], p["loop"]) for p in ours if p["kind"] == "kvlab"} == set(DESIGNS)
        references = {(p["cache"], p["loop"]) for p in ours if p["kind"] == "reference"}
        assert {REFERENCES[design][0] for design in references} == {"4.40.1", "installed"}  # the wheelhouse's releases
    # every point of the H200 figures (measured with transformers' own generate()) is a reference point here
    measured = pd.read_csv(ROOT / "data" / "design" / "h200.csv")
    wanted = {(r.preset, r.cache, r.loop, r.batch, r.prompt, r.new, r.dtype) for r in measured.itertuples()}
    assert wanted == {
        (p["preset"], p["cache"], p["loop"], p["batch"], p["prompt"], p["new"], p["dtype"])
        for p in points
        if p["kind"] == "reference"
    }
    assert read_sweep("h200")["point_timeout_s"] > 0


def test_the_h200_figures_agree_with_their_sizes():
    table = pd.read_csv(ROOT / "data" / "design" / "h200.csv")
    assert (ROOT / "data" / "design" / "provenance.json").exists()
    assert ((table["overhead_gib"] / table["kv_final_gib"] / table["overhead_over_kv"] - 1).abs() < 0.005).all()


@pytest.mark.slow
def test_dry_run_on_cpu_with_toy_stand_ins(tmp_path):
    """Every point ok; each release's own generate() within 1 % of kvlab's loop for its design; the summary
    has the comparison table with each reference row right under its kvlab twin."""
    out = tmp_path / "dry"
    grid = [arg for item in STAND_INS for arg in ("--grid", item)]
    result = subprocess.run(
        [sys.executable, "-m", "kvlab", "sweep", "h200", *grid, "--out", str(out)],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = pd.read_csv(out / "results.csv")
    assert (rows["status"] == "ok").all(), rows[["cache", "loop", "kind", "error"]]
    assert set(rows["preset"]) == {"toy"} and set(rows["device"]) == {"cpu"}
    kvlab = rows[rows["kind"] == "kvlab"].set_index(["cache", "loop"])
    assert sorted(kvlab.index) == sorted(DESIGNS)  # every design once
    references = rows[rows["kind"] == "reference"]
    shipped = validate(expand(*load_sweep("h200")), devices_here=False)
    assert sorted(zip(references["cache"], references["loop"])) == sorted(
        (p["cache"], p["loop"]) for p in shipped if p["kind"] == "reference" and p["preset"] == "llama2-7b"
    )
    for ref in references.itertuples():
        version = REFERENCES[(ref.cache, ref.loop)][0]
        assert ref.transformers_version == (transformers.__version__ if version == "installed" else version)
        twin = kvlab.loc[(ref.cache, ref.loop), "overhead_bytes"]
        assert abs(ref.overhead_bytes / twin - 1) < 0.01, (ref.cache, ref.loop, ref.overhead_bytes, twin)

    lines = (out / "summary.md").read_text().splitlines()
    assert f"{len(rows)} points: {len(rows)} ok." in lines  # the summary counts what results.csv holds
    table = [line for line in lines if line.startswith("| ")]
    assert table[0].startswith("| cache | loop | generate() | overhead_MiB | overhead/KV |")
    for ref in references.itertuples():
        [at] = [i for i, line in enumerate(table) if line.startswith(f"| {ref.cache} | {ref.loop} | transformers ")]
        assert table[at - 1].startswith(f"| {ref.cache} | {ref.loop} | kvlab |")


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: the real run would start")
def test_run_sh_refuses_without_a_gpu_or_out_and_installs_nothing(tmp_path):
    marker = ROOT / ".legacy-tf" / "transformers-4.40.1.dist-info"
    before = marker.exists() and marker.stat().st_mtime
    env = dict(os.environ, OUT=str(tmp_path / "out"), SITE=str(tmp_path / "site"))
    result = subprocess.run(["bash", str(RUN)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "no NVIDIA GPU" in result.stderr
    assert not (tmp_path / "site").exists() and not (tmp_path / "out").exists()
    assert (marker.exists() and marker.stat().st_mtime) == before
    env.pop("OUT")
    result = subprocess.run(["bash", str(RUN)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.strip() == "run.sh: set OUT to the folder that receives the results"


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


def test_the_wheelhouse_pins_agree_with_the_lock_and_the_reference():
    from packaging.utils import canonicalize_name

    from kvlab.releases import RELEASES

    kernel = pins(ROOT / "scripts" / "wheelhouse-kernel.txt")
    assert {"papermill", "ipykernel", "nbclient", "jupyter-client"} <= set(kernel)
    legacy = pins(ROOT / "scripts" / "wheelhouse-legacy.txt")
    assert legacy == dict(pin.split("==") for pin in RELEASES["4.40.1"][1])  # what kvlab.lab.reference installs
    locked = {
        canonicalize_name(line.split("==")[0]): line.split("==")[1].strip()
        for line in (ROOT / "requirements.lock").read_text().splitlines()
        if "==" in line and line[0] != "#"
    }
    for name, version in kernel.items():
        assert locked.get(name) == version, f"{name}: {version} in the wheelhouse, {locked.get(name)} in the lock"
