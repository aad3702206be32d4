"""Lesson 06's figures and tables: the predicted peak against a memory budget, live, beside a KV-only planner's
answer; and appendix A11's: kvlab.savers' stored rows."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from ..helpers import WIDTH


def fit_figure(prediction: dict, title: str = ""):
    """Lesson 06: each design's predicted peak (GiB) as weights, final KV and the rest of the overhead stacked, the
    memory budget as a vertical line. A KV-only planner's answer is the first two parts; the third is what it
    misses. Designs in the prediction's order, the first on top."""
    gib = 2**30
    rows = prediction["designs"]
    labels = [f"{row['cache']} / {row['loop']}" for row in rows]
    weights = prediction["weights_bytes"] / gib
    kv = [row["kv_final_bytes"] / gib for row in rows]
    rest = [max(0.0, (row["predicted_overhead_bytes"] - row["kv_final_bytes"]) / gib) for row in rows]
    fig, ax = plt.subplots(figsize=(WIDTH, 0.45 * len(rows) + 1.6))
    y = range(len(rows))[::-1]
    ax.barh(y, [weights] * len(rows), color="0.75", label="weights")
    ax.barh(y, kv, left=weights, color="tab:blue", label="final KV (a KV-only planner stops here)")
    ax.barh(y, rest, left=[weights + k for k in kv], color="tab:red", label="peak − weights − final KV")
    if prediction["memory_bytes"]:
        ax.axvline(prediction["memory_bytes"] / gib, color="black", linewidth=1.5, label="memory budget")
    ax.set_yticks(list(y), labels)
    ax.set_xlabel("predicted peak (GiB)")
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18 - 0.02 * len(rows)), ncol=4, frameon=False)
    fig.tight_layout()
    return fig


def fit_message(prediction: dict) -> str:
    """The figure's one message, from the prediction: which designs fit its memory (their peaks, GiB) and which
    do not, e.g. "In 40 GiB: dynamic / v5 (22.6 GiB), static / v5 (24.6 GiB) fit; tuple / v4.40 (42.7 GiB) does
    not". Without a memory: the lowest and highest peak."""
    gib = 2**30

    def named(rows):
        return ", ".join(f"{row['cache']} / {row['loop']} ({row['peak_bytes'] / gib:.1f} GiB)" for row in rows)

    rows = prediction["designs"]
    if not prediction["memory_bytes"]:
        low, high = (min(rows, key=lambda r: r["peak_bytes"]), max(rows, key=lambda r: r["peak_bytes"]))
        return f"Predicted peaks from {named([low])} to {named([high])}"
    fitting, failing = [r for r in rows if r["fits"]], [r for r in rows if not r["fits"]]
    verdict = [
        *([f"{named(fitting)} {'fits' if len(fitting) == 1 else 'fit'}"] if fitting else []),
        *([f"{named(failing)} {'does' if len(failing) == 1 else 'do'} not"] if failing else []),
    ]
    return f"In {prediction['memory_bytes'] / gib:g} GiB: " + "; ".join(verdict)


def plan_widget(
    preset: str, batch: int = 8, prompt: int = 4096, new: int = 512, dtype: str = "bfloat16", memory: str = "80GiB"
):
    """Lesson 06, live: sliders for the batch, the prompt and the new tokens, starting at the notebook's parameters,
    a box for the memory; each change predicts again (kvlab.planner.plan) and redraws the figure. Needs a running
    kernel (Jupyter, Colab)."""
    import ipywidgets as widgets

    from ...planner.plan import predict

    def draw(batch, prompt, new, memory):
        result = predict(preset, batch=batch, prompt=prompt, new=new, dtype=dtype, memory=memory)
        shape = f"{preset}, {dtype}: batch {batch}, prompt {prompt}, {new} new tokens; predicted peaks"
        fit_figure(result, title=f"{fit_message(result)}\n{shape}")
        plt.show()

    def slider(value: int, top: int):
        return widgets.IntSlider(value=value, min=1, max=max(top, value), continuous_update=False)

    return widgets.interact(
        draw,
        batch=slider(batch, 256),
        prompt=slider(prompt, 131072),
        new=slider(new, 32768),
        memory=widgets.Text(value=memory, continuous_update=False),
    )


def kv_only_plan(prediction: dict, context: int) -> dict:
    """What a planner that counts the weights and the final KV alone answers for the same question: the peak, and,
    given a memory, the largest batch (at the prediction's new tokens) and the longest generation (at its batch,
    up to the `context` the model has). The KV formula is kvlab.models.final_kv_bytes, the one the prediction
    divides by."""
    row, memory = prediction["designs"][0], prediction["memory_bytes"]
    sequences = prediction["batch"] * prediction["num_beams"]
    per_token = row["kv_final_bytes"] // (sequences * (prediction["prompt"] + prediction["new"]))  # one sequence
    room = (memory or 0) - prediction["weights_bytes"]
    return {
        "peak_bytes": prediction["weights_bytes"] + row["kv_final_bytes"],
        "max_batch": room // (per_token * prediction["num_beams"] * (prediction["prompt"] + prediction["new"])),
        "max_new": min(room // (per_token * sequences), context) - prediction["prompt"],
    }


def savers_summary(table: pd.DataFrame) -> pd.DataFrame:
    """kvlab.savers' stored rows (data/today/savers.csv) as appendix A11 shows them, one per saver: the KV it saves
    (share of the baseline's KV) and the peak it saves (share of the baseline's peak above the weights), measured
    and predicted; for a twin, what its full-size model's whole peak saves (predicted); where the saver's peak
    falls and the largest storage there that is not the cache (kvlab.explain). "–": not run (see the row's note)."""
    rows = []
    for _, row in table.fillna({"peak_op": "", "transient": "", "overrides": ""}).iterrows():
        above = row["peak_baseline_bytes"] - row["weights_bytes"]
        rows.append(
            {
                "saver": row["saver"],
                "model": f"{row['preset']} {row['overrides']}".strip(),
                "KV saved": _mib(row["kv_saved_bytes"], row["kv_baseline_bytes"]),
                "KV saved, predicted": _mib(row["kv_saved_predicted_bytes"]),
                "peak saved": _mib(row["peak_saved_bytes"], above),
                "peak saved, predicted": _mib(row["peak_saved_predicted_bytes"]),
                "full size: peak saved, predicted": _mib(
                    row["full_peak_saved_predicted_bytes"], row["full_peak_baseline_predicted_bytes"]
                ),
                "the saver's peak, and the largest storage there beside the cache": _peak_holder(row),
            }
        )
    return pd.DataFrame(rows)


def _mib(value, of=None) -> str:
    """MiB with 2 decimals, and the share of `of` where given; "–" for a side not run."""
    if pd.isna(value):
        return "–"
    if of is None or pd.isna(of):
        return f"{value / 2**20:,.2f} MiB"
    share = value / of
    return f"{value / 2**20:,.2f} MiB ({share:.0%})" if abs(share) >= 0.1 else f"{value / 2**20:,.2f} MiB ({share:.1%})"


def _peak_holder(row) -> str:
    """The row's peak and the largest storage there beside the cache, e.g. "forward 199, in
    Fp8QuantizedLayer._dequantize: aten.mul.Tensor: args[0] float32[1, 32, 499, 4]"."""
    if not row["peak_op"]:
        return "–"
    where = row["peak_op"].split(" in ", 1)[1].split(" (")[0]
    holder = row["transient"].split("; ")[0].rsplit(" ", 2)[0]  # without its "N B"
    return f"forward {int(row['peak_forward'])}, in {where}: {holder}"
