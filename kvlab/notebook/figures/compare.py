"""The main job's figures (`python -m kvlab compare`): each design's overhead beside kvlab.theory's, and the
overhead against each varied size, which appendix A5 draws too, from a results table as lesson 03 reads it."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from ... import schema
from ..helpers import MIB
from .analysis import AXIS_NAMES, figure_legend, held_sizes, measured, series

DESIGN_LABELS = [f"{cache} / {loop}" for cache, loop in schema.DESIGNS]  # "cache / loop", in DESIGNS order
MARKERS = "osD^vPX*"
GROUP_GAP = 0.1  # ratios at the largest size closer than this read as one level in the title
SAME_LINE = 0.015  # two lines closer than this at every point are drawn on each other: the legend says so
LOG_SPAN = 8  # a size that spans this factor or more is drawn on a log axis, its points spread evenly


def overhead_message(rows: pd.DataFrame, vary: str) -> str:
    """What a series says, from its measured ratios (`rows`: `series` rows with `measured_x`, `loop`): how the
    ratios move with `vary` (none moves by 0.01x, none rises, none falls, or, some each way, the one that moves
    most: the only mover where every other design holds within `GROUP_GAP`), then the designs at the largest
    `vary` in groups of near-equal ratios (no gap of `GROUP_GAP` inside a group), highest first."""
    if rows["preset"].nunique() > 1:  # one line per preset and design
        rows = rows.assign(design=rows["design"] + " (" + rows["preset"] + ")")
    lines = {design: line.sort_values(vary) for design, line in rows.groupby("design", sort=False)}
    ends = {design: line.iloc[[0, -1]] for design, line in lines.items() if len(line) > 1}  # its first and last
    moves = [end["measured_x"].iloc[1] - end["measured_x"].iloc[0] for end in ends.values()]
    axis = AXIS_NAMES[vary].split(" (")[0]
    ratio = "peak above the weights ÷ final KV"
    if not moves or max(map(abs, moves)) < 0.01:
        trend = f"{ratio} does not change with {axis}\n"
    elif max(moves) < 0.01:
        trend = f"{ratio} falls or holds with {axis} for every design\n"
    elif min(moves) > -0.01:
        trend = f"{ratio} rises or holds with {axis} for every design\n"
    else:  # some rise, some fall: the one that moves most, against how little the others do
        moved = {design: abs(end["measured_x"].iloc[1] - end["measured_x"].iloc[0]) for design, end in ends.items()}
        most = max(moved, key=moved.get)
        rest = max((move for design, move in moved.items() if design != most), default=0)
        (a, b), (x, y) = ends[most][vary], ends[most]["measured_x"]
        span = f"{x:.2f}× at {a} → {y:.2f}× at {b}"
        if rest < GROUP_GAP:  # the others hold one level: the mover is the series' one message, the title's alone
            return f"Only {most}'s peak ÷ final KV moves with {axis}: {span} (the others within {rest:.2f}×)"
        else:
            trend = f"{ratio} rises for some designs and falls for others with {axis}; most: {most}, {span}\n"
    top = rows[vary].max()
    at_top = rows[rows[vary] == top].sort_values("measured_x", ascending=False)
    gaps = at_top["measured_x"].diff().abs().fillna(0)
    groups = [group for _, group in at_top.groupby((gaps >= GROUP_GAP).cumsum(), sort=True)]
    named = ", ".join(f"{_group_name(group, at_top, len(groups))} {_ratio_span(group)}" for group in groups)
    message = f"{trend}at {axis} {top}: {named}"
    return message[0].upper() + message[1:]


def _group_name(group: pd.DataFrame, at_top: pd.DataFrame, n_groups: int) -> str:
    """A group of designs by what they share: every design of one loop, every other design (the largest of
    several groups), every design (the only group), else the designs by name."""
    loops = set(group["loop"])
    if len(group) > 1 and len(loops) == 1 and len(at_top[at_top["loop"].isin(loops)]) == len(group):
        return f"every {loops.pop()} design"
    if len(group) > 1 and n_groups == 1:
        return "every design"
    if len(group) > 1 and len(group) > len(at_top) / 2:
        return "every other design"
    return " and ".join(group["design"])


def _ratio_span(group: pd.DataFrame) -> str:
    """The group's ratio, or its range where its designs differ at two decimals."""
    low, high = f"{group['measured_x'].min():.2f}", f"{group['measured_x'].max():.2f}"
    return f"{low}×" if low == high else f"{low}–{high}×"


def _ratios(df: pd.DataFrame, vary: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The series over `vary` with its measured and predicted overhead ÷ final KV (`measured_x`, `theory_x`), split
    into the designs measured at two or more of its points (lines) and those measured at one point only."""
    rows = series(measured(df), vary)
    rows = rows.assign(
        measured_x=rows["overhead_bytes"] / rows["kv_final_bytes"],
        theory_x=rows["predicted_overhead_bytes"] / rows["kv_final_bytes"],
    )
    points = rows.groupby(["preset", "design"])[vary].transform("nunique")
    return rows[points > 1], rows[points == 1]


def one_point_note(df: pd.DataFrame, vary: str = "new") -> str:
    """The designs `overhead_figure` leaves out, measured at a single point of the series (a point adds nothing to
    how a ratio moves), each with its ratio; empty where there is none."""
    _, single = _ratios(df, vary)
    if single.empty:
        return ""
    several = single["preset"].nunique() > 1
    axis = AXIS_NAMES[vary].split(" (")[0]
    named = ", ".join(
        f"{row['design']}{f' ({row.preset})' if several else ''} {row['measured_x']:.2f}× at {axis} {row[vary]}"
        for _, row in single.iterrows()
    )
    return f"Measured at one point of the series only, so not drawn: {named}"


def overhead_figure(df: pd.DataFrame, vary: str = "new", today_only: bool = False):
    """Peak above the weights ÷ final KV against one size, in two panels so that no design hides another: the
    PR's comparison (the loops of v4.40 and v4.42: the tuple cache on 2x, one cache object near 1x, y from zero)
    and today's loop with every design (v5: all near 1x, the y axis zoomed so that they separate). Measured:
    markers on a line; kvlab.theory: a thin black dash over each. Each design keeps its colour and marker in every
    figure; designs measured at a single point are left out (`one_point_note` names them). `today_only`: the
    v5 panel alone. The title: `overhead_message`, then the sizes held."""
    rows, _ = _ratios(df, vary)
    rows = rows[rows["loop"] == "v5"] if today_only else rows
    if rows.empty:
        raise ValueError(f"overhead_figure: no design measured at two or more {AXIS_NAMES[vary]}")
    several = rows["preset"].nunique() > 1
    panels = [
        ("before and after the PR (loops v4.40, v4.42)", rows[rows["loop"] != "v5"]),
        ("today's loop (v5), every design (y zoomed)", rows[rows["loop"] == "v5"]),
    ]
    panels = [(name, part) for name, part in panels if not part.empty]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.9 * len(panels), 4.6), squeeze=False)
    designs = DESIGN_LABELS + sorted(set(rows["design"]) - set(DESIGN_LABELS))
    # tab10 without its grey, which reads as kvlab.theory's black dashes and the grey reference lines
    palette = [colour for i, colour in enumerate(sns.color_palette("tab10")) if i != 7]
    colours = {design: palette[i % len(palette)] for i, design in enumerate(designs)}
    for ax, (name, part) in zip(axes[0], panels):
        drawn = {}
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
                label=_on_line(label, line.set_index(vary)["measured_x"], drawn),
            )
            if line["theory_x"].notna().all():
                ax.plot(line[vary], line["theory_x"], "--", color="black", linewidth=0.8, zorder=4)
        ax.plot([], [], "--", color="black", linewidth=0.8, label="kvlab.theory (predicted)")
        ax.plot([], [], ":", color="grey", linewidth=1.2, label="1× and 2× the final KV")
        for multiple in (1, 2):
            ax.axhline(multiple, color="grey", linestyle=":", linewidth=1.2, zorder=1)
        if part["loop"].eq("v5").all():
            shown = part[["measured_x", "theory_x"]]
            low, high = shown.min().min(), shown.max().max()
            ax.set_ylim(min(0.98, low - 0.01), high + 0.25 * (high - min(0.98, low)) + 0.01)
        else:
            ax.set_ylim(0, max(2.2, part["measured_x"].max() * 1.08))
        ax.set(xlabel=AXIS_NAMES[vary], title=name)
        _size_axis(ax, rows[vary])
    for ax in axes[0]:  # every panel: its y range differs from the other's
        ax.set_ylabel("peak above the weights ÷ final KV (×)")
    figure_legend(fig, axes[0], ncol=3)
    first = rows.iloc[0]
    fig.suptitle(
        f"{overhead_message(rows, vary)}\n{first['preset']} {first['dtype']} on {first['device']}, "
        f"{held_sizes(first, vary)}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.05 * -(-len(fig.legends[0].get_texts()) // 3), 1, 1))
    return fig


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


def _on_line(label: str, line: pd.Series, drawn: dict) -> str:
    """`label`, saying "on X's line" where an earlier line of the panel, X, is within SAME_LINE of it at every
    point (one hides the other); `drawn` collects the panel's lines."""
    other = next(
        (
            name
            for name, earlier in drawn.items()
            if earlier.index.equals(line.index) and (earlier - line).abs().max() < SAME_LINE
        ),
        None,
    )
    drawn[label] = line
    return label if other is None else f"{label} (on {other}'s line)"


def _size_axis(ax, sizes: pd.Series) -> None:
    """The size axis: linear from 0, or, where the sizes span LOG_SPAN or more, logarithmic with a tick at each."""
    values = sorted(set(sizes))
    if values[0] > 0 and values[-1] / values[0] >= LOG_SPAN:
        ax.set_xscale("log")
        ax.set_xticks(values, [str(v) for v in values])
        ax.minorticks_off()
    else:
        ax.set_xlim(0, None)
