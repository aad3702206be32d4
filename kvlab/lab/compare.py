"""The main job: the tuple cache of transformers <= 4.41 vs every later design, on the default device.

It runs a small shipped sweep (`cpu-default` on CPU: the Llama-2-7B twin in bf16; `cuda-default` on a
GPU: TinyLlama-1.1B in bf16 at the PR's shape), one fresh kernel per point, then prints the
comparison table, draws the figures and executes the analysis notebook on the results. Everything
goes to a git-ignored results folder; the committed notebooks are never overwritten.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pandas as pd

from ..models import resolve_device
from .grid import expand, load_sweep, sweep_file, validate
from .engines import run_sweep

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
ANALYSIS_NOTEBOOK = NOTEBOOKS / "04_analysis.ipynb"
MIB = 2**20


def comparison_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per design at the longest generation of the sweep."""
    rows = df[(df["status"] == "ok") & (df["new"] == df["new"].max())]
    return pd.DataFrame({
        "cache": rows["cache"], "loop": rows["loop"],
        "overhead_MiB": (rows["overhead_bytes"] / MIB).round(2),
        "overhead/KV": rows["overhead_over_kv"].round(3),
        "predicted_MiB": (rows["predicted_overhead_bytes"] / MIB).round(2),
        "error_%": (100 * rows["prediction_error"]).round(2),
        "tokens/s": rows["tokens_per_s"].round(1),
    }).reset_index(drop=True)


def run_compare(device="auto", preset=None, out=None, **sizes) -> pd.DataFrame:
    device = resolve_device(device)
    fixed, grid = load_sweep(sweep_file("cuda-default" if device.startswith("cuda") else "cpu-default"))
    fixed.update(device=device, **{k: v for k, v in dict(preset=preset, **sizes).items() if v is not None})
    if "new" in sizes and sizes["new"] is not None:
        grid.pop("new", None)
    points = validate(expand(fixed, grid))  # every bad input fails here, before anything runs
    out = Path(out or f"results/compare-{datetime.datetime.now():%Y%m%d-%H%M%S}")

    results = run_sweep(points, out, command="python -m kvlab compare")
    failed = results[results["status"] != "ok"]
    for _, row in failed.iterrows():
        print(f"{row['status']}: {row['cache']}/{row['loop']} new={row['new']}: {row['error']}")
    table = comparison_table(results)

    from ..notebook import plots
    figures = []
    longest = results[(results["status"] == "ok") & (results["new"] == results["new"].max())]
    figures.append(out / "compare.png")
    plots.compare_figure(longest).savefig(figures[-1], dpi=120, bbox_inches="tight")
    if results["new"].nunique() > 1:
        figures.append(out / "overhead_vs_new_tokens.png")
        plots.overhead_figure(results, "new").savefig(figures[-1], dpi=120, bbox_inches="tight")
    analysis = out / "04_analysis.ipynb"
    _execute_analysis(out / "results.csv", analysis)

    first = longest.iloc[0]
    print(f"\n{first['preset']} on {first['device_name']} ({first['device']}, {first['dtype']}), "
          f"batch {first['batch']}, prompt {first['prompt']}, {first['new']} new tokens, greedy; "
          f"final KV cache {first['kv_final_bytes'] / MIB:.1f} MiB")
    print(table.to_string(index=False))
    baseline = longest[(longest["cache"] == "tuple") & (longest["loop"] == "v4.40")]["overhead_bytes"]
    best = longest[(longest["loop"] == "v5") & (longest["cache"] != "tuple")]["overhead_bytes"].min()
    if len(baseline) and best:
        print(f"\ntuple / v4.40 (<= 4.41) over the best v5 design's overhead: {baseline.iloc[0] / best:.2f}x")
    print(f"\nresults: {out / 'results.csv'}")
    for figure in figures:
        print(f"figure:  {figure}")
    print(f"analysis notebook (executed): {analysis}")
    return table


def _execute_analysis(results_csv: Path, output: Path) -> None:
    import papermill

    from ..notebook.colab import kernel_name  # `kvlab` where make registered it, else python3
    papermill.execute_notebook(str(ANALYSIS_NOTEBOOK), str(output), parameters={"results_csv": str(results_csv.resolve())},
                               kernel_name=kernel_name(),
                               cwd=str(ANALYSIS_NOTEBOOK.parent.parent), progress_bar=False)
