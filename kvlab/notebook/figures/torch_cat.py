"""Lessons 01 and 02's figures: each design's live bytes and peak, step by step (MiB above the weights), with the
final KV's multiples drawn over them (01; also 04, A4, A6); and who holds the bytes live at each design's peak,
from the meter's split of it (02; also A4)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.ticker import MaxNLocator

from ..helpers import MIB, WIDTH

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


# Who holds the bytes live at a peak (the weights aside), from MemoryReport.at_peak and previous_kv_bytes, and the
# colour each is drawn in.
HOLDERS = {
    "cache from earlier steps, still held": "tab:red",
    "cache made in the peak's step": "tab:blue",
    "logits": "tab:orange",
    "activations and the rest": "tab:green",
    "inside kernels": "tab:gray",
}


def holders_at_peak(report) -> dict[str, int]:
    """The bytes live at `report`'s peak above the weights, by holder (HOLDERS' order): the meter's `kv` split into
    the storages made before the peak's step began and those made in it; `logits`; `other`; `kernels`."""
    if report.previous_kv_bytes is None:
        raise ValueError("this report does not split its peak: measure with track_storages (the default on CPU)")
    parts = report.at_peak
    earlier = report.previous_kv_bytes
    values = (earlier, parts["kv"] - earlier, parts["logits"], parts["other"], parts.get("kernels", 0))
    return dict(zip(HOLDERS, values))


def plot_holders(reports: dict, kv_bytes: int | None = None, title: str = "", smallest: float = 0.005):
    """One stacked horizontal bar per design: who holds the bytes live at its peak (MiB, weights aside); `kv_bytes`:
    black lines at one and two of it. A holder nowhere wider than `smallest` of the widest bar would be an invisible
    bar with a legend entry: it is left out, its largest value (if any) written under the axis. Segments wide
    enough carry their MiB. Returns the figure and the table drawn (MiB, every holder)."""
    table = pd.DataFrame({name: holders_at_peak(report) for name, report in reports.items()}).T / MIB
    widest = table.sum(axis=1).max()
    shown = [holder for holder in HOLDERS if table[holder].max() >= smallest * widest]
    height = 0.55 * len(table) + 2.4
    fig, ax = plt.subplots(figsize=(WIDTH, height))
    table[shown].plot.barh(stacked=True, color=HOLDERS, width=0.6, ax=ax, legend=False)
    for bars in ax.containers:
        labels = [f"{bar.get_width():.1f}" if bar.get_width() >= 0.08 * widest else "" for bar in bars]
        ax.bar_label(bars, labels=labels, label_type="center", color="white", fontsize=9)
    for multiple in (1, 2) if kv_bytes else ():
        ax.axvline(
            multiple * kv_bytes / MIB,
            color="black",
            linestyle=KV_LINE_STYLES[multiple],
            linewidth=1,
            label=f"{multiple}× final KV",
        )
    ax.invert_yaxis()
    small = [f"{h}, at most {table[h].max() * 1024:.0f} KiB" for h in HOLDERS if h not in shown and table[h].max()]
    xlabel = "bytes live at the design's peak, above the weights (MiB)"
    ax.set(xlabel=xlabel + (f"\n(too small to draw: {'; '.join(small)})" if small else ""), ylabel="")
    ax.set_title(title, fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.45 / height, 1, 1))
    return fig, table
