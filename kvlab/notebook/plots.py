"""The figures the notebooks share: per-step timelines and what is live at the peak, the PR's benchmark plots
redrawn from a results table (`kvlab.lab.store.load_results`), the main job's bars, and notebook 06's stream
modes. Measured: solid lines; kvlab.theory: thin black dashes over them. At most WIDTH inches wide."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from matplotlib.ticker import MaxNLocator

from .. import schema, theory
from ..configs import build_config
from .helpers import MIB

SIZES = ("new", "batch", "prompt")
AXIS_NAMES = {"new": "new tokens", "batch": "batch size", "prompt": "prompt length (tokens)"}
DESIGN_LABELS = [f"{cache} / {loop}" for cache, loop in schema.DESIGNS]  # "cache / loop", in DESIGNS order
MARKERS = "osD^vPX*"
# Before and after PR #30536, as released: the ratio the PR reports.
BASELINE, FIXED = ("tuple", "v4.40"), ("dynamic", "v4.42")
WIDTH = 10  # inches: ≈ 1000 px at the notebooks' 100 dpi, the most a notebook shows without shrinking labels
CATEGORY_COLORS = {
    "kv": "tab:blue",
    "logits": "tab:orange",
    "other": "tab:green",
    "kernels": "tab:gray",
}  # at the peak, weights aside
KV_LINE_STYLES = {1: ":", 2: "--", 3: "-."}
EQUAL_PEAK = 0.005  # a timeline panel's peak within 0.5 % of its live line at every step: "peak = live"


def plot_timelines(
    reports: dict,
    kv_bytes: int | None = None,
    title: str = "",
    ylabel: str = "memory above the weights (MiB)",
    kv_label: str = "final KV",
    xlabel: str = "decoding step (0 = the prompt's forward)",
    multiples=(1, 2),
):
    """One panel per design: live bytes at each step's end and the peak inside the step (MiB), y from zero;
    `kv_bytes`: black lines at `multiples` of it, over the data, so a line on a reference is seen to be.
    A panel whose peak equals its live line at every step (within EQUAL_PEAK) says so in its top left and draws
    the peak thicker, above the references, its dashes offset from the others'. At most 3 panels a row (2 for 4
    designs). matplotlib, not seaborn's relplot: the series differ in marker and width; one legend holds the
    references."""
    ncols = 2 if len(reports) == 4 else min(len(reports), 3)
    nrows = -(-len(reports) // ncols)
    height = 2.7 * nrows + 0.9
    fig, axes = plt.subplots(nrows, ncols, figsize=(WIDTH, height), sharey=True, squeeze=False)
    for ax, (name, report) in zip(axes.flat, reports.items()):
        steps = pd.DataFrame(report.timeline)
        live, peak = steps["live_bytes"] / MIB, steps["peak_bytes"] / MIB
        equal = bool(((peak - live).abs() <= EQUAL_PEAK * live.abs()).all())
        # Live underneath and thick, the peak dashed on top, the gap shaded: where a design's peak equals what
        # stays live (one cache object), both lines still show.
        ax.plot(steps["step"], live, color="tab:blue", linewidth=2.6, zorder=2, label="live at the step's end")
        ax.fill_between(steps["step"], live, peak, color="tab:red", alpha=0.15, linewidth=0, zorder=1)
        ax.plot(
            steps["step"],
            peak,
            color="tab:red",
            linestyle=(3, (4, 3)) if equal else (0, (3, 2)),
            linewidth=2.2 if equal else 1.4,
            zorder=5 if equal else 3,
            label="peak inside the step",
        )
        if equal:
            ax.text(0.03, 0.95, "peak = live at every step", transform=ax.transAxes, va="top", fontsize=9)
        for multiple in multiples if kv_bytes else ():
            ax.axhline(
                multiple * kv_bytes / MIB,
                color="black",
                linestyle=KV_LINE_STYLES.get(multiple, ":"),
                linewidth=1,
                zorder=4,
                label=f"{multiple}× {kv_label}",
            )
        ax.set_title(name, fontsize=10)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.flat[0].set_ylim(bottom=0)  # after every panel is drawn: the shared axis then fits the highest
    for ax in axes.flat[len(reports) :]:
        ax.set_visible(False)
    for ax in axes.flat[len(reports) - ncols : len(reports)]:  # the lowest panel of each column
        ax.set_xlabel(xlabel)
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.5 / height, 1, 1))
    return fig


def plot_at_peak(reports: dict, title: str = "", smallest: float = 0.005):
    """Stacked horizontal bars (pandas): what was live at each design's peak besides the weights (MiB). A category
    that is nowhere wider than `smallest` of the widest bar would be an invisible bar with a legend entry: it is
    left out of the bars and the legend, and its largest value is written in the x label. The legend sits to the
    right of the bars, over no data."""
    df = pd.DataFrame(
        {name: {c: report.at_peak.get(c, 0) / MIB for c in CATEGORY_COLORS} for name, report in reports.items()}
    ).T
    visible = [c for c in CATEGORY_COLORS if df[c].max() >= smallest * df.sum(axis=1).max()]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(df) + 1.8))
    df[visible].plot.barh(stacked=True, color=CATEGORY_COLORS, width=0.8, ax=ax)
    ax.invert_yaxis()
    small = [f"{c}, at most {df[c].max() * 1024:.0f} KiB" for c in CATEGORY_COLORS if c not in visible]
    xlabel = "bytes live at the peak (MiB), weights excluded"
    ax.set(xlabel=xlabel + (f"\n(too small to draw: {'; '.join(small)})" if small else ""), ylabel="cache/loop")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9, frameon=False)
    fig.tight_layout()
    return fig, df.round(3)


def measured(df: pd.DataFrame) -> pd.DataFrame:
    """The points that ran (status ok), with a `design` column ("cache / loop")."""
    df = df[df["status"] == "ok"] if "status" in df else df
    return df.assign(design=df["cache"] + " / " + df["loop"])


def _config(row):
    return build_config(row["preset"], [item for item in row["overrides"].split(",") if item])


def refresh_predictions(df: pd.DataFrame) -> pd.DataFrame:
    """`predicted_overhead_bytes` from the installed kvlab.theory, the recorded one kept as
    `recorded_prediction_bytes`: a prediction is a function of the parameters, so it follows the theory as it
    improves without measuring again."""

    def predict(row):
        return theory.predict_overhead(_config(row), **{key: row[key] for key in theory.POINT_KEYS if key in row})

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


def _held(row, vary: str) -> str:
    """The sizes a series holds fixed, as in "batch size 1, prompt length 300"."""
    return ", ".join(f"{AXIS_NAMES[size].split(' (')[0]} {row[size]}" for size in SIZES if size != vary)


def overhead_figure(df: pd.DataFrame, vary: str = "new"):
    """Peak above the weights ÷ final KV against one size, in two panels so that no design hides another: the
    PR's comparison (the loops of v4.40 and v4.42: the tuple cache on 2x, one cache object near 1x, y from zero)
    and today's loop with every design (v5: all near 1x, the y axis zoomed so that they separate). Measured:
    markers on a line; kvlab.theory: a thin black dash over each."""
    rows = series(measured(df), vary)
    rows = rows.assign(
        measured_x=rows["overhead_bytes"] / rows["kv_final_bytes"],
        theory_x=rows["predicted_overhead_bytes"] / rows["kv_final_bytes"],
    )
    several = rows["preset"].nunique() > 1
    panels = [
        ("before and after the PR (loops v4.40, v4.42)", rows[rows["loop"] != "v5"]),
        ("today's loop (v5), every design (y zoomed)", rows[rows["loop"] == "v5"]),
    ]
    panels = [(name, part) for name, part in panels if not part.empty]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.9 * len(panels), 4.3), squeeze=False)
    designs = [d for d in DESIGN_LABELS if d in set(rows["design"])] + sorted(set(rows["design"]) - set(DESIGN_LABELS))
    colours = dict(zip(designs, sns.color_palette("tab10", len(designs))))
    for ax, (name, part) in zip(axes[0], panels):
        # Hollow markers that shrink from line to line: where designs coincide, each stays visible inside the last.
        for i, ((preset, design), line) in enumerate(part.groupby(["preset", "design"], sort=False)):
            label = f"{design} ({preset})" if several else design
            ax.plot(
                line[vary],
                line["measured_x"],
                "-",
                marker=MARKERS[designs.index(design) % len(MARKERS)],
                markersize=max(11 - 2 * i, 4),
                fillstyle="none",
                markeredgewidth=1.5,
                color=colours[design],
                label=label,
            )
            if line["theory_x"].notna().all():
                ax.plot(line[vary], line["theory_x"], "--", color="black", linewidth=0.8, zorder=4)
        ax.plot([], [], "--", color="black", linewidth=0.8, label="kvlab.theory")
        for multiple in (1, 2):
            ax.axhline(multiple, color="grey", linestyle=":", linewidth=1.2, zorder=1)
        if part["loop"].eq("v5").all():
            low, high = part[["measured_x", "theory_x"]].min().min(), part[["measured_x", "theory_x"]].max().max()
            ax.set_ylim(min(0.98, low - 0.01), high + 0.25 * (high - min(0.98, low)) + 0.01)
        else:
            ax.set_ylim(0, max(2.2, part["measured_x"].max() * 1.08))
        ax.set(xlim=(0, None), xlabel=AXIS_NAMES[vary], title=name)
    axes[0][0].set_ylabel("peak above the weights ÷ final KV (x)")
    _figure_legend(fig, axes[0], ncol=4)
    first = rows.iloc[0]
    fig.suptitle(
        f"Peak against {AXIS_NAMES[vary]}, in final KV caches: {first['preset']} {first['dtype']} "
        f"on {first['device']}, {_held(first, vary)}",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.055 * -(-len(fig.legends[0].get_texts()) // 4), 1, 1))
    return fig


def _figure_legend(fig, axes, ncol: int, extra=()):
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
        axes[0][column].set_title(_held(table.iloc[0], vary), fontsize=10)
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
    legend = _figure_legend(fig, axes.flat, ncol=columns, extra=extra)
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


def compare_figure(df: pd.DataFrame):
    """Measured overhead above the weights per design, with the analytic prediction and 1x / 2x KV."""
    df = measured(df).assign(measured=df["overhead_bytes"] / MIB, predicted=df["predicted_overhead_bytes"] / MIB)
    kv = df["kv_final_bytes"].iloc[0] / MIB
    fig, ax = plt.subplots(figsize=(8, 4))
    sns.barplot(data=df, y="design", x="measured", color="tab:blue", ax=ax, label="measured")
    ax.scatter(df["predicted"], range(len(df)), color="black", marker="|", s=300, zorder=3, label="kvlab.theory")
    for multiple in (1, 2):
        ax.axvline(multiple * kv, color="grey", linestyle="--", linewidth=1)
        ax.text(
            multiple * kv,
            0.01,
            f" {multiple}x KV",
            ha="left",
            va="bottom",
            color="grey",
            fontsize=8,
            transform=ax.get_xaxis_transform(),
        )
    first = df.iloc[0]
    ax.set(
        xlabel="peak memory above the weights (MiB)",
        ylabel="cache / loop",
        title=f"{first['preset']} {first['dtype']} on {first['device']}: batch {first['batch']}, "
        f"prompt {first['prompt']}, {first['new']} new tokens",
    )
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


# Notebook 06's stream modes (kvlab.encdec.serve.MODES): one colour, marker and dash each, in every figure.
MODE_STYLES = {
    "hf-static": ("tab:red", "o", None),
    "reused": ("tab:blue", "s", (5, 3)),
    "reused-max": ("tab:purple", "^", (1, 2)),
    "dynamic": ("tab:green", "D", (3, 1, 1, 1)),
}


def mode_lines(ax, df: pd.DataFrame, x: str, y: str, legend: bool = True, merge_identical: bool = False):
    """One line per stream mode of `df` (column `mode`), in MODES' order: its colour, dash and a hollow marker
    that shrinks from mode to mode, so that modes whose lines coincide all stay visible. `merge_identical`: modes
    whose `y` equals an earlier mode's at every `x` are drawn once, in the earlier mode's style, labelled
    "earlier = later". `legend=False` leaves the legend to the caller (one for a figure of several panels:
    `ax.get_legend_handles_labels()`)."""
    present = [mode for mode in MODE_STYLES if mode in set(df["mode"])]
    lines = {mode: df[df["mode"] == mode].sort_values(x) for mode in present}
    groups = {}  # first mode -> the modes drawn as its line
    for mode in present:
        same = (
            first
            for first in groups
            if merge_identical
            and lines[first][x].tolist() == lines[mode][x].tolist()
            and lines[first][y].tolist() == lines[mode][y].tolist()
        )
        groups.setdefault(next(same, mode), []).append(mode)
    for mode, group in groups.items():
        line = lines[mode]
        color, marker, dashes = MODE_STYLES[mode]
        style = {"dashes": dashes} if dashes else {"linestyle": "-"}
        ax.plot(
            line[x],
            line[y],
            color=color,
            marker=marker,
            markersize=11 - 2 * present.index(mode),
            fillstyle="none",
            markeredgewidth=1.5,
            linewidth=1.5,
            label=" = ".join(group),
            **style,
        )
    ax.set_xlabel(x)
    if legend:
        ax.legend(title="mode", loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9)
    return ax


# What a kvlab.waste table's terms are called in a figure's labels (the table's own names are longer).
WASTE_NAMES = {
    "the cache update's cat output": "the cat: one layer held twice",
    "the cache update's index_select output": "the beam reorder: one layer held twice",
    "activations above one step's": "the prompt's forward",
    "storage the cache's tensors do not show": "views of longer buffers",
}
MASK_TERM = "the attention mask"


def waste_parts(table: pd.DataFrame) -> pd.DataFrame:
    """Per point of a `kvlab.waste` table, what is alive at the peak above the weights, in bytes, in two
    non-negative parts: `needed` (the cache's keys and values at that moment, at most the final KV, and one
    step's activations) and `waste` (every other term: the cache update's op output, storage the cache's tensors
    do not show, the attention mask, activations above one step's, cache beyond the final one); with `final` (the
    final KV), `largest` (the largest waste term's name), `largest_bytes`, `chunked` (the peak above the weights
    with generate()'s `prefill_chunk_size`, where measured) and the point's sizes."""
    rows = []
    for name, point in table.groupby("point", sort=False):
        terms = point[point["kind"].isin(["baseline", "term"])].set_index("term")["bytes"]
        final, weights = terms["final KV"], terms["weights"]
        beyond = terms.get("cache tensors beyond the final KV", 0)
        waste = {k: v for k, v in terms.items() if point.set_index("term").loc[k, "kind"] == "term" and v > 0}
        fix = point[(point["kind"] == "fix") & (point["term"] == "chunked-prefill")]["bytes"]
        first = point.iloc[0]
        largest = max(waste, key=waste.get) if waste else ""
        rows.append(
            dict(
                point=name,
                needed=final + min(beyond, 0) + terms["one step's activations"],
                waste=sum(waste.values()),
                final=final,
                largest=largest,
                largest_bytes=waste.get(largest, 0),
                chunked=fix.item() - weights if len(fix) else None,
                **{k: first[k] for k in ("preset", "overrides", "generate", "prompt", "new", "dtype", "batch")},
            )
        )
    return pd.DataFrame(rows).set_index("point")


def _waste_label(row) -> str:
    design = {"": "greedy, DynamicCache", "cache_implementation=static": "greedy, StaticCache"}.get(row["generate"])
    if design is None:
        design = f"beam search, {row['generate']}" if "num_beams" in row["generate"] else row["generate"]
    window = f" ({row['overrides']})" if row["overrides"] else ""
    return f"{row['preset']}{window}: {design}, prompt {row['prompt']}, {row['new']} new"


def _largest_name(row) -> str:
    """The largest waste term as a figure says it: the masks by their size, bytes per query-key pair × batch ×
    prompt² (one per bool mask alive, plus the element size of SDPA's float copy where the peak is inside SDPA)."""
    if row["largest"] != MASK_TERM:
        return WASTE_NAMES.get(row["largest"], row["largest"])
    from ..caches import sliding_windows

    config = build_config(row["preset"], row["overrides"].split())
    kind = "sliding-window mask" if any(sliding_windows(config)) else "attention mask"
    per_pair = row["largest_bytes"] / (row["batch"] * row["prompt"] ** 2)
    batch = f"{row['batch']} × " if row["batch"] > 1 else ""
    return f"the {kind}s, {per_pair:g} bytes per query-key pair × {batch}{row['prompt']}²"


def _times(ratio: float) -> str:
    """A share of the final KV: two decimals, or a percentage under 0.1 ×."""
    return f"{100 * ratio:.1f} % of final KV" if ratio < 0.1 else f"{ratio:.2f} ×"


def waste_figure(table: pd.DataFrame):
    """One message: at the peak of transformers' own generate(), above the weights, the cache's keys and values
    written by then (and one step's activations) next to what else is alive, per point of a `kvlab.waste` table,
    in units of the point's final KV (the dashed line). Two non-negative parts per bar (`waste_parts`), each bar
    labelled with its total and its largest waste term; a bar whose cache is not yet written at the peak says so;
    a diamond at the peak with generate()'s `prefill_chunk_size`."""
    parts = waste_parts(table)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    y = list(range(len(parts)))
    needed, waste = parts["needed"] / parts["final"], parts["waste"] / parts["final"]
    ax.barh(y, needed, color="0.65", height=0.45, label="the cache written by the peak + one step's activations")
    ax.barh(y, waste, left=needed, color="tab:red", height=0.45, label="waste: everything else alive at the peak")
    chunked = (parts["chunked"] / parts["final"]).dropna()
    ax.plot(
        chunked,
        [list(parts.index).index(p) for p in chunked.index],
        "D",
        markersize=9,
        markerfacecolor="white",
        markeredgecolor="black",
        markeredgewidth=1.5,
        linestyle="none",
        label="peak with generate(..., prefill_chunk_size=32)",
    )
    right = max(max(needed + waste) * 1.05, 3.8)  # room for a short bar's label
    for i, (name, row) in enumerate(parts.iterrows()):
        total = needed[name] + waste[name]
        ax.text(0.02, i - 0.3, _waste_label(row), fontsize=8, va="bottom", bbox=dict(color="white", pad=0.5))
        what = f"waste {_times(waste[name])}: {_largest_name(row)}" if row["largest"] else ""
        inside = total > right / 2  # a long bar carries its label inside, in white
        ax.text(
            total - 0.05 if inside else total + 0.05,
            i,
            f"{total:.2f} ×   {what}" if not inside else f"{what}   {total:.2f} ×",
            va="center",
            ha="right" if inside else "left",
            color="white" if inside else "black",
            fontsize=9,
        )
        if needed[name] < 0.5:  # the peak comes before the cache is written: the prompt's forward
            ax.annotate(
                f"grey, {needed[name]:.2f} ×: no cache yet, the peak is the prompt's forward",
                (needed[name] / 2, i + 0.225),
                xytext=(12, -12),
                textcoords="offset points",
                va="top",
                fontsize=8,
                bbox=dict(color="white", pad=1),
                arrowprops=dict(arrowstyle="-|>", color="0.2", shrinkA=0, shrinkB=0),
                zorder=5,
            )
    ax.axvline(1, color="black", linestyle="--", linewidth=1)
    ax.set_yticks(y, list(parts.index))
    low = len(parts) - 0.5 + 0.45 * (needed < 0.5).iloc[-1]  # room under the last bar for its note
    ax.set_ylim(low, -1.5)  # room above the first bar for the legend
    ax.set_xlim(0, right)
    ax.set_xlabel("overhead / final KV (× KV): alive at the peak above the weights and the inputs; dashed: 1 ×")
    first = parts.iloc[0]
    ax.set_title(
        f"What fills the peak of transformers {_version()}'s generate(): twins, {first['dtype']}, "
        f"batch {first['batch']}, CPU",
        fontsize=10,
    )
    ax.legend(loc="upper right", fontsize=8, framealpha=1)
    ax.grid(axis="y", visible=False)
    fig.tight_layout()
    return fig


def _version() -> str:
    import transformers

    return transformers.__version__


def cache_growth_figure(growth: pd.DataFrame, title: str = ""):
    """The storage under transformers' DynamicCache against the tokens seen, one solid line per model that has a
    sliding layer, and what the same model would hold with every layer full (dotted), drawn from where its sliding
    layers' window is reached (marked): before it the two are one line. A model with no sliding layer (its line
    would be its own dotted one) is left out. MiB from zero; the legend names the models once, and the dotted
    style once."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = growth["preset"] + growth["overrides"].fillna("").map(lambda o: f" ({o})" if o else "")
    sliding = [
        n
        for n, rows in growth.groupby(names, sort=False)
        if (rows["full_cache_bytes"] != rows["cache_storage_bytes"]).any()
    ]
    colours = dict(zip(sliding, sns.color_palette("tab10")[1:]))
    for name, rows in growth.groupby(names, sort=False):
        if name not in colours:
            continue
        colour = colours[name]
        leaves = rows[rows["cache_storage_bytes"] == rows["full_cache_bytes"]].iloc[-1]  # the last point on it
        after = rows[rows["tokens"] >= leaves["tokens"]]
        ax.plot(after["tokens"], after["full_cache_bytes"] / MIB, ":", color=colour, linewidth=1.5)
        ax.plot(rows["tokens"], rows["cache_storage_bytes"] / MIB, color=colour, linewidth=2, label=name)
        ax.plot(leaves["tokens"], leaves["cache_storage_bytes"] / MIB, "o", color=colour, markersize=7)
        ax.annotate(
            f"window reached ({leaves['tokens']} tokens)",
            (leaves["tokens"], leaves["cache_storage_bytes"] / MIB),
            xytext=(8, -14),
            textcoords="offset points",
            fontsize=9,
            color=colour,
        )
    ax.plot([], [], ":", color="0.3", linewidth=1.5, label="dotted: the same model with every layer full")
    ax.set(xlim=(0, None), ylim=(0, None), xlabel="tokens seen (prompt + generated)", ylabel="cache storage (MiB)")
    ax.set_title(title or f"transformers {_version()}'s DynamicCache against the tokens seen", fontsize=10)
    ax.legend(fontsize=9, loc="upper left")
    fig.tight_layout()
    return fig


def speed_figure(runs: pd.DataFrame, title: str, baseline: str = "dynamic"):
    """Appendix A2: every timed run of one length (`runs`: kvlab.timing.speed_runs' rows), tokens/s on the
    left (from zero), the ratio to `baseline`'s run of the same round on the right (around 1); a dot per run, a red
    tick at the median, so the spread of the repeats is seen next to the differences between contenders. The
    baseline's own row on the right is its reference line alone (every ratio of it is 1), labelled."""
    from ..timing import spread, with_ratios

    table = spread(runs, baseline).reset_index().set_index("contender")
    runs = with_ratios(runs, baseline)
    order = list(dict.fromkeys(runs["contender"]))
    others = runs[runs["contender"] != baseline]
    fig, (speed, ratio) = plt.subplots(1, 2, figsize=(WIDTH, 0.55 * len(order) + 1.9), sharey=True)
    for ax, data, column, median in (
        (speed, runs, "tokens_per_s", "median"),
        (ratio, others, "ratio", "ratio_median"),
    ):
        sns.stripplot(
            data, y="contender", x=column, order=order, color="black", size=6, jitter=0.12, ax=ax, legend=False
        )
        shown = [c for c in order if c in set(data["contender"])]
        ax.scatter(
            table.loc[shown, median],
            [order.index(c) for c in shown],
            marker="|",
            s=900,
            linewidths=2.5,
            color="tab:red",
            zorder=4,
        )
        ax.set(ylabel="")
    ratio.axvline(1, color="black", linewidth=1, zorder=1)
    ratio.annotate(
        f"{baseline} = 1 ×",
        (1, order.index(baseline)),
        xytext=(6, 0),
        textcoords="offset points",
        va="center",
        fontsize=9,
    )
    low, high = others["ratio"].min(), others["ratio"].max()
    ratio.set_xlim(min(0.9, low - 0.05), max(1.1, high + 0.05))
    speed.set_xlim(0, runs["tokens_per_s"].max() * 1.1)
    speed.set_xlabel("generated tokens per second (every run)")
    ratio.set_xlabel(f"÷ {baseline}'s run of the same round (x)")
    speed.legend(
        [
            plt.Line2D([], [], marker="o", color="black", linestyle=""),
            plt.Line2D([], [], marker="|", color="tab:red", linestyle="", markersize=14, markeredgewidth=2.5),
        ],
        ["one run", "median"],
        fontsize=9,
        loc="lower left",
    )
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def fit_figure(prediction: dict, title: str = ""):
    """Lesson 08: each design's predicted peak (GiB) as weights, final KV and the rest of the overhead stacked, the
    memory budget as a vertical line. A KV-only planner's answer is the first two parts; the third is what it
    misses. Designs in the prediction's order, the first on top."""
    gib = 2**30
    rows = prediction["designs"]
    labels = [f"{row['cache']} / {row['loop']}" for row in rows]
    weights = prediction["weights_bytes"] / gib
    kv = [row["kv_final_bytes"] / gib for row in rows]
    rest = [max(0.0, (row["predicted_overhead_bytes"] - row["kv_final_bytes"]) / gib) for row in rows]
    fig, ax = plt.subplots(figsize=(WIDTH, 0.45 * len(rows) + 1.6))
    y = range(len(rows))[::-1]
    ax.barh(y, [weights] * len(rows), color="0.75", label="weights")
    ax.barh(y, kv, left=weights, color=CATEGORY_COLORS["kv"], label="final KV (a KV-only planner stops here)")
    ax.barh(y, rest, left=[weights + k for k in kv], color="tab:red", label="peak − weights − final KV")
    if prediction["memory_bytes"]:
        ax.axvline(prediction["memory_bytes"] / gib, color="black", linewidth=1.5, label="memory budget")
    ax.set_yticks(list(y), labels)
    ax.set_xlabel("predicted peak (GiB)")
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18 - 0.02 * len(rows)), ncol=4, frameon=False)
    fig.tight_layout()
    return fig


def plan_widget(
    preset: str, batch: int = 8, prompt: int = 4096, new: int = 512, dtype: str = "bfloat16", memory: str = "80GiB"
):
    """Lesson 08, live: sliders for the batch, the prompt and the new tokens, starting at the notebook's parameters,
    a box for the memory; each change predicts again (kvlab.lab.predict) and redraws the figure. Needs a running
    kernel (Jupyter, Colab)."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    from ..lab.predict import predict

    def draw(batch, prompt, new, memory):
        result = predict(preset, batch=batch, prompt=prompt, new=new, dtype=dtype, memory=memory)
        fit_figure(result, title=f"{preset}, {dtype}: batch {batch}, prompt {prompt}, {new} new, budget {memory}")
        plt.show()

    def slider(value: int, top: int):
        return widgets.IntSlider(value=value, min=1, max=max(top, value), continuous_update=False)

    return widgets.interact(
        draw,
        batch=slider(batch, 256),
        prompt=slider(prompt, 131072),
        new=slider(new, 32768),
        memory=widgets.Text(value=memory, continuous_update=False),
    )
