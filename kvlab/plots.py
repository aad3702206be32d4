"""The figures. Each function takes a results table (one record per row) and returns a Figure."""

from __future__ import annotations



import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

MIB = 2**20


def compare_figure(df: pd.DataFrame):
    """Measured overhead above the weights per design, with the analytic prediction and 1x / 2x KV."""
    df = df.assign(design=df["cache"] + " / " + df["pattern"],
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
    ax.set_xlabel("peak memory above the weights (MiB)")
    ax.set_ylabel("cache / reference pattern")
    ax.set_title(f"{first['preset']} {first['dtype']} on {first['device']}: batch {first['batch']}, "
                 f"prompt {first['prompt']}, {first['new']} new tokens")
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig
