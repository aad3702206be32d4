"""Lesson 05's figures: what fills the peak of transformers' own generate() (a kvlab.waste table), and how the
cache grows with the tokens seen."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from ...configs import build_config
from ..helpers import MIB

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
    from ...caches import sliding_windows

    config = build_config(row["preset"], row["overrides"].split())
    kind = "sliding-window mask" if any(sliding_windows(config)) else "attention mask"
    per_pair = row["largest_bytes"] / (row["batch"] * row["prompt"] ** 2)
    batch = f"{row['batch']} × " if row["batch"] > 1 else ""
    return f"the {kind}s, {per_pair:g} bytes per query-key pair × {batch}{row['prompt']}²"


def _waste_message(waste: pd.Series) -> str:
    """The waste figure's one message, from its bars (waste ÷ final KV per point): the most any point wastes
    at its peak beside the cache, but the one that wastes most, named apart."""
    worst = waste.idxmax()
    rest = waste.drop(worst)
    if rest.empty:
        return f"At its peak, {worst} holds {waste[worst]:.2f} × the final KV beside the cache"
    return (
        f"At the peak, waste beside the cache is at most {rest.max():.2f} × the final KV, "
        f"except in {worst} ({waste[worst]:.2f} ×)"
    )


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
        f"{_waste_message(waste)}\ntransformers {_version()}'s generate() on twins, {first['dtype']}, "
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
