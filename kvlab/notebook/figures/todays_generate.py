"""Lesson 05's figures: what fills the peak of transformers' own generate() (a kvlab.waste table), and how the
cache grows with the tokens seen."""

from __future__ import annotations

from collections.abc import Iterable

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


def _waste_label(row, with_kv: bool) -> str:
    design = {"": "greedy, DynamicCache", "cache_implementation=static": "greedy, StaticCache"}.get(row["generate"])
    if design is None:
        design = f"beam search, {row['generate']}" if "num_beams" in row["generate"] else row["generate"]
    window = f" ({row['overrides']})" if row["overrides"] else ""
    kv = f"; final KV {row['final'] / MIB:.1f} MiB" if with_kv else ""
    return f"{row['preset']}{window}: {design}, prompt {row['prompt']}, {row['new']} new{kv}"


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


def waste_figure(table: pd.DataFrame, left_out: Iterable[str] = ()):
    """One message: at the peak of transformers' own generate(), above the weights, the cache and a sliver, in
    units of the final KV (the dashed line). Per point of a `kvlab.waste` table, two non-negative parts
    (`waste_parts`), labelled with the total and the largest waste term; a bar whose cache is not yet written at
    the peak says so. The points named in `left_out` are not drawn (the caller says why). The title gives the
    final KV in MiB where the drawn points share one; else each point's label does."""
    left_out = set(left_out)
    unknown = left_out - set(table["point"])
    if unknown:
        raise ValueError(f"left_out names points the table lacks: {sorted(unknown)}")
    parts = waste_parts(table)
    parts = parts[~parts.index.isin(left_out)]
    if parts.empty:
        raise ValueError("waste_figure: every point is left out")
    needed, waste = parts["needed"] / parts["final"], parts["waste"] / parts["final"]
    totals = needed + waste
    one_kv = parts["final"].nunique() == 1
    fig, ax = plt.subplots(figsize=(9, 0.9 * len(parts) + 1.6))
    y = list(range(len(parts)))
    ax.barh(y, needed, color="0.65", height=0.45, label="the cache (at most the final KV) and one step's activations")
    ax.barh(y, waste, left=needed, color="tab:red", height=0.45, label="everything else alive")
    for i, (name, row) in enumerate(parts.iterrows()):
        label = _waste_label(row, with_kv=not one_kv)
        ax.text(0.02, i - 0.3, label, fontsize=8, va="bottom", bbox=dict(color="white", pad=0.5))
        what = f", of which {waste[name]:.2f} × {_largest_name(row)}" if row["largest"] else ""
        # Inside the grey bar, at its end: the axis stops just past the longest bar, so the red slivers stay visible.
        inside = needed[name] > 0.6
        x, ha = (needed[name] - 0.02, "right") if inside else (totals[name] + 0.02, "left")
        ax.text(x, i, f"{totals[name]:.2f} ×{what}", ha=ha, va="center", fontsize=9)
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
    ax.set_ylim(low, -1.2)  # room above the first bar for the legend
    ax.set_xlim(0, 1.08 * totals.max())
    unit = "the final KV" if one_kv else "each point's final KV"
    ax.set_xlabel(f"alive at the peak above the weights and the inputs, × {unit} (dashed: 1 ×)")
    first = parts.iloc[0]
    presets = " and ".join(dict.fromkeys(parts["preset"]))
    kv = f" of {first['final'] / MIB:.1f} MiB" if one_kv else ""
    ax.set_title(
        f"transformers {_version()}'s generate() holds {totals.min():.2f}–{totals.max():.2f} × the "
        f"final KV{kv} at its peak\n({presets}, {first['dtype']}, batch {first['batch']}, CPU)",
        fontsize=10,
    )
    ax.legend(loc="upper right", fontsize=8, framealpha=1)
    ax.grid(axis="y", visible=False)
    fig.tight_layout()
    return fig


def _version() -> str:
    import transformers

    return transformers.__version__


def _window_summary(preset: str, overrides: str, rows: pd.DataFrame) -> str:
    """A sliding model as a title says it: its sliding layers, window, and the cache at its last point (MiB and
    the share of what it would hold with every layer full)."""
    from ...caches import sliding_windows

    windows = sliding_windows(build_config(preset, overrides.split()))
    sliding = [w for w in windows if w is not None]
    last = rows.iloc[-1]
    share = last["cache_storage_bytes"] / last["full_cache_bytes"]
    return (
        f"{preset} ({len(sliding)} of {len(windows)} layers slide, W={max(sliding)}) "
        f"{last['cache_storage_bytes'] / MIB:.2f} MiB ({share:.0%} of full)"
    )


def cache_growth_figure(growth: pd.DataFrame, setup: str = ""):
    """One message: a sliding-window cache stops growing at its window. The storage under transformers'
    DynamicCache against the tokens seen, one solid line per model that has a sliding layer, and what the same
    model would hold with every layer full (dotted), drawn from where its window is reached (marked): before it
    the two are one line. A model with no sliding layer is left out. The title says each model's cache at the
    last point; `setup` (the run's sizes) goes under it."""
    fig, ax = plt.subplots(figsize=(9, 4.8))
    overrides = growth["overrides"].fillna("")
    names = growth["preset"] + overrides.map(lambda o: f" ({o})" if o else "")
    sliding = [
        n
        for n, rows in growth.groupby(names, sort=False)
        if (rows["full_cache_bytes"] != rows["cache_storage_bytes"]).any()
    ]
    if not sliding:
        raise ValueError("cache_growth_figure needs a model with a sliding layer; the table has none")
    colours = dict(zip(sliding, sns.color_palette("tab10")[1:]))
    summaries = []
    for name, rows in growth.groupby(names, sort=False):
        if name not in colours:
            continue
        colour = colours[name]
        summaries.append(_window_summary(rows["preset"].iloc[0], overrides[rows.index[0]], rows))
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
    last = growth["tokens"].max()
    ax.set_title(
        f"Sliding-window caches stop growing at the window; after {last} tokens:\n"
        + ";\n".join(summaries)
        + (f"\n{setup}" if setup else ""),
        fontsize=10,
    )
    ax.legend(fontsize=9, loc="upper left")
    fig.tight_layout()
    return fig
