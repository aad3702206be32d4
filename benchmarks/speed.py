"""Speed of the cache designs and of transformers' own generate(), side by side in one run.

    python benchmarks/speed.py [--preset llama2-7b-twin] [--new 500,2000,8000] [--repeats 3] [--out data/speed]

Machines are noisy: every length runs each contender in turn, `--repeats` times (`kvlab.timing.speed_runs`,
so a slow moment hits all alike), and the table prints medians, the slowest and fastest run, and the median of the
ratios to `dynamic` run by run. `--out DIR` keeps every run in DIR/results.csv and the machine in DIR/provenance.json
(appendix A2 draws them). No meter runs here: the live-storage counter adds Python work to every operator,
more for some designs.

Where prealloc's lead comes from: every step, attention reads the whole cache in every design (the
bytes read grow linearly with the length, quadratically over a run); `dynamic` (transformers'
`DynamicLayer`) also *copies* the whole cache with `torch.cat` every step, `prealloc` and `static`
write one token in place. So the lead grows with the length, bounded by how much of a step that copy
is; the reading, and the weights' matmuls, stay.
"""

import argparse
import datetime
import sys
from pathlib import Path

import pandas as pd
import torch

from kvlab.lab.store import append_run
from kvlab.models import resolve_device
from kvlab.planner.sources import build_model  # any preset (the catalogue's too), a config.json or a hub id
from kvlab.timing import CONTENDERS, speed_runs, spread


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
    parser.add_argument("--out", default="", help="folder for results.csv (every run) and provenance.json")
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc)
    device = resolve_device(args.device)
    model = build_model(args.preset, None, device, args.dtype)
    prompt = torch.randint(
        0, model.config.vocab_size, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0)
    ).to(device)
    contenders = args.contenders.split(",")
    threads = torch.get_num_threads()
    print(
        f"{args.preset} {args.dtype} on {device} ({threads} threads): batch {args.batch}, prompt {args.prompt}; "
        f"tokens/s of {args.repeats} interleaved runs: median [slowest, fastest]"
    )
    rows = []
    for new in [int(n) for n in args.new.split(",")]:
        runs = pd.DataFrame(speed_runs(model, prompt, [new], contenders, args.repeats))
        rows.append(runs)
        print(
            f"{new:6d} new: "
            + "; ".join(
                f"{c} {s['median']:.1f} [{s['slowest']:.1f}, {s['fastest']:.1f}] = {s['ratio_median']:.2f}x dynamic"
                for (_, c), s in spread(runs).iterrows()
            ),
            flush=True,
        )
    if args.out:
        table = pd.concat(rows).assign(
            preset=args.preset, dtype=args.dtype, device=device, batch=args.batch, prompt=args.prompt, threads=threads
        )
        Path(args.out).mkdir(parents=True, exist_ok=True)
        table.to_csv(Path(args.out) / "results.csv", index=False)
        append_run(
            args.out,
            "python benchmarks/speed.py " + " ".join(sys.argv[1:]),
            started,
            device,
            threads=threads,
            repeats=args.repeats,
        )
        print(f"wrote {args.out}/results.csv ({len(table)} runs) and {args.out}/provenance.json")


if __name__ == "__main__":
    main()
