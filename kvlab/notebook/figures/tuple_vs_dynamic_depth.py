"""Appendix A4's figure and terms of the PR's two fixes: each design's peak in the first two steps, and the big terms
of those steps (who holds what at each design's peak is lesson 02's figure, in torch_cat)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from ..helpers import MIB

REFERENCE_STYLES = [(":", "black"), ("--", "black"), ("-.", "tab:orange")]  # the two-fixes figure's lines, in order


def plot_two_fixes(steps: pd.DataFrame, references: dict, title: str = ""):
    """Section 5's figure: each design's peak in step 0 and step 1 (`steps`: MiB, a column per step, a row per
    cache/loop) as grouped horizontal bars, with `references` (label -> bytes: three, 1x and 2x KV and the prompt's
    logits) as vertical lines over them, styled in REFERENCE_STYLES' order."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    long = steps.reset_index().melt(id_vars="cache/loop", var_name="step", value_name="MiB")
    sns.barplot(data=long, y="cache/loop", x="MiB", hue="step", palette=["tab:gray", "tab:red"], ax=ax)
    for (label, x), (style, color) in zip(references.items(), REFERENCE_STYLES, strict=True):
        ax.axvline(x / MIB, color=color, linestyle=style, linewidth=1.3, zorder=5, label=label)
    ax.set_xlabel("peak inside the step, above the weights and inputs (MiB)")
    ax.set_title(title, fontsize=10)
    ax.legend(title=None, fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, frameon=False)
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
