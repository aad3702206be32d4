"""Appendix A4's figures: today's loop with every cache (section 4); the PR's two fixes, each design's peak in step 1,
and the big terms of the first two steps (who holds what at each design's peak is lesson 02's figure, in torch_cat)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from matplotlib.lines import Line2D

from ..helpers import MIB

TODAY_COLOURS = ["tab:blue", "tab:green", "tab:brown", "tab:purple"]  # today's caches, in the order drawn


def _same_live(reports: dict, kv_final: int) -> dict:
    """Each design whose live line is an earlier design's (within 0.5 % of the final KV at every step) -> that
    design: drawn, its line would hide the earlier one."""
    lines = {
        name: pd.DataFrame(report.timeline)["live_bytes"].to_numpy() / kv_final for name, report in reports.items()
    }
    same = {}
    for i, (name, live) in enumerate(lines.items()):
        for earlier in list(lines)[:i]:
            if earlier not in same and len(lines[earlier]) == len(live) and abs(lines[earlier] - live).max() < 0.005:
                same[name] = earlier
                break
    return same


def today_caches_figure(reports: dict, overheads: dict, kv_final: int, setup: str):
    """Section 4's figure, one message: under today's loop (v5) every cache peaks near one final KV. Per design
    (`reports`: MemoryReports, `overheads`: overhead / final KV) the live bytes at each step's end (wide, pale) and
    the peak inside the step (dashed), in units of the final KV, step 0's peak circled. A design whose live line is
    an earlier one's (`_same_live`) is not drawn: the legend gives its overhead and says so. The title gives the
    range of every design's overhead; `setup` goes under it."""
    fig, ax = plt.subplots(figsize=(9, 4.8))
    handles, low, high = [], 0.5, 1.2
    hidden = _same_live(reports, kv_final)
    drawn = [name for name in reports if name not in hidden]
    for name, colour in zip(drawn, TODAY_COLOURS):
        steps = pd.DataFrame(reports[name].timeline)
        live, peak = steps["live_bytes"] / kv_final, steps["peak_bytes"] / kv_final
        ax.plot(steps["step"], live, color=colour, linewidth=2.4, alpha=0.4)
        ax.plot(steps["step"], peak, color=colour, linewidth=1.3, linestyle=(0, (4, 2)))
        ax.plot(0, peak[0], "o", color=colour, mfc="white", markersize=5, zorder=6)
        handles.append(Line2D([], [], color=colour, linewidth=2, label=f"{name}: peak {overheads[name]:.2f}×"))
        low, high = min(low, live.min() - 0.05), max(high, peak.max() + 0.05)
    for name, other in hidden.items():
        label = f"{name}: peak {overheads[name]:.2f}× (same line as {other})"
        handles.append(Line2D([], [], linestyle="", label=label))
    ax.axhline(1, color="black", linewidth=1.1, linestyle=":", zorder=10)  # on top: static's live line is at 1×
    handles += [
        Line2D([], [], color="gray", linewidth=2.4, alpha=0.4, label="live at the step's end"),
        Line2D([], [], color="gray", linewidth=1.3, linestyle=(0, (4, 2)), label="peak inside the step"),
        Line2D([], [], color="gray", marker="o", mfc="white", linestyle="", label="step 0's peak (the prompt's)"),
        Line2D([], [], color="black", linewidth=1.1, linestyle=":", label="1× final KV"),
    ]
    ax.set_ylim(low, high)
    ax.set(xlabel="decoding step (0 = the prompt's forward)", ylabel="above the weights and inputs (× final KV)")
    values = [overheads[name] for name in reports]
    ax.set_title(
        f"Today's loop (v5): every cache peaks at {min(values):.2f}–{max(values):.2f}× the final KV\n{setup}",
        fontsize=10,
    )
    ax.legend(handles=handles, fontsize=8.5, loc="lower right", ncol=2)
    fig.tight_layout()
    return fig


def plot_two_fixes(step1: pd.Series, kv_step1: int, note: str, setup: str):
    """Section 5's figure, one message: each of the PR's two fixes alone lowers step 1 (the first token fed back).
    Bars: each design's peak inside step 1 (`step1`: MiB by cache/loop, the four 4.x pairs named as in DESIGNS),
    with 1x and 2x the KV at step 1 (`kv_step1`, bytes) as lines; `note` (what step 0 holds, not drawn) under the
    bars. The title gives the four pairs' step-1 peaks; `setup` goes under it."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    sns.barplot(x=step1.to_numpy(), y=list(step1.index), color="tab:red", ax=ax)
    ax.bar_label(ax.containers[0], fmt="%.2f MiB", fontsize=9, padding=4)
    for multiple, style in ((1, ":"), (2, "--")):
        x = multiple * kv_step1 / MIB
        ax.axvline(x, color="black", linestyle=style, linewidth=1.3, zorder=5, label=f"{multiple}× KV at step 1")
    ax.set_xlim(0, step1.max() * 1.2)
    ax.set(xlabel=f"peak inside step 1, above the weights and inputs (MiB)\n{note}", ylabel="cache/loop")
    before, logits_fix, cache_fix, both = (
        step1[d] for d in ("tuple/v4.40", "tuple/v4.42", "dynamic/v4.40", "dynamic/v4.42")
    )
    ax.set_title(
        f"Each fix alone lowers step 1: {before:.2f} → {logits_fix:.2f} MiB (the logits fix, tuple/v4.42) or "
        f"{cache_fix:.2f} MiB (the cache fix, dynamic/v4.40); both: {both:.2f} MiB\n{setup}",
        fontsize=10,
    )
    ax.legend(fontsize=9, loc="lower right")
    fig.tight_layout()
    return fig


def two_fixes_terms(config, cache: str, loop: str, batch: int, prompt: int, dtype: str) -> dict:
    """The big terms of the first two steps (bytes) at a logits point, from the loop's description alone: step 0
    (the prompt's forward) holds the prompt's KV and, before v5, every prompt position's logits (twice in bf16:
    the model's dtype and the fp32 upcast); step 1 holds the cache (twice for the tuple round trip) and, under
    v4.40, the prompt's fp32 logits kept from step 0. Appendix A4 sets them beside the measured peaks."""
    from ...loops import LOOPS
    from ...models import element_size, kv_bytes_per_token

    release = LOOPS[loop]
    fp32_logits = batch * prompt * config.vocab_size * 4
    logits = batch * prompt * config.vocab_size * element_size(dtype) + (fp32_logits if element_size(dtype) != 4 else 0)
    per_token = kv_bytes_per_token(config, batch, dtype)
    return {
        "step 0: KV + prompt logits": per_token * prompt + (0 if release.major == 5 else logits),
        "step 1: KV (x2 for tuple) + kept logits": (2 if cache == "tuple" else 1) * per_token * (prompt + 1)
        + (fp32_logits if release.keeps_previous_outputs else 0),
    }
