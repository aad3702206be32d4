"""Appendix A2's figure: every timed run's ratio to a baseline's run of the same round."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns


def speed_verdict(table: pd.DataFrame, baseline: str) -> str:
    """What the rounds tell apart (`table`: kvlab.timing.spread's rows of one length, by contender): the contenders
    faster or slower than `baseline` in every round, or that none is, with the span of every ratio."""
    others = table.drop(index=baseline)
    faster = list(others.index[others["ratio_min"] > 1])
    slower = list(others.index[others["ratio_max"] < 1])
    span = f"{others['ratio_min'].min():.2f}–{others['ratio_max'].max():.2f}×"
    if not faster and not slower:
        return f"no contender is told apart from {baseline}: every one's ratio crosses 1 (rounds span {span})"
    told = [f"{', '.join(names)} {word} in every round" for names, word in ((faster, "faster"), (slower, "slower"))]
    return f"against {baseline}, " + "; ".join(t for t, names in zip(told, (faster, slower)) if names) + f" ({span})"


def speed_figure(runs: pd.DataFrame, setup: str, baseline: str = "dynamic"):
    """One message: whether the rounds tell any contender apart from `baseline` (`speed_verdict`, the title). For
    every timed run of one length (`runs`: kvlab.timing.speed_runs' rows), its tokens/s divided by `baseline`'s
    run of the same round: a dot per run, a red tick at each contender's median, the baseline a line at 1.
    `setup` (the run's sizes) goes under the title."""
    from ...timing import spread, with_ratios

    if runs["new"].nunique() != 1:
        raise ValueError(f"speed_figure draws one length; runs has {sorted(runs['new'].unique())} new tokens")
    table = spread(runs, baseline).reset_index().set_index("contender")
    others = with_ratios(runs, baseline).query("contender != @baseline")
    order = list(dict.fromkeys(others["contender"]))
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(order) + 1.9))
    sns.stripplot(others, y="contender", x="ratio", order=order, color="black", size=6, jitter=0.12, ax=ax)
    ax.scatter(table.loc[order, "ratio_median"], range(len(order)), marker="|", s=900, linewidths=2.5, color="tab:red")
    ax.axvline(1, color="black", linewidth=1, zorder=1)
    low, high = others["ratio"].min(), others["ratio"].max()
    ax.set_xlim(min(0.9, low - 0.05), max(1.1, high + 0.05))
    ax.set(ylabel="", xlabel=f"tokens/s ÷ {baseline}'s run of the same round (×; the line: {baseline} = 1)")
    ax.legend(
        [
            plt.Line2D([], [], marker="o", color="black", linestyle=""),
            plt.Line2D([], [], marker="|", color="tab:red", linestyle="", markersize=14, markeredgewidth=2.5),
        ],
        ["one round", "median"],
        fontsize=9,
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
    )
    rounds = runs["repeat"].nunique()
    verdict = speed_verdict(table, baseline)
    ax.set_title(f"{rounds} rounds on this machine: {verdict}\n{setup}", fontsize=10)
    fig.tight_layout()
    return fig
