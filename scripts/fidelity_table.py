"""kvlab's loops against the real releases' own generate(), one table (the figures tests/test_reference.py checks).

    python scripts/fidelity_table.py            # toy MHA/GQA, fp32/bf16, greedy/beam(3), batch 2, prompt 16, 32 new

Each release runs in its own subprocess (kvlab.lab.reference); kvlab's loop runs here; both measured by the
CPU allocator. Prints a Markdown table of overhead bytes and kvlab / real.
"""

import torch

from kvlab.lab.point import run_point
from kvlab.releases import INSTALLED, install_reference, measure_references

SIZE = dict(batch=2, prompt=16, new=32)
CONFIGS = {"MHA": "", "GQA": "num_key_value_heads=2"}
PAIRS = {
    "4.40.1": ("4.40.1", None, "tuple", "v4.40"),
    "4.42.4": ("4.42.4", None, "dynamic", "v4.42"),
    "5.x DynamicCache": (INSTALLED, None, "dynamic", "v5"),
    "5.x StaticCache": (INSTALLED, "static", "static", "v5"),
}
POINTS = [
    (dtype, config, strategy)
    for dtype in ("float32", "bfloat16")
    for config in CONFIGS
    for strategy in ("greedy", "beam")
]


def main():
    torch.set_num_threads(1)
    print("| release | dtype | config | strategy | real generate() | kvlab cache / loop | kvlab / real |")
    print("|---|---|---|---|---:|---:|---:|")
    for name, (version, implementation, cache, loop) in PAIRS.items():
        install_reference(version)
        real = measure_references(
            version,
            [
                dict(SIZE, dtype=d, overrides=CONFIGS[c], strategy=s, num_beams=3, cache_implementation=implementation)
                for d, c, s in POINTS
            ],
        )
        for (dtype, config, strategy), record in zip(POINTS, real):
            ours = run_point(
                preset="toy",
                overrides=CONFIGS[config],
                dtype=dtype,
                cache=cache,
                loop=loop,
                strategy=strategy,
                num_beams=3,
                timing=False,
                **SIZE,
            )
            print(
                f"| {name} ({record['transformers_version']}) | {dtype} | {config} | {strategy} | "
                f"{record['overhead_bytes']:,} | {ours['overhead_bytes']:,} ({cache} / {loop}) | "
                f"{ours['overhead_bytes'] / record['overhead_bytes']:.4f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
