"""Small helpers the notebooks share: a bytes-written counter, tables and figures (the measurements themselves
come from kvlab.lab.point and kvlab.meter)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch
from matplotlib.ticker import MaxNLocator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MIB = 2**20
CATEGORY_COLORS = {"weights": "tab:gray", "kv": "tab:blue", "logits": "tab:orange", "other": "tab:green"}
NO_WRITE = ("empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like")


class BytesWritten(TorchDispatchMode):
    """Sum of the bytes every aten op writes while active (our own: torch's counters count flops, not bytes).

    An op's output is a fresh tensor (written in full: `cat`, `clone`), an input it modified in place (`copy_`,
    `out=`: that tensor's or view's bytes) or a view (`slice`: nothing written); the op's schema says which.
    """

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in NO_WRITE:
            return out
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        written = sum(leaf.numel() * leaf.element_size() for ret, value in zip(func._schema.returns, outputs)
                      if ret.alias_info is None or ret.alias_info.is_write  # else a view: no bytes move
                      for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor))
        if written:
            self.bytes += written
            name = func.overloadpacket.__name__
            self.by_op[name] = self.by_op.get(name, 0) + written
        return out


def summary_table(records: list[dict], extra: tuple[str, ...] = ()) -> pd.DataFrame:
    """The record fields a reader needs, bytes shown in MiB, one row per measured point (speed only for
    points that were timed: `timing=False` leaves `tokens_per_s` empty)."""
    df = pd.DataFrame(records)
    table = df[[key for key in ("cache", "loop", *extra) if key in df]].assign(
        KV_MiB=(df["kv_final_bytes"] / MIB).round(2), peak_above_weights_MiB=(df["overhead_bytes"] / MIB).round(2),
        **{"peak/KV": df["overhead_over_kv"].round(3)})
    if df["tokens_per_s"].notna().any():
        table["tokens/s (unmetered)"] = pd.to_numeric(df["tokens_per_s"]).round(1)
    return table


def step_peaks(reports: dict, step: int) -> pd.Series:
    """Peak inside one decoding step (MiB) for each labelled report."""
    return pd.Series({name: report.timeline[step].peak_bytes / MIB for name, report in reports.items()},
                     name=f"peak in step {step} (MiB)")


def set_theme():
    """One look for every notebook's figures (seaborn's whitegrid, tab10 colours)."""
    sns.set_theme(style="whitegrid", palette="tab10", context="notebook", font_scale=0.85)


def device_label(device: str) -> str:
    """The one way notebooks name their device: the processor or GPU model, then the torch device."""
    from ..lab.point import device_name

    return f"{device_name(device)} ({device})"


def plot_timelines(reports: dict, kv_bytes: int | None = None, title: str = "", ncols: int | None = None,
                   ylabel: str = "memory above the weights (MiB)", kv_label: str = "final KV",
                   xlabel: str = "decoding step (0 = the prompt's forward)", multiples=(1, 2)):
    """One panel per design: live bytes at each step's end and the peak inside the step (MiB), y from zero;
    `kv_bytes`: black lines at `multiples` of it, over the data, so a line on a reference is seen to be.
    matplotlib, not seaborn's relplot: the series differ in marker and width; one legend holds the references."""
    names = list(reports)
    ncols = ncols or min(len(names), 4)
    nrows = -(-len(names) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 3.0 * nrows + 0.6), sharey=True, squeeze=False)
    styles = {1: ":", 2: "--", 3: "-."}
    for ax, name in zip(axes.flat, names):
        timeline = reports[name].timeline
        steps = [s.step for s in timeline]
        ax.plot(steps, [s.peak_bytes / MIB for s in timeline], color="tab:red", marker=".", markersize=3,
                linewidth=1.2, label="peak inside the step")
        ax.plot(steps, [s.live_bytes / MIB for s in timeline], color="tab:blue", linewidth=1.6,
                label="live at the step's end")
        for multiple in multiples if kv_bytes else ():
            ax.axhline(multiple * kv_bytes / MIB, color="black", linestyle=styles.get(multiple, ":"), linewidth=1,
                       zorder=4, label=f"{multiple}x {kv_label}")
        ax.set_title(name, fontsize=10)
        ax.set(xlabel=xlabel, ylim=(0, None))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def plot_at_peak(reports: dict, title: str = "", include_weights: bool = False):
    """Stacked horizontal bars (pandas): what was live at each design's peak, by category (MiB)."""
    categories = ["weights", "kv", "logits", "other"] if include_weights else ["kv", "logits", "other"]
    df = pd.DataFrame({name: {c: report.at_peak.get(c, 0) / MIB for c in categories}
                       for name, report in reports.items()}).T
    ax = df.plot.barh(stacked=True, color=CATEGORY_COLORS, width=0.8, figsize=(8, 0.5 * len(df) + 1.4))
    ax.invert_yaxis()
    ax.set(xlabel="bytes live at the peak (MiB)" + ("" if include_weights else ", weights excluded"),
           ylabel="cache / loop")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    ax.figure.tight_layout()
    return ax.figure, df.round(3)
