"""The H200 reference points three ways: the twins on CPU, the full configs on the meta device, the H200 run.

    python scripts/twin_table.py   # reads data/cpu (Llama-2 twin), data/twins (Mistral twin), data/meta, data/design

Prints a Markdown table of overhead / KV (batch 8, prompt 300, 500 new tokens, bf16) and the twin's
deviation from the full model, which tests/test_theory.py bounds at 2 %.
"""

from pathlib import Path

import pandas as pd

DATA = Path(__file__).resolve().parent.parent / "data"
# transformers' own class behind each H200 reference point (data/design/h200.csv, with its provenance).
REFERENCE_CLASS = {"tuple": "", "dynamic": " DynamicCache", "static": " StaticCache"}


def h200_labels() -> dict:
    """'2.00 (4.40.1)', '1.016 (5.17 DynamicCache)', ...: the H200 figures as written in the data file."""
    rows = pd.read_csv(DATA / "design" / "h200.csv", dtype=str)
    return {
        (
            row.preset,
            row.cache,
            row.loop,
        ): f"{row.overhead_over_kv} ({row.release.removesuffix('.0')}{REFERENCE_CLASS[row.cache]})"
        for row in rows.itertuples()
    }


def main():
    h200 = h200_labels()
    point = dict(batch=8, prompt=300, new=500, dtype="bfloat16", strategy="greedy")
    rows = pd.concat([pd.read_csv(DATA / folder / "results.csv") for folder in ("cpu", "twins", "meta")])
    rows = rows[(rows["status"] == "ok") & (rows[list(point)] == pd.Series(point)).all(axis=1)]
    rows = rows.assign(model=rows["preset"].str.removesuffix("-twin"), twin=rows["preset"].str.endswith("-twin"))
    table = rows.pivot_table(index=["model", "cache", "loop"], columns="twin", values="overhead_over_kv")
    print("| model | cache / loop | twin, CPU | full config, meta | twin / full | H200 (data/design/h200.csv) |")
    print("|---|---|---:|---:|---:|---|")
    for (model, cache, loop), values in table.iterrows():
        twin, full = values.get(True), values.get(False)
        ratio = f"{twin / full:.4f}" if pd.notna(twin) and pd.notna(full) else "—"
        show = lambda value: f"{value:.4f}" if pd.notna(value) else "—"  # noqa: E731
        measured = h200.get((model, cache, loop), "")
        print(f"| {model} | {cache} / {loop} | {show(twin)} | {show(full)} | {ratio} | {measured} |")


if __name__ == "__main__":
    main()
