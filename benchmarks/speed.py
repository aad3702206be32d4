"""Speed of the cache designs and of transformers' own generate(), side by side in one run.

    python benchmarks/speed.py [--preset llama2-7b-twin] [--new 500,2000,8000] [--repeats 3]

Machines are noisy: every length runs each contender in turn, `--repeats` times (`kvlab.lab.timing.interleaved`,
so a slow moment hits all alike), and the table prints medians and their ratio to `dynamic`. No meter
runs here: the live-storage counter adds Python work to every operator, more for some designs.

Where prealloc's lead comes from: every step, attention reads the whole cache in every design (the
bytes read grow linearly with the length, quadratically over a run); `dynamic` (transformers'
`DynamicLayer`) also *copies* the whole cache with `torch.cat` every step, `prealloc` and `static`
write one token in place. So the lead grows with the length, bounded by how much of a step that copy
is; the reading, and the weights' matmuls, stay.
"""

import argparse
import statistics

import torch

from kvlab.loops import generate
from kvlab.models import build_model, resolve_device
from kvlab.lab.timing import interleaved

CONTENDERS = ("dynamic", "prealloc", "static", "transformers")


def run(model, prompt, new, contender) -> float:
    """Seconds to decode `new` tokens (the prompt's forward included, as generate() times it)."""
    if contender != "transformers":
        return generate(model, prompt, new, cache=contender, loop="v5").seconds
    import time
    start = time.perf_counter()
    model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                   do_sample=False)
    if prompt.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama2-7b-twin")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=300)
    parser.add_argument("--new", default="500,2000,8000", help="comma-separated lengths")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    args = parser.parse_args()
    device = resolve_device(args.device)
    model = build_model(args.preset, None, device, args.dtype)
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt),
                           generator=torch.Generator().manual_seed(0)).to(device)
    contenders = args.contenders.split(",")
    print(f"{args.preset} {args.dtype} on {device} ({torch.get_num_threads()} threads): batch {args.batch}, "
          f"prompt {args.prompt}; median tokens/s of {args.repeats} interleaved runs")
    print(f"{'new':>6s} " + " ".join(f"{c:>13s}" for c in contenders) + "   " +
          " ".join(f"{c + '/dyn':>15s}" for c in contenders if c != "dynamic"))
    for new in [int(n) for n in args.new.split(",")]:
        seconds = interleaved({c: (lambda c=c: run(model, prompt, new, c)) for c in contenders}, args.repeats,
                              warmup={c: (lambda c=c: run(model, prompt, 4, c)) for c in contenders})
        speeds = {c: [args.batch * new / s for s in v] for c, v in seconds.items()}
        median = {c: statistics.median(v) for c, v in speeds.items()}
        print(f"{new:6d} " + " ".join(f"{median[c]:13.1f}" for c in contenders) + "   " +
              " ".join(f"{median[c] / median['dynamic']:14.2f}x" for c in contenders if c != "dynamic"), flush=True)


if __name__ == "__main__":
    main()
