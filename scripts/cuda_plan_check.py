"""The CUDA plan against a GPU: each point predicted for cuda (kvlab.predict, made before anything runs) and measured
by `python -m kvlab measure` in a fresh process (cuBLAS's workspace is then allocated inside the overhead, as the
plan counts it), one CSV row each. The points: the six families kvlab.theory walks (llama, mistral, qwen2, qwen3,
gemma3_text, gpt_oss) at batch 1, a 2048-token prompt and 8 new tokens (Gemma-3's sliding layers get a mask there:
cuDNN's float copy of it), and Llama-3-8B at a 4096-token prompt and 2048 new at the largest batch the plan fits in
40 GiB. Needs a CUDA GPU with about 60 GB free (GPT-OSS-20B's 39 GiB of weights); a few minutes on an H100.

    python scripts/cuda_plan_check.py OUT.csv [--gpu-arch hopper|other]
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys

import torch

import kvlab

FAMILIES = ("llama3-8b", "mistral-7b-v0.1", "qwen2.5-0.5b", "qwen3-8b", "gemma-3-4b", "gpt-oss-20b")
SHORT = dict(batch=1, prompt=2048, new=8)
LARGEST = dict(preset="llama3-8b", prompt=4096, new=2048, memory="40GiB")
COMMON = dict(cache="dynamic", loop="v5", dtype="bfloat16")
COLUMNS = (
    "preset",
    "model_type",
    "batch",
    "prompt",
    "new",
    "predicted_overhead_bytes",
    "measured_overhead_bytes",
    "error",
    "reserved_estimate_bytes",
    "measured_reserved_peak_bytes",
    "peak_at",
    "device_name",
)


def points(arch: str) -> list[dict]:
    """The six families' short points, then Llama-3-8B at the largest batch its plan fits in 40 GiB."""
    fit = kvlab.predict(
        LARGEST["preset"],
        device="cuda",
        arch=arch,
        memory=LARGEST["memory"],
        max_batch=True,
        prompt=LARGEST["prompt"],
        new=LARGEST["new"],
        **COMMON,
    )
    largest = dict(preset=LARGEST["preset"], batch=fit["designs"][0]["max_batch"], prompt=4096, new=2048)
    return [dict(preset=preset, **SHORT) for preset in FAMILIES] + [largest]


def measured(point: dict) -> dict:
    """kvlab measure's record of the point, in a fresh process."""
    options = [f"--{key}={value}" for key, value in {**point, **COMMON}.items()]
    command = [sys.executable, "-m", "kvlab", "measure", "--device", "cuda", "--no-timing", "--json", *options]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)


def row(point: dict, arch: str) -> dict:
    plan = kvlab.predict(
        point["preset"], device="cuda", arch=arch, **{k: v for k, v in point.items() if k != "preset"}, **COMMON
    )
    design, record = plan["designs"][0], measured(point)
    predicted, overhead = design["predicted_overhead_bytes"], record["overhead_bytes"]
    return dict(
        point,
        model_type=plan["model"]["model_type"],
        predicted_overhead_bytes=predicted,
        measured_overhead_bytes=overhead,
        error=round(predicted / overhead - 1, 4),
        reserved_estimate_bytes=design.get("reserved_estimate_bytes"),
        measured_reserved_peak_bytes=record["reserved_peak_bytes"] - record["baseline_bytes"],
        peak_at=design["peak_at"],
        device_name=record["device_name"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the CSV to write")
    parser.add_argument("--gpu-arch", default="hopper", help="the GPU's architecture as kvlab plans it")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("cuda_plan_check: no CUDA GPU here; the plan alone needs none: python -m kvlab predict --device cuda")
    with open(args.out, "w", newline="") as out:
        writer = csv.DictWriter(out, COLUMNS)
        writer.writeheader()
        for point in points(args.gpu_arch):
            writer.writerow(row(point, args.gpu_arch))
            out.flush()


if __name__ == "__main__":
    main()
