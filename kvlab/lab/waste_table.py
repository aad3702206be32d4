"""The stored tables of kvlab.waste (`python -m kvlab waste`): OUT/waste.csv, OUT/cache_growth.csv, each run
logged in OUT/provenance.json. Measuring is kvlab.waste's; writing, with its provenance, is the lab's."""

from __future__ import annotations

import datetime
from pathlib import Path

import torch

from .. import waste
from .store import append_run, prepare_folder

GROWTH = "growth"  # the name that writes the cache-growth table instead of points


def check_names(names) -> list[str]:
    """The points asked for (all of kvlab.waste.POINTS if none), or ["growth"] alone; refused before any run."""
    names = list(names or waste.POINTS)
    if GROWTH in names and names != [GROWTH]:
        raise ValueError(f"{GROWTH} writes its own table; run it alone, not with points")
    if unknown := [name for name in names if name not in (*waste.POINTS, GROWTH)]:
        raise ValueError(
            f"unknown waste point {', '.join(map(repr, unknown))}; choose from: "
            f"{', '.join(waste.POINTS)}, or {GROWTH} alone"
        )
    return names


def write_waste(names, out, command: str) -> None:
    """Measure the points `names` (or the cache growth) and store them in OUT; a point's rows replace its stored
    ones, the points kept in kvlab.waste.POINTS' order. `command` is what provenance.json logs for the run."""
    names = check_names(names)  # a bad name is said before a missing extra
    import pandas as pd

    torch.set_num_threads(1)  # as the stored tables were measured (their provenance.json: one thread)
    started = datetime.datetime.now(datetime.timezone.utc)
    out = Path(out)
    prepare_folder(out, folders=())  # a folder that cannot take the tables is refused before a point runs
    if names == [GROWTH]:
        waste.cache_growth(every=8).to_csv(out / "cache_growth.csv", index=False)
        append_run(
            out,
            command,
            started,
            "cpu",
            results_file="cache_growth.csv",
            what="kvlab.waste.cache_growth: the storage under transformers' own DynamicCache after every 8th "
            "forward of generate(), bf16, batch 1",
            **waste.GROWTH,
        )
        return
    path = out / "waste.csv"
    for name in names:
        rows = pd.DataFrame(waste.terms(name), columns=waste.COLUMNS)
        kept = pd.read_csv(path, keep_default_na=False) if path.exists() else pd.DataFrame(columns=waste.COLUMNS)
        table = pd.concat([kept[kept["point"] != name], rows])
        # the points in POINTS' order, whichever ran last; any other after them
        order = table["point"].map({point: i for i, point in enumerate(waste.POINTS)}).fillna(len(waste.POINTS))
        table.iloc[order.argsort(kind="stable")].to_csv(path, index=False)
        print(rows[["point", "kind", "term", "bytes", "share_of_peak"]].to_string(index=False), flush=True)
    append_run(
        out,
        command,
        started,
        "cpu",
        points=names,
        what="kvlab.waste: transformers' own generate() under the meter and kvlab.explain, and each fix "
        "under the meter; the CPU allocator's events, the live-storage counter beside it for attribution, one thread",
        results_file="waste.csv",
    )
