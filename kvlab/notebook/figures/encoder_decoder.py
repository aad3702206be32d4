"""Appendix A10's figures and check, also used by appendix A7: one line per stream mode, the reused cache's trade-off,
and what kvlab refuses."""

from __future__ import annotations

import inspect

import matplotlib.pyplot as plt
import pandas as pd

from ..helpers import MIB

# Appendix A10's stream modes (kvlab.encdec.serve.MODES): one colour, marker and dash each, in every figure.
MODE_STYLES = {
    "hf-static": ("tab:red", "o", None),
    "reused": ("tab:blue", "s", (5, 3)),
    "reused-max": ("tab:purple", "^", (1, 2)),
    "dynamic": ("tab:green", "D", (3, 1, 1, 1)),
}


def mode_lines(ax, df: pd.DataFrame, x: str, y: str, legend: bool = True, merge_identical: bool = False):
    """One line per stream mode of `df` (column `mode`), in MODES' order: its colour, dash and a hollow marker
    that shrinks from mode to mode, so that modes whose lines coincide all stay visible. `merge_identical`: modes
    whose `y` equals an earlier mode's at every `x` are drawn once, in the earlier mode's style, labelled
    "earlier = later". `legend=False` leaves the legend to the caller (one for a figure of several panels:
    `ax.get_legend_handles_labels()`)."""
    present = [mode for mode in MODE_STYLES if mode in set(df["mode"])]
    lines = {mode: df[df["mode"] == mode].sort_values(x) for mode in present}
    groups = {}  # first mode -> the modes drawn as its line
    for mode in present:
        same = (
            first
            for first in groups
            if merge_identical
            and lines[first][x].tolist() == lines[mode][x].tolist()
            and lines[first][y].tolist() == lines[mode][y].tolist()
        )
        groups.setdefault(next(same, mode), []).append(mode)
    for mode, group in groups.items():
        line = lines[mode]
        color, marker, dashes = MODE_STYLES[mode]
        style = {"dashes": dashes} if dashes else {"linestyle": "-"}
        ax.plot(
            line[x],
            line[y],
            color=color,
            marker=marker,
            markersize=11 - 2 * present.index(mode),
            fillstyle="none",
            markeredgewidth=1.5,
            linewidth=1.5,
            label=" = ".join(group),
            **style,
        )
    ax.set_xlabel(x)
    if legend:
        ax.legend(title="mode", loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9)
    return ax


def _mib(values: pd.Series) -> str:
    """A span of MiB as a title says it: one value where they differ by under 5 %, else the lowest to the highest."""
    low, high = values.min() / MIB, values.max() / MIB
    return f"{high:.3g}" if high - low < 0.05 * high else f"{low:.3g}–{high:.3g}"


def reuse_figure(results: pd.DataFrame, setup: str, merge_held: bool = False):
    """One message, the reused cache's trade-off: `reused` holds more than `hf-static` at every request's peak
    (left) but allocates its cache storage once (right, cumulative). `results`: kvlab.encdec.serve rows of every
    mode (request, mode, request_shape, footprint_bytes, new_cache_bytes). Lines that coincide on the right are
    drawn once (on the left too with `merge_held`), the panel says which; one legend; `setup` under the title."""
    missing = {"reused", "hf-static"} - set(results["mode"])
    if missing:
        raise ValueError(f"reuse_figure compares reused with hf-static; the results lack {sorted(missing)}")
    ordered = results.sort_values(["mode", "request"]).assign(
        footprint_mib=lambda d: d["footprint_bytes"] / MIB,
        new_cache_mib=lambda d: d.groupby("mode")["new_cache_bytes"].cumsum() / MIB,
    )
    shapes = results.drop_duplicates("request").set_index("request")["request_shape"]
    fig, (held, allocated) = plt.subplots(1, 2, figsize=(10, 4.8), layout="constrained")
    mode_lines(held, ordered, x="request", y="footprint_mib", legend=False, merge_identical=merge_held)
    mode_lines(allocated, ordered, x="request", y="new_cache_mib", legend=False, merge_identical=True)
    merged = [label for label in allocated.get_legend_handles_labels()[1] if " = " in label]
    for ax, y, side, label in (
        (held, "footprint_mib", "the cost: more held at every peak", "footprint at the request's peak (MiB)"),
        (allocated, "new_cache_mib", "the gain: allocated once", "cache storage allocated so far (MiB)"),
    ):
        ax.set_ylim(0, 1.1 * ordered[y].max())  # the highest markers whole
        ax.set_title(side, fontsize=10)
        ax.set_ylabel(label)
        ax.set_xticks(shapes.index, [f"{i}\n{s}" for i, s in shapes.items()], fontsize=8)
        ax.set_xlabel("request (batch × encoder positions)")
    if merged:
        allocated.text(0.02, 0.97, "drawn once: " + "; ".join(merged), transform=allocated.transAxes, va="top")
    footprint = results.pivot_table(index="request", columns="mode", values="footprint_bytes")
    total = results.groupby("mode")["new_cache_bytes"].sum()
    more = _mib(footprint["reused"] - footprint["hf-static"])
    once, spread = _mib(total[["reused"]]), _mib(total[["hf-static"]])
    fig.suptitle(
        f"One reused cache trades memory held for memory allocated: {more} MiB more than hf-static at every "
        f"request's peak,\nfor {once} MiB allocated once instead of {spread} MiB over {len(shapes)} requests"
        f"\n{setup}",
        fontsize=11,
    )
    fig.legend(*held.get_legend_handles_labels(), loc="outside lower center", ncol=4, fontsize=9)
    return fig


def kvlab_refusal(call) -> str:
    """Run `call`, which kvlab must refuse: the ValueError it raised and the kvlab module that raised it. A
    ValueError raised elsewhere (by transformers: not kvlab's refusal) is raised again; no error is an error."""
    try:
        call()
    except ValueError as error:
        raised_in = inspect.trace(0)[-1].frame.f_globals["__name__"]  # the innermost frame: where it was raised
        if not raised_in.startswith("kvlab."):
            raise
        return f"ValueError from {raised_in}: {error}"
    raise AssertionError("kvlab accepted what it should refuse")
