"""The real releases where they differ most from each other, beside kvlab's loops: data/reference/results.csv.

    python scripts/reference_points.py      # kvlab.lab.reference.SHOWCASE, each point by kvlab and by the release

Each point of SHOWCASE runs twice, kind kvlab and kind reference (the release's own generate() in its own
process), both measured by the CPU allocator; one row per run, with the point's name. The run is logged in
data/reference/provenance.json. Prints what the rows show (kvlab.lab.reference.showcase_table) and the minimal
improvement factor measured by both beside kvlab.theory's.
"""

import datetime
from pathlib import Path

import pandas as pd
import torch

from kvlab import theory
from kvlab.configs import build_config
from kvlab.lab.point import run_point
from kvlab.lab.reference import SHOWCASE, SHOWCASE_COMMON, showcase_table
from kvlab.lab.store import append_run

OUT = Path(__file__).resolve().parent.parent / "data" / "reference"


def main():
    torch.set_num_threads(1)
    started = datetime.datetime.now(datetime.timezone.utc)
    rows = [
        dict(name=name, **run_point(kind=kind, **SHOWCASE_COMMON, **point))
        for name, point in SHOWCASE.items()
        for kind in ("kvlab", "reference")
    ]
    table = pd.DataFrame(rows)
    table.to_csv(OUT / "results.csv", index=False)
    append_run(
        OUT,
        "python scripts/reference_points.py",
        started,
        "cpu",
        points=len(SHOWCASE),
        what="kvlab.lab.reference.SHOWCASE: each point by kvlab's loop (kind kvlab) and by the release's own "
        "generate() (kind reference), the CPU allocator, one thread",
    )
    print(showcase_table(table).to_string())
    overhead = table.set_index(["name", "kind"])["overhead_bytes"]
    point = SHOWCASE["minimal-after"]
    theory_factor = theory.improvement_factors(
        build_config(point["preset"]),
        batch=SHOWCASE_COMMON["batch"],
        prompt=point["prompt"],
        dtype=SHOWCASE_COMMON["dtype"],
    )[0]
    for kind in ("kvlab", "reference"):
        print(
            f"minimal improvement ({kind}) = {overhead['minimal-before', kind] / overhead['minimal-after', kind]:.4f}"
            f" (kvlab.theory: {theory_factor:.4f})"
        )


if __name__ == "__main__":
    main()
