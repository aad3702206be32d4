"""Tuple caches at a graph's boundary: what converting costs, and how fast each runtime decodes.

    python benchmarks/graphs.py [--preset llama2-7b-twin] [--batch 4] [--prompt 100] [--new 100] [--repeats 3]

1. Conversion (kvlab.graphs.conversion): tuples -> DynamicCache copies the whole cache in transformers 5.x
   (peak = one more cache, counted by the live-storage meter), cache -> tuples returns views; seconds per
   GiB, median of 5, at three cache sizes.
2. Speed: every variant of appendix A9 (kvlab.graphs.VARIANTS) decodes the same point, interleaved
   `--repeats` times, no meter running; the table prints median tokens/s and the ratio to eager dynamic.
"""

import argparse

import torch

from kvlab.graphs import VARIANTS, time_variants
from kvlab.graphs.conversion import conversion_table
from kvlab.planner.sources import build_model  # any preset (the catalogue's too), a config.json or a hub id


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1].strip())
    parser.add_argument("--preset", default="llama2-7b-twin")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--new", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes-mib", default="16,64,256")
    args = parser.parse_args()

    print("cache MiB  tuples->cache s/GiB  peak/cache  copies | cache->tuples us  peak  views")
    for row in conversion_table(tuple(int(s) for s in args.sizes_mib.split(","))):
        print(
            f"{row['cache_bytes'] / 2**20:9.0f}  {row['to_cache_seconds_per_gib']:19.3f}  "
            f"{row['to_cache_peak_bytes'] / row['cache_bytes']:10.3f}  {str(row['to_cache_copies']):6s} | "
            f"{row['to_tuples_seconds'] * 1e6:16.1f}  {row['to_tuples_peak_bytes']:4d}  {row['to_tuples_views']}"
        )

    model = build_model(args.preset)
    prompt = torch.randint(
        0, model.config.vocab_size, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0)
    )
    seconds = time_variants(model, prompt, args.new, repeats=args.repeats)
    base = seconds[VARIANTS[0]]
    print(
        f"\n{args.preset}, float32, cpu, batch {args.batch}, prompt {args.prompt}, {args.new} new; "
        f"median of {args.repeats}, interleaved"
    )
    print("runtime    cache     tokens/s  speed vs eager dynamic")
    for (runtime, cache), value in seconds.items():
        print(f"{runtime:10s} {cache:9s} {args.batch * args.new / value:8.1f}  {base / value:.2f}")


if __name__ == "__main__":
    main()
