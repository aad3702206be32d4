"""Gather the CPU sweeps (results/cpu-*/) into data/cpu/, with their provenance: python scripts/gather_cpu_data.py"""

import json
import shutil
from pathlib import Path

import pandas as pd

from kvlab.lab.store import rebuild

root = Path(__file__).resolve().parent.parent
sweeps = [
    s
    for s in ("cpu-default", "cpu-pr-shape", "cpu-prompt", "cpu-new-tokens", "cpu-batch")
    if (root / "results" / s / "results.csv").exists()
]
frames, runs = [], {}
for s in sweeps:
    d = pd.read_csv(root / "results" / s / "results.csv")
    frames.append(d[d["status"] == "ok"])
    runs[s] = json.loads((root / "results" / s / "provenance.json").read_text())["runs"]
table = pd.concat(frames).drop_duplicates("point_id")
out = root / "data" / "cpu"
# The records are the store's truth: each ok point's record is copied, and the table remade from them.
shutil.rmtree(out / "records", ignore_errors=True)
(out / "records").mkdir(parents=True)
(out / "results.csv").unlink(missing_ok=True)
for s in sweeps:
    for point in table["point_id"]:
        if (record := root / "results" / s / "records" / f"{point}.json").exists():
            shutil.copy(record, out / "records" / record.name)
rebuild(out / "results.csv")
prov = {
    "results": "results.csv",
    "what": "the CPU sweeps "
    + ", ".join(sweeps)
    + " (kvlab/lab/sweeps/): the Llama-2-7B twin in bf16, one fresh papermill kernel per point running "
    "notebooks/A1_experiment_point.ipynb, one OpenMP thread per kernel; overhead measured by the CPU allocator, "
    "tokens/s from a separate run without it (on a shared, busy 2-core machine: speeds are indicative, "
    "benchmarks/speed.py compares them side by side)",
    "reproduce": [f"python -m kvlab sweep {s} --out results/{s}" for s in sweeps]
    + ["python scripts/gather_cpu_data.py  # the ok records of each results/<sweep>/ into data/cpu/, the table remade"],
    "points": len(table),
    "runs": runs,
}
(out / "provenance.json").write_text(json.dumps(prov, indent=1))
print(len(table), "rows from", sweeps)
print(table.groupby(["new", "prompt", "batch"]).size())
