"""How fast predict's dry run answers, and how close the fast one (kvlab.planner.fast) is to the whole model's.

    python benchmarks/predict.py [--configs deepseek-v3,bamba-9b,gpt-oss-20b] [--designs list/v5,dynamic/v5]
        [--batch 1] [--prompt 32000] [--new 512] [--no-exact]

For each config (a name under benchmarks/configs/, a config.json path or a preset) and cache design, in one process:
the first fast call for the design (cold in the process; the config's first design also builds the model and its
cut), a second one (warm: every meta kernel's answer already known, kvlab.planner.meta.KnownShapes), one at a
point not asked before (fresh: the batch one more, its shapes new), and the whole model's dry run (`exact=True`,
the reference: tens of seconds a design on the large models; `--no-exact` leaves it out). The table gives the
times, both overheads (peak above the weights) and the fast one's error. A second table gives, per config, one
prediction of all its designs: at the point measured (warm) and at one not asked before (fresh: the batch two
more). benchmarks/configs/README.md says where each config's values come from.
"""

import argparse
import time
from pathlib import Path

from tqdm import tqdm

from kvlab.planner.plan import predict
from kvlab.presets import PRESETS
from kvlab.schema import DESIGNS

CONFIGS = Path(__file__).parent / "configs"
GIB = 2**30


def timed(preset: str, design: tuple[str, str], point: dict, exact: bool = False) -> tuple[float, int]:
    """(seconds, predicted overhead bytes) of one design's prediction."""
    start = time.perf_counter()
    (row,) = predict(preset, cache=design[0], loop=design[1], dry_run=True, exact=exact, **point)["designs"]
    return time.perf_counter() - start, row["predicted_overhead_bytes"]


def measure(preset: str, design: tuple[str, str], point: dict, exact: bool) -> dict:
    cold, fast = timed(preset, design, point)
    warm, again = timed(preset, design, point)
    assert again == fast, "the fast dry run answered two calls differently"
    fresh, _ = timed(preset, design, dict(point, batch=point["batch"] + 1))
    row = dict(design="/".join(design), cold_s=cold, warm_s=warm, fresh_s=fresh, fast_gib=fast / GIB)
    if exact:
        row["exact_s"], reference = timed(preset, design, point, exact=True)
        row |= dict(exact_gib=reference / GIB, error_pct=100 * (fast - reference) / reference)
    return row


def config_path(name: str) -> str:
    """A config named on the command line: a config.json path, a name under benchmarks/configs, or a preset."""
    if name.endswith(".json") or name in PRESETS:
        return name
    if not (CONFIGS / f"{name}.json").is_file():
        raise SystemExit(f"no config {name!r}: give a config.json path, one of benchmarks/configs or a preset")
    return str(CONFIGS / f"{name}.json")


def every_design(preset: str, point: dict) -> dict:
    """Seconds of one prediction of every design (`kvlab predict --dry-run` without --cache or --loop) at the point
    measured (warm) and at one not asked before (fresh)."""
    times = {}
    for name, at in (("all_warm_s", point), ("all_fresh_s", dict(point, batch=point["batch"] + 2))):
        start = time.perf_counter()
        designs = predict(preset, dry_run=True, **at)["designs"]
        times[name] = time.perf_counter() - start
    return dict(config=Path(preset).stem, designs=len(designs), **times)


def table(rows: list[dict]) -> str:
    columns = ["config", "design", "designs", "cold_s", "warm_s", "fresh_s", "exact_s", "exact_gib", "fast_gib"]
    columns = [c for c in [*columns, "error_pct", "all_warm_s", "all_fresh_s"] if any(c in row for row in rows)]
    cells = [columns] + [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))) for line in cells
    )


def _cell(value) -> str:
    if value is None:
        return "-"
    return (
        f"{value:.4f}"
        if isinstance(value, float) and abs(value) < 10
        else f"{value:.2f}"
        if isinstance(value, float)
        else str(value)
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = sorted(path.stem for path in CONFIGS.glob("*.json"))
    parser.add_argument(
        "--configs", default=",".join(names), help="names under benchmarks/configs, config.json paths or presets"
    )
    parser.add_argument("--designs", default=",".join(f"{c}/{loop}" for c, loop in DESIGNS), help="cache/loop,...")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=32000)
    parser.add_argument("--new", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-exact", action="store_true", help="leave out the whole model's dry run")
    args = parser.parse_args()
    point = dict(batch=args.batch, prompt=args.prompt, new=args.new, dtype=args.dtype)
    designs = [tuple(design.split("/")) for design in args.designs.split(",")]
    configs = [config_path(name) for name in args.configs.split(",")]
    print(f"batch {args.batch}, prompt {args.prompt}, {args.new} new, {args.dtype}; seconds per design, overhead GiB")
    rows, refused = [], []
    for preset, design in tqdm([(c, d) for c in configs for d in designs], desc="predict", unit="design"):
        try:
            rows.append(dict(config=Path(preset).stem, **measure(preset, design, point, not args.no_exact)))
            tqdm.write(str(rows[-1]))  # as each design ends: a long run interrupted keeps what it measured
        except ValueError as why:  # a design the model cannot hold (tuple beside recurrent layers)
            refused.append(f"{Path(preset).stem} {'/'.join(design)}: {why}")
    every = [every_design(preset, point) for preset in tqdm(configs, desc="all designs", unit="config")]
    print(table(rows), *refused, "", table(every), sep="\n")


if __name__ == "__main__":
    main()
