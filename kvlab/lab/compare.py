"""The main job: the tuple cache of transformers <= 4.41 vs every later design, on the default device: a shipped
sweep (`cpu-default`: the Llama-2-7B twin in bf16; `cuda-default`: TinyLlama-1.1B in bf16 at the PR's shape), then
the table, the figures and the executed analysis notebook, in a git-ignored results folder (the committed
notebooks are never overwritten).
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pandas as pd

from ..models import resolve_device
from .grid import expand, load_sweep
from .engines import run_sweep
from .point import DESIGNS

ANALYSIS_NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "03_analysis.ipynb"
MIB = 2**20
# The parameters a sweep's points may differ in besides the design; the table shows those that do.
VARYING = ("preset", "overrides", "runtime", "strategy", "dtype", "batch", "prompt", "track_storages")


def longest_ok(results: pd.DataFrame) -> pd.DataFrame:
    """The points measured at the sweep's longest generation."""
    return results[(results["status"] == "ok") & (results["new"] == results["new"].max())]


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
    columns |= {"overhead_MiB": (rows["overhead_bytes"] / MIB).round(2), "overhead/KV": rows["overhead_over_kv"].round(3),
                "predicted_MiB": (rows["predicted_overhead_bytes"] / MIB).round(2),
                "error_%": (100 * rows["prediction_error"]).round(2), "tokens/s": rows["tokens_per_s"].round(1)}
    if ((rows["meter"] == "cuda-allocator") & rows["storages_peak_bytes"].notna()).any():
        columns["storages_MiB"] = (rows["storages_peak_bytes"] / MIB).round(2)  # the live-storage meter beside CUDA's
    return pd.DataFrame(columns).reset_index(drop=True)


def markdown(table: pd.DataFrame) -> str:
    # DataFrame.to_markdown needs tabulate, which kvlab does not otherwise need (nor has the GPU node): 4 lines.
    lines = ["| " + " | ".join(table.columns) + " |",
             "|" + "".join("---:|" if pd.api.types.is_numeric_dtype(table[c]) else "---|" for c in table)]
    return "\n".join(lines + ["| " + " | ".join("" if pd.isna(v) else str(v) for v in row) + " |"
                              for row in table.itertuples(index=False)])


def write_summary(results: pd.DataFrame, path: Path, title: str) -> None:
    """`path` (a sweep's OUT/summary.md): the comparison table as `make compare` prints it, and what is not ok."""
    counts = ", ".join(f"{n} {status}" for status, n in results["status"].value_counts().items())
    lines = [f"# {title}", "", f"{len(results)} points: {counts}.", ""]
    if len(longest := longest_ok(results)):
        shared = [f"{key} {longest[key].iloc[0]}" for key in VARYING
                  if longest[key].nunique() == 1 and longest[key].iloc[0] != ""]
        lines += [f"On {', '.join(longest['device_name'].unique())} ({longest['device'].iloc[0]}): "
                  f"{', '.join(shared)}, {longest['new'].iloc[0]} new tokens (the sweep's longest). Overhead = peak "
                  "above the post-load baseline; overhead/KV: over the final cache; predicted: kvlab.theory; "
                  "tokens/s: a run without the live-storage meter.", "", markdown(comparison_table(results)), ""]
    failed = results[results["status"] != "ok"]
    if len(failed):
        lines += ["## Not ok", ""] + [f"- {r['status']}: {r['preset']} {r['kind']} {r['cache']}/{r['loop']} "
                                      f"({r['point_id']}): {r['error']}" for _, r in failed.iterrows()]
    path.write_text("\n".join(lines).rstrip() + "\n")


def run_compare(device="auto", preset=None, out=None, **sizes) -> pd.DataFrame:
    device = resolve_device(device)
    fixed, grid = load_sweep("cuda-default" if device.startswith("cuda") else "cpu-default")
    fixed.update(device=device, **{k: v for k, v in dict(preset=preset, **sizes).items() if v is not None})
    if sizes.get("new") is not None:
        grid.pop("new", None)
    out = Path(out or f"results/compare-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    # run_sweep validates every point before anything runs: a bad input is refused with no folder made.
    results = run_sweep(expand(fixed, grid), out, command="python -m kvlab compare")
    for _, row in results[results["status"] != "ok"].iterrows():
        print(f"{row['status']}: {row['cache']}/{row['loop']} new={row['new']}: {row['error']}")
    table, longest = comparison_table(results), longest_ok(results)

    import papermill

    from ..notebook import plots
    from ..notebook.colab import QUIET_KERNEL, kernel_name  # `kvlab` where make registered it, else python3
    figures = {out / "compare.png": plots.compare_figure(longest)}
    if results["new"].nunique() > 1:
        figures[out / "overhead_vs_new_tokens.png"] = plots.overhead_figure(results, "new")
    for path, figure in figures.items():
        figure.savefig(path, dpi=120, bbox_inches="tight")
    analysis = out / "03_analysis.ipynb"
    papermill.execute_notebook(str(ANALYSIS_NOTEBOOK), str(analysis), kernel_name=kernel_name(), progress_bar=False,
                               parameters={"results_csv": str((out / "results.csv").resolve())},
                               cwd=str(ANALYSIS_NOTEBOOK.parent.parent), extra_arguments=QUIET_KERNEL)

    first = longest.iloc[0]
    print(f"\n{first['preset']} on {first['device_name']} ({first['device']}, {first['dtype']}), "
          f"batch {first['batch']}, prompt {first['prompt']}, {first['new']} new tokens, greedy; "
          f"final KV cache {first['kv_final_bytes'] / MIB:.1f} MiB")
    if device == "cpu" and sizes.get("batch") is None and sizes.get("new") is None:
        print(f"(batch {first['batch']} and {first['new']} new tokens, not the H200 points' 8 and 500, to stay within "
              "a few minutes: overhead/KV is flat in batch (cpu-batch, 1 to 8); fixed costs, such as 4.42's prompt "
              "logits, weigh more against a shorter cache (cpu-new-tokens); --batch 8 --new 500 runs that shape)")
    print(table.to_string(index=False))
    baseline = longest[(longest["cache"] == "tuple") & (longest["loop"] == "v4.40")]["overhead_bytes"]
    best = longest[(longest["loop"] == "v5") & (longest["cache"] != "tuple")]["overhead_bytes"].min()
    if len(baseline) and best:
        print(f"\ntuple / v4.40 (<= 4.41) over the best v5 design's overhead: {baseline.iloc[0] / best:.2f}x")
    print(f"\nresults: {out / 'results.csv'}", *(f"figure:  {path}" for path in figures),
          f"analysis notebook (executed): {analysis}", sep="\n")
    return table
