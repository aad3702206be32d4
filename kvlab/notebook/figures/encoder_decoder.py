"""Appendix A10's figures and check, also used by appendix A7: one line per stream mode, and what kvlab refuses."""

from __future__ import annotations

import inspect

import pandas as pd

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
