"""Appendix A4's figure and terms: what is live at each design's peak, and the big terms of the first two steps."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from ..helpers import MIB

CATEGORY_COLORS = {
    "kv": "tab:blue",
    "logits": "tab:orange",
    "other": "tab:green",
    "kernels": "tab:gray",
}  # at the peak, weights aside


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


def two_fixes_terms(config, cache: str, loop: str, batch: int, prompt: int, dtype: str) -> dict:
    """The big terms of the first two steps (bytes) at a logits point, from the loop's description alone: step 0
    (the prompt's forward) holds the prompt's KV and, before v5, every prompt position's logits (twice in bf16:
    the model's dtype and the fp32 upcast); step 1 holds the cache (twice for the tuple round trip) and, under
    v4.40, the prompt's fp32 logits kept from step 0. Notebook 02 sets them beside the measured peaks."""
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
