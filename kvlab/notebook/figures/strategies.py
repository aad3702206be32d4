"""Lesson 04's figures: each decoding strategy's overhead per design, beside the real releases' (section 2), and a
second generate() call that starts from the held cache (section 3); appendix A6's beam search step by step."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from matplotlib.lines import Line2D

from ..helpers import MIB
from .torch_cat import plot_timelines

DESIGN_COLOURS = {"tuple/v4.40": "tab:red", "tuple/v4.42": "tab:orange", "dynamic/v4.40": "tab:purple"}
DESIGN_COLOURS["dynamic/v4.42"] = "tab:blue"


def strategies_figure(overhead: dict, real: dict, release_of: dict, names: dict, kv_final: dict, setup: str):
    """One message: PR #30536 leaves one cache at the peak of every strategy. Bars: overhead / final KV by
    (strategy, design) in `overhead`, for the designs the releases ran (`release_of`: version -> design; other
    designs in `overhead` are not drawn); a diamond where that release's own generate() measured the same point
    (`real`: (strategy, version) -> ratio). The title gives each strategy's ratios and final KV (`kv_final`:
    strategy -> bytes); `setup` goes under it."""
    before, after = release_of.values()
    strategies = list(dict.fromkeys(s for s, _ in overhead))
    missing = [(s, d) for s in strategies for d in (before, after) if (s, d) not in overhead or s not in kv_final]
    if missing:
        raise ValueError(f"strategies_figure: no overhead or final KV for {missing}")
    drawn = {key: x for key, x in overhead.items() if key[1] in (before, after)}
    bars = pd.Series(drawn).rename_axis(["strategy", "design"]).rename("x").reset_index()
    fig, ax = plt.subplots(figsize=(9, 4.8))
    colours = {d: DESIGN_COLOURS[d] for d in (before, after)}
    sns.barplot(data=bars.replace({"strategy": names}), x="strategy", y="x", hue="design", palette=colours, ax=ax)
    for container in ax.containers:
        ax.bar_label(container, fmt="%.2f", fontsize=9, padding=5)
    hues = list(dict.fromkeys(bars["design"]))
    for version, design in release_of.items():  # a diamond on the bar of the design the release ran
        for patch, strategy in zip(ax.containers[hues.index(design)], strategies):
            if (strategy, version) in real:
                middle = patch.get_x() + patch.get_width() / 2
                ax.plot(middle, real[strategy, version], "D", color="black", markerfacecolor="white", zorder=5)
    if real:
        versions = " / ".join(release_of)
        ax.plot([], [], "D", color="black", markerfacecolor="white", label=f"real {versions} generate()")
    for multiple in (1, 2, 3):
        ax.axhline(multiple, color="black", linestyle=":", linewidth=1, zorder=0)
    ax.set(xlabel="decoding strategy", ylabel="overhead / final KV (×)", ylim=(0, 3.5))
    ratios = ", ".join(f"{names[s]} {overhead[s, before]:.2f}× → {overhead[s, after]:.2f}×" for s in strategies)
    by_size = {}  # strategies that share a final KV (greedy and sampling) are named together
    for s in strategies:
        by_size.setdefault(kv_final[s], []).append(names[s])
    sizes = "; ".join(f"{size / MIB:.1f} MiB ({', '.join(who)})" for size, who in by_size.items())
    title = f"PR #30536 leaves one cache at the peak of every strategy\n{before} → {after}: {ratios}"
    title += f"\nfinal KV: {sizes}\n{setup}"
    ax.set_title(title, fontsize=10)
    ax.legend(title=None, fontsize=9, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    fig.tight_layout()
    return fig


def restart_figure(reports: dict, overheads: dict, checks: dict, kv_bytes: int, second_call: int, setup: str):
    """One message: the caller that keeps 4.42's default (tuples returned) still holds about twice the final KV once
    a second generate() call starts (at step `second_call`, a grey line). `plot_timelines`' panels, one per caller
    (`reports`); each panel says its overhead / final KV (`overheads`) and, where measured, the real release's
    (`checks`: caller -> line). The title gives the last caller's overhead; `setup` goes under it."""
    last = list(reports)[-1]
    title = f"Restart: 4.42's default caller (tuples returned) still holds {overheads[last]:.2f}× the final KV\n{setup}"
    fig = plot_timelines(reports, kv_bytes=kv_bytes, multiples=(1, 2, 3), title=title)
    for ax, name in zip(fig.axes, reports):
        ax.axvline(second_call - 0.5, color="grey", linewidth=2, alpha=0.5)
        check = f"\n{checks[name]}" if name in checks else ""
        ax.text(0.97, 0.06, f"peak: {overheads[name]:.2f}× final KV{check}", transform=ax.transAxes, ha="right")
    handles, labels = fig.axes[0].get_legend_handles_labels()
    handles.append(Line2D([], [], color="grey", linewidth=2, alpha=0.5))
    labels.append("the 2nd call starts")
    fig.legends[0].remove()  # plot_timelines' legend, drawn again with the grey line
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    return fig


BEAM_PANELS = ("tuple/v4.40", "tuple/v4.42", "dynamic/v4.40", "dynamic/v4.42")  # the PR's caches by its loops


def beam_figure(reports: dict, overheads: dict, kv_bytes: int, setup: str):
    """One message: in beam search the tuple holds 3x then 2x the final KV at its peak, one cache object about 1x.
    `plot_timelines`' four panels (`reports`: "cache/loop" -> MemoryReport, `BEAM_PANELS` each) against 1, 2 and 3
    `kv_bytes`; the title gives each design's overhead / final KV (`overheads`, same keys) to 2 decimals, as the
    lessons print them, over two lines; `setup` goes under it."""
    missing = [name for name in BEAM_PANELS if name not in reports or name not in overheads]
    if missing:
        raise ValueError(f"beam_figure: no report or overhead for {missing}")
    x = {name: f"{overheads[name]:.2f}×" for name in BEAM_PANELS}
    if x["dynamic/v4.40"] == x["dynamic/v4.42"]:
        one_object = f"{x['dynamic/v4.42']} under either"
    else:
        one_object = f"{x['dynamic/v4.40']} under ≤ 4.41's, {x['dynamic/v4.42']} under 4.42's"
    title = (
        f"Peak above the weights in beam search: the tuple {x['tuple/v4.40']} the final KV under ≤ 4.41's loop,\n"
        f"{x['tuple/v4.42']} under 4.42's; one cache object {one_object}\n{setup}"
    )
    return plot_timelines({name: reports[name] for name in BEAM_PANELS}, kv_bytes, title, multiples=(1, 2, 3))
