"""A sweep's summary: one row per design at the sweep's longest generation, the table `make compare` prints and
every sweep writes to OUT/summary.md."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pandas is the lab extra's: the command line's parser imports this module without it
    import pandas as pd

from ..schema import DESIGNS

MIB = 2**20
# The parameters a sweep's points may differ in besides the design; the table shows those that do.
VARYING = ("preset", "overrides", "runtime", "strategy", "dtype", "batch", "prompt", "track_storages")


def longest_ok(results: pd.DataFrame) -> pd.DataFrame:
    """The points measured at the sweep's longest generation with a point measured."""
    ok = results[results["status"] == "ok"]
    return ok[ok["new"] == ok["new"].max()]  # a length where every point failed is not the longest measured


def comparison_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per design at the longest generation of the sweep, in DESIGNS' order; a column for each other
    parameter the rows differ in; a real release's own generate() (kind reference) right under kvlab's loop."""
    rows = longest_ok(df)
    order = [DESIGNS.index(d) if d in DESIGNS else len(DESIGNS) for d in zip(rows["cache"], rows["loop"])]
    varying = [key for key in VARYING if rows[key].nunique() > 1]
    rows = rows.assign(design_order=order).sort_values([*varying, "design_order", "kind"], kind="stable")
    columns = {key: rows[key] for key in [*varying, "cache", "loop"]}
    if (rows["kind"] == "reference").any():
        release = "transformers " + rows["transformers_version"].astype(str)
        columns["generate()"] = release.where(rows["kind"] == "reference", "kvlab")
    columns |= {
        "overhead_MiB": (rows["overhead_bytes"] / MIB).round(2),
        "overhead/KV": rows["overhead_over_kv"].round(3),
        "predicted_MiB": (rows["predicted_overhead_bytes"] / MIB).round(2),
        "error_%": (100 * rows["prediction_error"]).round(2),
        "tokens/s": rows["tokens_per_s"].round(1),
    }
    if ((rows["meter"] == "cuda-allocator") & rows["storages_peak_bytes"].notna()).any():
        columns["storages_MiB"] = (rows["storages_peak_bytes"] / MIB).round(2)  # the live-storage meter beside CUDA's
    import pandas as pd

    return pd.DataFrame(columns).reset_index(drop=True)


def markdown(table: pd.DataFrame) -> str:
    import pandas as pd

    # DataFrame.to_markdown needs tabulate, which kvlab does not otherwise need (nor has the GPU node): 4 lines.
    lines = [
        "| " + " | ".join(table.columns) + " |",
        "|" + "".join("---:|" if pd.api.types.is_numeric_dtype(table[c]) else "---|" for c in table),
    ]
    return "\n".join(
        lines
        + ["| " + " | ".join("" if pd.isna(v) else str(v) for v in row) + " |" for row in table.itertuples(index=False)]
    )


def write_summary(results: pd.DataFrame, path: Path, title: str) -> None:
    """`path` (a sweep's OUT/summary.md): the comparison table as `make compare` prints it, and what is not ok."""
    counts = ", ".join(f"{n} {status}" for status, n in results["status"].value_counts().items())
    lines = [f"# {title}", "", f"{len(results)} points: {counts}.", ""]
    if len(longest := longest_ok(results)):
        shared = [
            f"{key} {longest[key].iloc[0]}"
            for key in VARYING
            if longest[key].nunique() == 1 and longest[key].iloc[0] != ""
        ]
        lines += [
            f"On {', '.join(longest['device_name'].unique())} ({longest['device'].iloc[0]}): "
            f"{', '.join(shared)}, {longest['new'].iloc[0]} new tokens (the sweep's longest). Overhead = peak "
            "above the post-load baseline; overhead/KV: over the final KV; predicted: kvlab.theory; "
            "tokens/s: a run without the live-storage meter.",
            "",
            markdown(comparison_table(results)),
            "",
        ]
    failed = results[results["status"] != "ok"]
    if len(failed):
        lines += ["## Not ok", ""] + [
            f"- {r['status']}: {r['preset']} {r['kind']} {r['cache']}/{r['loop']} ({r['point_id']}): {r['error']}"
            for _, r in failed.iterrows()
        ]
    from .store import replace_text  # the lab extra's filelock: not for the parser's import of this module

    replace_text(path, "\n".join(lines).rstrip() + "\n")  # whole, never through a link
