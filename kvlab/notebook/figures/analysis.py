"""Lesson 03's figures and tables, also drawn by appendix A5 (kvlab.notebook.figures.compare draws the main job's
and A5's overhead panels from them): the PR's benchmark plots
redrawn from a results table (`kvlab.results.load_results`), the predictions refreshed from kvlab.theory.
Measured: markers on lines; kvlab.theory: thin black dashes over them."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from ... import schema, theory
from ...configs import build_config
from ..helpers import WIDTH

SIZES = ("new", "batch", "prompt")
AXIS_NAMES = {"new": "new tokens", "batch": "batch size", "prompt": "prompt length (tokens)"}
# Before and after PR #30536, as released: the ratio the PR reports.
BASELINE, FIXED = ("tuple", "v4.40"), ("dynamic", "v4.42")


def measured(df: pd.DataFrame) -> pd.DataFrame:
    """The points that ran (status ok), with a `design` column ("cache / loop")."""
    df = df[df["status"] == "ok"] if "status" in df else df
    return df.assign(design=df["cache"] + " / " + df["loop"])


def _config(row):
    return build_config(row["preset"], [item for item in row["overrides"].split(",") if item])


def refresh_predictions(df: pd.DataFrame, predict_overhead=theory.predict_overhead) -> pd.DataFrame:
    """`predicted_overhead_bytes` from the installed theory, the recorded one kept as `recorded_prediction_bytes`: a
    prediction is a function of the parameters, so it follows the theory as it improves without measuring again.
    kvlab.theory's walk (the default) predicts transformers' designs on the CPU and meta; kvlab.planner.theory's
    `predict_overhead` every point (appendix A5 passes it). A CUDA point's prediction is the planner's, recorded as
    it was measured (`python -m kvlab compare` keeps it)."""

    def predict(row):
        return predict_overhead(_config(row), **{key: row[key] for key in schema.POINT_KEYS if key in row})

    return df.assign(
        recorded_prediction_bytes=df["predicted_overhead_bytes"], predicted_overhead_bytes=df.apply(predict, axis=1)
    )


def _series_parts(df: pd.DataFrame, vary: str) -> list[pd.DataFrame]:
    """`series`, one part per preset and dtype; none where `vary` never varies."""
    others = [size for size in SIZES if size != vary]
    parts = []
    for _, group in df.groupby(["preset", "dtype"], sort=False):
        counts = group.groupby(others)[vary].nunique()
        if counts.max() > 1:
            setting = pd.Series(dict(zip(others, counts.idxmax())))
            parts.append(group[(group[others] == setting).all(axis=1)])
    return parts


def series(df: pd.DataFrame, vary: str) -> pd.DataFrame:
    """The rows where only `vary` changes: per preset and dtype, the setting of the other sizes that
    has the most distinct values of `vary` (a table may hold several sweeps)."""
    parts = _series_parts(df, vary)
    if not parts:
        raise ValueError(f"no rows where {vary} varies with the other sizes fixed")
    return pd.concat(parts).sort_values(vary)


def varying_sizes(df: pd.DataFrame) -> list[str]:
    """The sizes this table holds a series for (a sweep may vary only some of them)."""
    return [vary for vary in SIZES if _series_parts(measured(df), vary)]


def held_sizes(row, vary: str) -> str:
    """The sizes a series holds fixed, as in "batch size 1, prompt length 300"."""
    return ", ".join(f"{AXIS_NAMES[size].split(' (')[0]} {row[size]}" for size in SIZES if size != vary)


def figure_legend(fig, axes, ncol: int, extra=()):
    """One legend for all `axes`, below them (never over a point): each label once, in the order first drawn;
    `extra`: (handle, label) pairs added at the end."""
    entries = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    entries.update({label: handle for handle, label in extra})
    return fig.legend(
        list(entries.values()),
        list(entries),
        loc="lower center",
        ncol=min(ncol, len(entries)),
        fontsize=9,
        frameon=False,
    )


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
    table[["minimal", "maximal"]] = table.apply(
        lambda row: theory.improvement_factors(
            _config(row), batch=int(row["batch"]), prompt=int(row["prompt"]), dtype=row["dtype"]
        ),
        axis=1,
        result_type="expand",
    )
    return table.round({"measured": 3, "minimal": 3, "maximal": 3})


# PR #30536's own factors (its description and discussion; RTX 4090): drawn beside ours, never computed. The
# minimal factor is per model ("~1.22 for Mistral and ~1.62 for Llama2"); the maximal one "2" for both.
PR_MINIMAL = {"llama2": 1.62, "mistral": 1.22}
PR_MODELS = {"llama2": "Llama-2-7B", "mistral": "Mistral-7B"}


def _pr_factors(preset: str) -> dict:
    model = next((name for name in PR_MINIMAL if preset.startswith(name)), None)
    return {"maximal": 2.0, **({f"minimal ({model})": PR_MINIMAL[model]} if model else {})}


def improvement_figure(df: pd.DataFrame, sizes=SIZES, title: str = "", peaks: bool = False):
    """One column per size: the measured v4.40 / v4.42 ratio (markers), kvlab.theory's minimal and maximal
    factors for the same model (thin black dashes, named at their left end) and the PR's own factors for that model
    only (grey triangles on the right edge, as the PR states them), on a ratio axis from 1 (no saving).
    `peaks=True` adds a row above: each of the two peaks ÷ the final KV (tuple / v4.40, dynamic / v4.42; y from
    zero, kvlab.theory's prediction a thin black dash over each), so the ratio below is read off two lines. One
    legend, below the panels."""
    tables = {}
    for vary in sizes:
        try:
            tables[vary] = improvement_table(df, vary)
        except ValueError:  # this table has no such series
            continue
    nrows = 2 if peaks else 1
    fig, axes = plt.subplots(
        nrows,
        len(tables),
        figsize=(min(WIDTH, max(3.3 * len(tables), 7.5)), 2.75 * nrows + 1.3),  # one series: wide enough for the legend
        squeeze=False,
        sharex="col",
        sharey="row",
    )
    first = next(iter(tables.values())).iloc[0]
    theory_dash = dict(linestyle="--", color="black", linewidth=0.8)
    for column, (vary, table) in enumerate(tables.items()):
        if peaks:
            _peaks_panel(axes[0][column], df, vary)
        ax = axes[-1][column]
        several = table["preset"].nunique() > 1
        for i, (preset, part) in enumerate(table.groupby("preset", sort=False)):
            for bound in ("minimal", "maximal"):
                ax.plot(part[vary], part[bound], zorder=3, **theory_dash)
                if i == 0:
                    ax.annotate(  # the maximal one above its line, the minimal one below: clear of the data
                        bound,
                        (part[vary].iloc[0], part[bound].iloc[0]),
                        xytext=(0, 3 if bound == "maximal" else -6),
                        textcoords="offset points",
                        fontsize=8,
                        va="bottom" if bound == "maximal" else "top",
                    )
            ax.plot(
                part[vary],
                part["measured"],
                "D-",
                color=sns.color_palette("tab10")[4 + i],
                zorder=4,
                label=f"saving, measured ({preset})" if several else "saving, measured",
            )
            for value in _pr_factors(preset).values():
                ax.plot(
                    1.0,
                    value,
                    "<",
                    color="grey",
                    markersize=9,
                    clip_on=False,
                    zorder=5,
                    transform=ax.get_yaxis_transform(),
                )
        # x to 7 % past the last point: the PR's triangles on the right edge stay clear of it
        ax.set(ylim=(1, 2.15), xlim=(0, table[vary].max() * 1.07), xlabel=AXIS_NAMES[vary])
        axes[0][column].set_title(held_sizes(table.iloc[0], vary), fontsize=10)
    axes[-1][0].set_ylabel("saving (x): tuple / v4.40\npeak ÷ dynamic / v4.42 peak")
    if peaks:
        axes[0][0].set_ylabel("peak above the weights\n÷ final KV (x)")
    model = next((name for key, name in PR_MODELS.items() if first["preset"].startswith(key)), first["preset"])
    stated = ", ".join(f"{name.split(' (')[0]} {value:g}" for name, value in _pr_factors(first["preset"]).items())
    extra = [
        (plt.Line2D([], [], **theory_dash), "kvlab.theory"),
        (
            plt.Line2D([], [], marker="<", color="grey", linestyle="", markersize=9),
            f"PR #30536's own factors for {model}: {stated}",
        ),
    ]
    columns = 3 if len(tables) > 2 else 2
    legend = figure_legend(fig, axes.flat, ncol=columns, extra=extra)
    fig.suptitle(
        title or f"How much the PR saved, measured: {first['preset']} {first['dtype']} on {first['device']}",
        fontsize=11,
    )
    rows_of_legend = -(-len(legend.get_texts()) // columns)
    # right: room for the PR's triangles, drawn half outside the last panel
    fig.tight_layout(rect=(0, 0.32 * rows_of_legend / fig.get_figheight(), 0.985, 1))
    return fig


def _peaks_panel(ax, df: pd.DataFrame, vary: str):
    """improvement_figure's upper row: the two peaks the ratio divides, ÷ the final KV, with 1x and 2x dotted."""
    rows = series(measured(df), vary)
    several = rows["preset"].nunique() > 1
    for (cache, loop), colour, marker in ((BASELINE, "tab:blue", "o"), (FIXED, "tab:orange", "s")):
        for preset, line in rows[(rows["cache"] == cache) & (rows["loop"] == loop)].groupby("preset", sort=False):
            ax.plot(
                line[vary],
                line["overhead_bytes"] / line["kv_final_bytes"],
                "-",
                marker=marker,
                markersize=7,
                fillstyle="none",
                markeredgewidth=1.5,
                color=colour,
                label=f"{cache} / {loop} ({preset})" if several else f"{cache} / {loop}",
            )
            predicted = line["predicted_overhead_bytes"] / line["kv_final_bytes"]
            if predicted.notna().all():
                ax.plot(line[vary], predicted, "--", color="black", linewidth=0.8, zorder=4)
    for multiple in (1, 2):
        ax.axhline(multiple, color="grey", linestyle=":", linewidth=1.2, zorder=1)
    top = (rows["overhead_bytes"] / rows["kv_final_bytes"]).max()
    ax.set_ylim(0, max(2.4, top * 1.08))
