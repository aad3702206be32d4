"""The main job: the tuple cache of transformers <= 4.41 vs every later design, on the default device: a shipped
sweep (`cpu-default`: the Llama-2-7B twin in bf16; `cuda-default`: TinyLlama-1.1B in bf16 at the PR's shape), then
the table, the figures and the executed analysis notebook, in a git-ignored results folder (the committed
notebooks are never overwritten).
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pandas as pd

from .lab.engines import run_sweep
from .lab.grid import expand, load_sweep
from .lab.runner import PROJECT_DIR
from .lab.summary import MIB, comparison_table, longest_ok
from .models import resolve_device

ANALYSIS_NOTEBOOK = PROJECT_DIR / "notebooks" / "03_analysis.ipynb"


class NothingMeasured(RuntimeError):
    """Every point of the comparison failed: no table, no figure (the failures are printed, one line each)."""


def analyse(results_csv: Path) -> Path:
    """Notebook 03 executed on a results table, into the table's folder; the executed copy's path."""
    import papermill

    from .lab.kernel import QUIET_KERNEL, kernel_name  # `kvlab` where make registered it, else python3

    analysis = results_csv.parent / ANALYSIS_NOTEBOOK.name
    papermill.execute_notebook(
        str(ANALYSIS_NOTEBOOK),
        str(analysis),
        kernel_name=kernel_name(),
        progress_bar=False,
        # the points were predicted as they were measured, on any device (kvlab.planner.theory): nothing to refresh
        parameters={"results_csv": str(results_csv.resolve()), "recompute_predictions": False},
        cwd=str(PROJECT_DIR),
        # The analysis builds each point's config, and the lesson's notebook registers the lessons' presets alone:
        # its kernel imports the catalogue (cuda-default's TinyLlama, any --preset the sweep took) before it runs.
        extra_arguments=[*QUIET_KERNEL, "--IPKernelApp.exec_lines=import kvlab.catalogue"],
    )
    return analysis


def run_compare(device="auto", preset=None, out=None, **sizes) -> pd.DataFrame:
    # The notebooks extra (papermill, the plots' matplotlib and seaborn) before the sweep, not after its minutes.
    import papermill  # noqa: F401

    from .notebook.figures.compare import compare_figure, overhead_figure

    device = resolve_device(device)
    fixed, grid = load_sweep("cuda-default" if device.startswith("cuda") else "cpu-default")
    fixed.update(device=device, **{k: v for k, v in dict(preset=preset, **sizes).items() if v is not None})
    if sizes.get("new") is not None:
        grid.pop("new", None)
    # Against the caller's folder, before anything runs: the points' kernels run in the project's.
    out = Path(out or f"results/compare-{datetime.datetime.now():%Y%m%d-%H%M%S}").absolute()
    # run_sweep validates every point before anything runs: a bad input is refused with no folder made.
    results = run_sweep(expand(fixed, grid), out, command="python -m kvlab compare")
    not_ok = results[results["status"] != "ok"]
    for _, row in not_ok.iterrows():
        print(f"{row['status']}: {row['cache']}/{row['loop']} new={row['new']}: {row['error']}")
    if len(not_ok) == len(results):
        raise NothingMeasured(f"every point failed ({len(results)}; each above); nothing to compare in {out}")
    table, longest = comparison_table(results), longest_ok(results)

    figures = {out / "compare.png": compare_figure(longest)}
    if results["new"].nunique() > 1:
        figures[out / "overhead_vs_new_tokens.png"] = overhead_figure(results, "new")
    for path, figure in figures.items():
        figure.savefig(path, dpi=120, bbox_inches="tight")
    analysis = analyse(out / "results.csv")

    first = longest.iloc[0]
    print(
        f"\n{first['preset']} on {first['device_name']} ({first['device']}, {first['dtype']}), "
        f"batch {first['batch']}, prompt {first['prompt']}, {first['new']} new tokens, greedy; "
        f"final KV cache {first['kv_final_bytes'] / MIB:.1f} MiB"
    )
    if device == "cpu" and sizes.get("batch") is None and sizes.get("new") is None:
        print(
            f"(batch {first['batch']} and {first['new']} new tokens, not the H200 points' 8 and 500, to stay within "
            "a few minutes: overhead/KV is flat in batch (cpu-batch, 1 to 8); fixed costs, such as 4.42's prompt "
            "logits, weigh more against a shorter cache (cpu-new-tokens); --batch 8 --new 500 runs that shape)"
        )
    print(table.to_string(index=False))
    baseline = longest[(longest["cache"] == "tuple") & (longest["loop"] == "v4.40")]["overhead_bytes"]
    best = longest[(longest["loop"] == "v5") & (longest["cache"] != "tuple")]["overhead_bytes"].min()
    if len(baseline) and best:
        print(f"\ntuple / v4.40 (<= 4.41) over the best v5 design's overhead: {baseline.iloc[0] / best:.2f}x")
    print(
        f"\nresults: {out / 'results.csv'}",
        *(f"figure:  {path}" for path in figures),
        f"analysis notebook (executed): {analysis}",
        sep="\n",
    )
    table.attrs["not_ok"] = len(not_ok)  # the command line's exit status: 1 if any point failed
    return table
