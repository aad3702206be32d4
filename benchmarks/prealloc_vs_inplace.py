"""Speed of the cache designs, side by side in one run (machines are noisy: compare ratios).

    python benchmarks/prealloc_vs_inplace.py [--new 2000] [--device auto] [--repeats 3]

`inplace` copies the whole layer at every step (quadratic bytes moved over a run); `prealloc`
writes the new token into its buffer and copies only when it grows by a block. No meter runs here:
the live-storage counter would add Python work to every operator.
"""

import argparse
import statistics

import torch

from kvlab.decode import generate
from kvlab.models import build_model, resolve_device


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="toy")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--caches", default="inplace,prealloc,list,static")
    args = parser.parse_args()
    device = resolve_device(args.device)
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    model = build_model(args.preset, None, device, dtype)
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt),
                           generator=torch.Generator().manual_seed(0)).to(device)
    caches = args.caches.split(",")
    speeds = {cache: [] for cache in caches}
    generate(model, prompt, 8, cache="inplace")  # warm-up
    for _ in range(args.repeats):  # interleaved, so drift in the machine hits every design alike
        for cache in caches:
            run = generate(model, prompt, args.new, cache=cache)
            speeds[cache].append(args.batch * args.new / run.seconds)
    base = statistics.median(speeds["inplace"])
    print(f"{args.preset} {dtype} on {device}: batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, "
          f"median of {args.repeats}")
    print(f"{'cache':10s} {'tokens/s':>10s} {'vs inplace':>11s}")
    for cache, values in speeds.items():
        median = statistics.median(values)
        print(f"{cache:10s} {median:10.1f} {median / base:10.2f}x")


if __name__ == "__main__":
    main()
