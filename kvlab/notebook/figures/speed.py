"""Appendix A2's figure: every timed run, tokens/s and the ratio to a baseline."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from ..helpers import WIDTH


def speed_figure(runs: pd.DataFrame, title: str, baseline: str = "dynamic"):
    """Appendix A2: every timed run of one length (`runs`: kvlab.timing.speed_runs' rows), tokens/s on the
    left (from zero), the ratio to `baseline`'s run of the same round on the right (around 1); a dot per run, a red
    tick at the median, so the spread of the repeats is seen next to the differences between contenders. The
    baseline's own row on the right is its reference line alone (every ratio of it is 1), labelled."""
    from ...timing import spread, with_ratios

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
