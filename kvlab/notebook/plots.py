"""The figures: the PR's benchmark plots redrawn from a results table (`kvlab.lab.store.load_results`), the main
job's bars, and notebook 06's stream modes. Measured: solid lines; kvlab.theory: thin black dashes over them."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from ..lab import point as experiment
from .. import theory
from ..models import build_config

MIB, GIB = 2**20, 2**30
SIZES = ("new", "batch", "prompt")
AXIS_NAMES = {"new": "new tokens", "batch": "batch size", "prompt": "prompt length (tokens)"}
DESIGNS = [f"{cache} / {loop}" for cache, loop in experiment.DESIGNS]
MARKERS = "osD^vPX*"
# Before and after PR #30536, as released: the ratio the PR reports.
BASELINE, FIXED = ("tuple", "v4.40"), ("dynamic", "v4.42")


def measured(df: pd.DataFrame) -> pd.DataFrame:
    """The points that ran (status ok), with a `design` column ("cache / loop")."""
    df = df[df["status"] == "ok"] if "status" in df else df
    return df.assign(design=df["cache"] + " / " + df["loop"])


def _config(row):
    return build_config(row["preset"], [item for item in row["overrides"].split(",") if item])


def refresh_predictions(df: pd.DataFrame) -> pd.DataFrame:
    """Recompute `predicted_overhead_bytes` with the installed kvlab.theory (the recorded value is kept
    as `recorded_prediction_bytes`): a prediction is a function of the parameters, so it can follow
    the model as it improves without measuring again."""
    def predict(row):
        return theory.predict_overhead(_config(row), **{key: row[key] for key in theory.POINT_KEYS if key in row})
    return df.assign(recorded_prediction_bytes=df["predicted_overhead_bytes"],
                     predicted_overhead_bytes=df.apply(predict, axis=1))


def series(df: pd.DataFrame, vary: str) -> pd.DataFrame:
    """The rows where only `vary` changes: per preset and dtype, the setting of the other sizes that
    has the most distinct values of `vary` (a table may hold several sweeps)."""
    others = [size for size in SIZES if size != vary]
    parts = []
    for _, group in df.groupby(["preset", "dtype"], sort=False):
        counts = group.groupby(others)[vary].nunique()
        if counts.max() < 2:
            continue
        setting = dict(zip(others, counts.idxmax()))
        parts.append(group[(group[others] == pd.Series(setting)).all(axis=1)])
    if not parts:
        raise ValueError(f"no rows where {vary} varies with the other sizes fixed")
    return pd.concat(parts).sort_values(vary)


def varying_sizes(df: pd.DataFrame) -> list[str]:
    """The sizes this table holds a series for (a sweep may vary only some of them)."""
    found = []
    for vary in SIZES:
        try:
            series(measured(df), vary)
            found.append(vary)
        except ValueError:
            pass
    return found


def overhead_figure(df: pd.DataFrame, vary: str = "new", title: str = ""):
    """Peak memory above the weights against one size, for every design: measured (solid, markers) and
    predicted by kvlab.theory (dashed, drawn over the data), with 1x and 2x the final KV in grey (the tuple cache
    of v4.40 should sit on 2x, the one-object designs near 1x). Both axes start at zero, so twice the memory
    looks twice as high. matplotlib, not seaborn: hollow markers shrinking design by design keep coinciding lines
    visible."""
    rows = series(measured(df), vary)
    presets = list(dict.fromkeys(rows["preset"]))
    scale, unit = (GIB, "GiB") if max(rows["overhead_bytes"].max(), 2 * rows["kv_final_bytes"].max()) >= 2 * GIB \
        else (MIB, "MiB")
    designs = [d for d in DESIGNS if d in set(rows["design"])] + sorted(set(rows["design"]) - set(DESIGNS))
    colours = dict(zip(designs, sns.color_palette("tab10", len(designs))))
    fig, axes = plt.subplots(1, len(presets), figsize=(6.5 * len(presets) + 2, 4.5), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        part = rows[rows["preset"] == preset]
        for i, design in enumerate(designs):
            line = part[part["design"] == design]
            if line.empty:
                continue
            # Designs often coincide (tuple / v4.42 on tuple / v4.40): hollow, shrinking markers keep each visible.
            ax.plot(line[vary], line["overhead_bytes"] / scale, "-", marker=MARKERS[i % len(MARKERS)],
                    markersize=10 - i, fillstyle="none", markeredgewidth=1.5, color=colours[design], label=design)
            if line["predicted_overhead_bytes"].fillna(0).gt(0).any():  # over the data: a hidden line hides no miss
                ax.plot(line[vary], line["predicted_overhead_bytes"] / scale, "--", color="black", linewidth=0.8,
                        zorder=4)
        kv = part.groupby(vary)["kv_final_bytes"].first() / scale
        for multiple, style in ((1, ":"), (2, "-.")):
            ax.plot(kv.index, multiple * kv.values, style, color="grey", linewidth=1.5, zorder=5,
                    label=f"{multiple} x final KV")
        ax.set(xlim=(0, None), ylim=(0, None), xlabel=AXIS_NAMES[vary],
               ylabel=f"peak memory above the weights ({unit})")
        first = part.iloc[0]
        fixed = ", ".join(f"{AXIS_NAMES[size].split(' (')[0]} {first[size]}" for size in SIZES if size != vary)
        ax.set_title(title or f"Peak above the weights against {AXIS_NAMES[vary]}: {first['preset']} {first['dtype']} "
                     f"on {first['device']}, {fixed}", fontsize=10)
    axes[0][-1].plot([], [], "--", color="black", linewidth=0.8, label="kvlab.theory, per design")
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig


def improvement_table(df: pd.DataFrame, vary: str = "new") -> pd.DataFrame:
    """v4.40 tuple overhead / v4.42 dynamic overhead at each point of a series, beside the PR's minimal and
    maximal improvement factors from kvlab.theory."""
    rows = series(measured(df), vary)
    keys = ["preset", "dtype", "device", "overrides", "batch", "prompt", "new"]
    pick = lambda design: rows[(rows["cache"] == design[0]) & (rows["loop"] == design[1])].set_index(keys)
    before, after = pick(BASELINE)["overhead_bytes"], pick(FIXED)["overhead_bytes"]
    table = (before / after).dropna().rename("measured").reset_index()
    if table.empty:
        raise ValueError("the table needs both tuple/v4.40 and dynamic/v4.42 points")
    table[["minimal", "maximal"]] = table.apply(lambda row: theory.improvement_factors(
        _config(row), batch=int(row["batch"]), prompt=int(row["prompt"]), new=int(row["new"]), dtype=row["dtype"]),
        axis=1, result_type="expand")
    return table.round({"measured": 3, "minimal": 3, "maximal": 3})


# PR #30536's own factors (seed 000; RTX 4090, batch 1, prompt 300): drawn beside ours, never computed.
PR_FACTORS = {"maximal": 2.0, "minimal, Llama-2-7B": 1.62, "minimal, Mistral-7B": 1.22}


def improvement_figure(df: pd.DataFrame, sizes=SIZES, title: str = ""):
    """One panel per size: the measured v4.40 / v4.42 ratio, kvlab.theory's bounds for the same model and
    the PR's own factors (grey, as the PR states them), on a ratio axis from 1 (no saving)."""
    tables = {}
    for vary in sizes:
        try:
            tables[vary] = improvement_table(df, vary)
        except ValueError:  # this table has no such series
            continue
    fig, axes = plt.subplots(1, len(tables), figsize=(4.5 * len(tables), 4.2), squeeze=False, sharey=True)
    for ax, (vary, table) in zip(axes[0], tables.items()):
        for value, style in zip(PR_FACTORS.values(), ("-", "-.", ":")):
            ax.axhline(value, color="grey", linestyle=style, linewidth=1.2)
        for preset, part in table.groupby("preset", sort=False):
            label = f" ({preset})" if table["preset"].nunique() > 1 else ""
            ax.plot(part[vary], part["maximal"], "--", color="tab:green", label=f"kvlab.theory maximal{label}")
            ax.plot(part[vary], part["minimal"], "--", color="tab:red", label=f"kvlab.theory minimal{label}")
            ax.plot(part[vary], part["measured"], "o-", color="tab:blue", zorder=4, label=f"measured{label}")
        ax.set(ylim=(1, 2.1), xlim=(0, None), xlabel=AXIS_NAMES[vary])
        first = table.iloc[0]
        ax.set_title(", ".join(f"{AXIS_NAMES[k].split(' (')[0]} {first[k]}" for k in SIZES if k != vary), fontsize=9)
    axes[0][0].set_ylabel("peak of tuple / v4.40 ÷ peak of dynamic / v4.42 (x)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    handles += [plt.Line2D([], [], color="grey", linestyle=s) for s in ("-", "-.", ":")]
    labels += [f"PR #30536: {name} ≈ {value:g}" for name, value in PR_FACTORS.items()]
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    first = next(iter(tables.values())).iloc[0]
    fig.suptitle(title or f"How much the PR saved, measured: {first['preset']} {first['dtype']} on {first['device']}",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig


def compare_figure(df: pd.DataFrame):
    """Measured overhead above the weights per design, with the analytic prediction and 1x / 2x KV."""
    df = df.assign(design=df["cache"] + " / " + df["loop"],
                   measured=df["overhead_bytes"] / MIB, predicted=df["predicted_overhead_bytes"] / MIB)
    kv = df["kv_final_bytes"].iloc[0] / MIB
    fig, ax = plt.subplots(figsize=(8, 4))
    sns.barplot(data=df, y="design", x="measured", color="tab:blue", ax=ax, label="measured")
    ax.scatter(df["predicted"], range(len(df)), color="black", marker="|", s=300, zorder=3, label="kvlab.theory")
    for multiple in (1, 2):
        ax.axvline(multiple * kv, color="grey", linestyle="--", linewidth=1)
        ax.text(multiple * kv, 0.01, f" {multiple}x KV", ha="left", va="bottom", color="grey", fontsize=8,
                transform=ax.get_xaxis_transform())
    first = df.iloc[0]
    ax.set(xlabel="peak memory above the weights (MiB)", ylabel="cache / loop",
           title=f"{first['preset']} {first['dtype']} on {first['device']}: batch {first['batch']}, "
                 f"prompt {first['prompt']}, {first['new']} new tokens")
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


# Notebook 06's stream modes (kvlab.encdec.stream.MODES): one colour, marker and dash each, in every figure.
MODE_STYLES = {"hf-static": ("tab:red", "o", None), "reused": ("tab:blue", "s", (5, 3)),
               "reused-max": ("tab:purple", "^", (1, 2)), "dynamic": ("tab:green", "D", (3, 1, 1, 1))}


def mode_lines(ax, df: pd.DataFrame, x: str, y: str, modes=None):
    """One line per stream mode of `df` (column `mode`), in MODES' order: its colour, dash and a hollow marker
    that shrinks from mode to mode, so that modes whose lines coincide all stay visible."""
    present = [mode for mode in (modes or MODE_STYLES) if mode in set(df["mode"])]
    for i, mode in enumerate(present):
        line = df[df["mode"] == mode].sort_values(x)
        color, marker, dashes = MODE_STYLES[mode]
        style = {"dashes": dashes} if dashes else {"linestyle": "-"}
        ax.plot(line[x], line[y], color=color, marker=marker, markersize=11 - 2 * i, fillstyle="none",
                markeredgewidth=1.5, linewidth=1.5, label=mode, **style)
    ax.set_xlabel(x)
    ax.legend(title="mode", loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9)
    return ax
