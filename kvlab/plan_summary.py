"""summary.md of a plan run: every point beside theory and the data files the plan names, the real releases
beside kvlab's loops, the live-storage meter beside the allocator, speed side by side, and what did not run.

Every number here is read: from the run's results.csv and from the data files of the plan's compare_with
(e.g. data/design/h200.csv, shared/DESIGN.md's H200 figures with their provenance; data/meta/results.csv).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

MATCH_KEYS = ("preset", "overrides", "cache", "loop", "strategy", "batch", "prompt", "new", "dtype")


def read_data(path: Path) -> pd.DataFrame:
    """A data file's ok rows with the keys that identify a point and their overhead / KV."""
    table = pd.read_csv(path, dtype={"overrides": "string"})
    if "status" in table:
        table = table[table["status"] == "ok"]
    if "overrides" in table:
        table = table.assign(overrides=table["overrides"].fillna(""))
    return table


def matching(data: pd.DataFrame, row: pd.Series) -> str:
    """The data file's overhead / KV at this row's point (same model, sizes, cache and loop), or —."""
    keys = [key for key in MATCH_KEYS if key in data]
    found = data[(data[keys] == pd.Series({key: row[key] for key in keys})).all(axis=1)]
    return "—" if found.empty else " / ".join(f"{value:.4g}" for value in found["overhead_over_kv"].unique())


def _size(unit):
    name, scale = unit
    return lambda n: "—" if pd.isna(n) else f"{n / scale:.3f}"


def write_summary(plan: dict, out: Path, events: list[str], elapsed: float, sources: list[Path]) -> None:
    results = out / "results.csv"
    if results.exists():
        table = pd.read_csv(results, dtype={"overrides": "string", "error": "string"})
        table = table.assign(overrides=table["overrides"].fillna(""))
    else:  # nothing ended (all skipped or killed): the same sections, empty
        from .lab.store import COLUMNS
        table = pd.DataFrame(columns=[*COLUMNS, "job", "lane", "phase"])
    ok = table[table["status"] == "ok"]
    unit = ("GiB", 2**30) if not ok.empty and ok["overhead_bytes"].max() >= 2**30 else ("MiB", 2**20)
    size = _size(unit)
    counts = ", ".join(f"{n} {status}" for status, n in table["status"].value_counts().items()) or "no points"
    lines = [f"# Plan {plan['name']}: {'dry run on CPU (stand-in presets, tiny sizes)' if plan['dry_run'] else 'as written'}",
             "", f"{len(table)} points ({counts}) in {elapsed:.0f}s of a {plan['budget_s']:.0f}s budget. Sizes in "
             f"{unit[0]}; overhead = peak above the post-load baseline; KV = the final cache; theory = "
             "kvlab.theory's prediction. Data files: " + ", ".join(
                 f"{source['label']} = `{source['path']}`" for source in plan["compare_with"]) + ".", ""]

    datas = [read_data(path) for path in sources]
    labels = [source["label"] for source in plan["compare_with"]]
    lines += ["## Every point", "",
              "| job | kind | model | cache / loop | batch | prompt | new | overhead | overhead / KV | theory / KV | "
              + "".join(f"{label} | " for label in labels) + "tokens/s |",
              "|---|---|---|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(labels) + "---:|"]
    for _, r in ok.iterrows():
        model = r["preset"] + (f" ({r['overrides']})" if r["overrides"] else "")
        theory = r["predicted_overhead_bytes"] / r["kv_final_bytes"] if pd.notna(r["predicted_overhead_bytes"]) else None
        lines.append(f"| {r['job']} | {r['kind']} | {model} | {r['cache']} / {r['loop']} | {r['batch']} | {r['prompt']} | "
                     f"{r['new']} | {size(r['overhead_bytes'])} | {r['overhead_over_kv']:.4f} | "
                     f"{'—' if theory is None else f'{theory:.4f}'} | "
                     + "".join(f"{matching(data, r)} | " for data in datas)
                     + f"{'—' if pd.isna(r['tokens_per_s']) else r['tokens_per_s']} |")

    lines += ["", f"## Each release's own generate() beside kvlab's loop (within ±{plan['tolerance']:.0%})", "",
              "| model | cache / loop | release | generate() overhead | kvlab's loop | kvlab / release − 1 | within |",
              "|---|---|---|---:|---:|---:|---|"]
    pairs = 0
    for _, ref in ok[ok["kind"] == "reference"].iterrows():
        ours = ok[(ok["kind"] == "kvlab") & (ok[list(MATCH_KEYS)] == ref[list(MATCH_KEYS)]).all(axis=1)]
        if ours.empty:
            continue
        pairs += 1
        error = ours["overhead_bytes"].iloc[0] / ref["overhead_bytes"] - 1
        lines.append(f"| {ref['preset']}{' (' + ref['overrides'] + ')' if ref['overrides'] else ''} | {ref['cache']} / "
                     f"{ref['loop']} | {ref['transformers_version']} | {size(ref['overhead_bytes'])} | "
                     f"{size(ours['overhead_bytes'].iloc[0])} | {100 * error:+.2f} % | "
                     f"{'yes' if abs(error) <= plan['tolerance'] else 'NO'} |")
    if not pairs:
        lines.append("| no reference point with kvlab's loop at the same point | | | | | | |")

    lines += ["", "## The live-storage meter beside the CUDA allocator", ""]
    both = ok[ok["storages_peak_bytes"].notna() & (ok["meter"] != "live-storages")] if "meter" in ok else ok[:0]
    if both.empty:
        lines.append("No point measured with both (on a CPU the live-storage meter is the only one).")
    else:
        lines += ["| job | model | cache / loop | allocator overhead | storages peak | storages / allocator |",
                  "|---|---|---|---:|---:|---:|"]
        for _, r in both.iterrows():
            lines.append(f"| {r['job']} | {r['preset']} | {r['cache']} / {r['loop']} | {size(r['overhead_bytes'])} | "
                         f"{size(r['storages_peak_bytes'])} | {r['storages_peak_bytes'] / r['overhead_bytes']:.4f} |")

    speed_jobs = {job["name"]: job["compare_speed"] for phase in plan["phases"] for job in phase["jobs"]
                  if job.get("compare_speed")}
    lines += ["", "## Speed, side by side in one job", ""]
    timed = ok[ok["job"].isin(list(speed_jobs)) & ok["tokens_per_s"].notna()]
    if timed.empty:
        lines.append("No job compared speeds in this run.")
    else:
        lines += ["| job | cache / loop | batch | prompt | new | tokens/s | seconds | / baseline |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for name, group in timed.groupby("job"):
            base = group[group["cache"] == speed_jobs[name]]["tokens_per_s"]
            for _, r in group.iterrows():
                ratio = f"{r['tokens_per_s'] / base.iloc[0]:.3f} × {speed_jobs[name]}" if not base.empty else "—"
                lines.append(f"| {name} | {r['cache']} / {r['loop']} | {r['batch']} | {r['prompt']} | {r['new']} | "
                             f"{r['tokens_per_s']} | {r['seconds']} | {ratio} |")

    lines += ["", "## Skipped, killed, failed", ""]
    lines += [f"- {event}" for event in events] or ["- nothing"]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
