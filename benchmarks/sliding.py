"""`prealloc` beside `dynamic` on sliding-window layers, peak and speed in one run.

    python benchmarks/sliding.py [--preset mistral-7b-twin] [--window 128] [--prompt 256] [--new 384] [--repeats 3]

The preset gets `sliding_window=--window` on every layer (Mistral-7B-v0.1's layout; its own window is 4096). On
it `dynamic` is transformers' `DynamicSlidingWindowLayer`: each step cats the window and the new token into a
new tensor, and after a prompt longer than the window it keeps a view of the whole prompt's keys and values
until the first decode step. `prealloc` (kvlab's `WindowLayer`) writes each token in place into W - 1 + a
block of slots and moves the window to the front once a block.

Peak: one run of each under the live-storage meter (overhead = peak above the weights; KV = the cache at the
end). Tokens/s: unmetered runs, interleaved (`kvlab.timing.interleaved`), median of `--repeats`.
"""

import argparse
import statistics

import torch

import kvlab.designs  # noqa: F401 (registers kvlab's own designs, list and prealloc, with make_cache)
from kvlab.caches import cache_bytes
from kvlab.loops import generate
from kvlab.meter import MemoryMeter
from kvlab.models import resolve_device
from kvlab.planner.sources import build_model  # any preset (the catalogue's too), a config.json or a hub id
from kvlab.timing import interleaved

CONTENDERS = ("dynamic", "prealloc")
MIB = 2**20


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mistral-7b-twin")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = resolve_device(args.device)
    model = build_model(args.preset, [f"sliding_window={args.window}"], device, args.dtype)
    prompt = torch.randint(
        0, model.config.vocab_size, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0)
    ).to(device)
    print(
        f"{args.preset} with sliding_window={args.window}, {args.dtype} on {device} ({torch.get_num_threads()} "
        f"threads): batch {args.batch}, prompt {args.prompt}, {args.new} new tokens"
    )

    peaks, kv, tokens = {}, {}, {}
    for cache in CONTENDERS:
        with MemoryMeter(device, model) as meter:
            out = generate(model, prompt, args.new, cache=cache, meter=meter)
        peaks[cache], kv[cache], tokens[cache] = meter.report().overhead_bytes, cache_bytes(out.cache), out.tokens
    assert torch.equal(tokens["dynamic"], tokens["prealloc"]), "the two caches decoded different tokens"

    seconds = interleaved(
        {c: (lambda c=c: generate(model, prompt, args.new, cache=c).seconds) for c in CONTENDERS},
        args.repeats,
        warmup={c: (lambda c=c: generate(model, prompt, 4, cache=c)) for c in CONTENDERS},
    )
    speed = {c: statistics.median(args.batch * args.new / s for s in seconds[c]) for c in CONTENDERS}

    print(f"{'cache':>9s} {'overhead MiB':>13s} {'KV MiB':>8s} {'overhead/KV':>12s} {'tokens/s':>9s}  (runs)")
    for c in CONTENDERS:
        runs = " ".join(f"{args.batch * args.new / s:.1f}" for s in seconds[c])
        print(f"{c:>9s} {peaks[c] / MIB:13.3f} {kv[c] / MIB:8.3f} {peaks[c] / kv[c]:12.3f} {speed[c]:9.1f}  ({runs})")
    print(
        f"prealloc / dynamic: peak {peaks['prealloc'] / peaks['dynamic']:.3f}x, "
        f"tokens/s {speed['prealloc'] / speed['dynamic']:.2f}x"
    )


if __name__ == "__main__":
    main()
