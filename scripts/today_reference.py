"""kvlab's dynamic/v5 against the real installed 5.x generate() on one twin, same meter, and kvlab.theory's error.

python scripts/today_reference.py PRESET OVERRIDES PROMPT NEW DTYPES STRATEGIES, e.g.
python scripts/today_reference.py mistral-7b-v0.1-twin sliding_window=64 100 40 bfloat16,float32 greedy,beam
One JSON line per point: overhead bytes of both, kvlab / real, the theory's prediction and its error.
"""

import json
import sys

import torch

from kvlab.lab.point import run_point
from kvlab.releases import INSTALLED, measure_references

torch.set_num_threads(1)
preset, overrides, prompt, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
pts = [dict(dtype=d, strategy=s) for d in sys.argv[5].split(",") for s in sys.argv[6].split(",")]
common = dict(preset=preset, overrides=overrides, batch=1, prompt=prompt, new=new, device="cpu", num_beams=3)
refs = measure_references(INSTALLED, [dict(common, **p) for p in pts])
for p, ref in zip(pts, refs):
    mine = run_point(kind="kvlab", cache="dynamic", loop="v5", timing=False, **common, **p)
    same = mine.get("tokens") == ref["tokens"] if "tokens" in mine else None
    print(
        json.dumps(
            dict(
                preset=preset,
                overrides=overrides,
                prompt=prompt,
                new=new,
                **p,
                kvlab=mine["overhead_bytes"],
                real=ref["overhead_bytes"],
                ratio=round(mine["overhead_bytes"] / ref["overhead_bytes"], 4),
                theory=mine.get("predicted_overhead_bytes"),
                theory_err=mine.get("prediction_error"),
                kv_final=ref["kv_final_bytes"],
            )
        ),
        flush=True,
    )
