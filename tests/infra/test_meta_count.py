"""Counting on the meta device allocates nothing real: a point of hundreds of terabytes, counted here."""

import json
import os
import subprocess
import sys

import psutil

GIB = 2**30

# Runs `python -m kvlab measure ... --json` in this process, then prints its peak resident memory in bytes: VmHWM, this
# program's own (ru_maxrss also counts the pages of the pytest worker that forked it: 1.38 GiB once, 0.34 alone).
MEASURE_THEN_RSS = r"""
import re, runpy, sys
sys.argv = ["python -m kvlab", *sys.argv[1:]]
runpy.run_module("kvlab", run_name="__main__", alter_sys=True)
print(int(re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024)
"""


def test_a_point_far_beyond_host_memory_is_counted_with_a_small_host_peak():
    """Llama-2-7B in fp32, batch 100,000, prompt 4,096: a 400,000 GiB KV cache, a 475,000 GiB peak.
    Its prompt alone, drawn on the CPU, would be 3.05 GiB of token ids."""
    point = [
        "measure",
        "--preset",
        "llama2-7b",
        "--batch",
        "100000",
        "--prompt",
        "4096",
        "--new",
        "2",
        "--device",
        "meta",
        "--json",
    ]
    result = subprocess.run(
        [sys.executable, "-c", MEASURE_THEN_RSS, *point],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stderr
    *_, line, host_peak = result.stdout.strip().splitlines()
    record = json.loads(line)
    kv_bytes_per_token = 2 * 32 * 4096 * 4  # K and V, 32 layers, 4096 wide, fp32: 1 MiB per token of a row
    assert record["kv_final_bytes"] == kv_bytes_per_token * 100_000 * (4096 + 2)
    assert record["peak_bytes"] > 1000 * psutil.virtual_memory().total  # far beyond this machine
    assert record["peak_bytes"] / GIB > 475_000
    assert int(host_peak) < GIB, f"host peak {int(host_peak) / GIB:.2f} GiB"
