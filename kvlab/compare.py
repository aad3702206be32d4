"""The main job: legacy vs every in-place cache design on the default device.

CPU: the `toy` preset in fp32 with the cache dominating (batch 8, prompt 64, 512 new tokens).
CUDA: `tinyllama-1.1b` in bf16 at the PR's benchmark shape (batch 8, prompt 300, 500 new tokens).
"""

from __future__ import annotations

import datetime
import gc
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from .experiment import normalize, run_point
from .models import build_model, default_device

# (cache, pattern): the <= 4.41 baseline, its two fixes taken one at a time, then every design.
COMPARISON = [("legacy", "legacy"), ("legacy", "fixed"), ("inplace", "legacy"),
              ("list", "fixed"), ("inplace", "fixed"), ("static", "fixed"), ("prealloc", "fixed")]

CPU_POINT = dict(preset="toy", dtype="float32", batch=8, prompt=64, new=512)
CUDA_POINT = dict(preset="tinyllama-1.1b", dtype="bfloat16", batch=8, prompt=300, new=500)

MIB = 2**20


def comparison_table(records: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(records)
    table = pd.DataFrame({
        "cache": df["cache"], "pattern": df["pattern"],
        "overhead_MiB": (df["overhead_bytes"] / MIB).round(2),
        "overhead/KV": df["overhead_over_kv"].round(3),
        "predicted_MiB": (df["predicted_overhead_bytes"] / MIB).round(2),
        "error_%": (100 * df["prediction_error"]).round(2),
        "tokens/s": df["tokens_per_s"].round(1),
    })
    return table


def run_compare(device="auto", preset=None, out=None, **sizes) -> pd.DataFrame:
    device = default_device() if device in (None, "auto") else device
    point = dict(CPU_POINT if device == "cpu" else CUDA_POINT, device=device)
    if preset:
        point["preset"] = preset
    point.update({k: v for k, v in sizes.items() if v is not None})
    normalize(**point)  # every bad input fails here, before the model is built
    out = Path(out or f"results/compare-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)

    model = build_model(point["preset"], None, device, point["dtype"])
    records = []
    for cache, pattern in tqdm(COMPARISON, desc=f"{point['preset']} on {device}", unit="point"):
        records.append(run_point(model, cache=cache, pattern=pattern, **point))
        gc.collect()
    csv_path = out / "compare.csv"
    pd.DataFrame(records).to_csv(csv_path, index=False)

    from .plots import compare_figure
    figure_path = out / "compare.png"
    compare_figure(pd.DataFrame(records)).savefig(figure_path, dpi=120, bbox_inches="tight")

    table = comparison_table(records)
    first = records[0]
    print(f"\n{first['preset']} on {first['device_name']} ({device}, {first['dtype']}), batch {first['batch']}, "
          f"prompt {first['prompt']}, {first['new']} new tokens, greedy; KV = {first['kv_final_bytes'] / MIB:.1f} MiB")
    print(table.to_string(index=False))
    legacy = records[0]["overhead_bytes"]
    best = min(r["overhead_bytes"] for r in records[1:])
    print(f"\nlegacy / best in-place overhead: {legacy / best:.2f}x")
    print(f"wrote {csv_path}\nwrote {figure_path}")
    return table
