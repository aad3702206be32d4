"""Small helpers the notebooks share: a bytes-written counter, tables, the theme (figures: kvlab.notebook.plots;
the measurements themselves come from kvlab.lab.point and kvlab.meter)."""

from __future__ import annotations

import inspect

import pandas as pd
import seaborn as sns
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MIB = 2**20
NO_WRITE = ("empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like")


class BytesWritten(TorchDispatchMode):
    """Sum of the bytes every aten op writes while active (our own: torch's counters count flops, not bytes).

    An op's output is a fresh tensor (written in full: `cat`, `clone`), an input it modified in place (`copy_`,
    `out=`: that tensor's or view's bytes) or a view (`slice`: nothing written); the op's schema says which.
    """

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in NO_WRITE:
            return out
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        self.bytes += sum(
            leaf.numel() * leaf.element_size()
            for ret, value in zip(func._schema.returns, outputs)
            if ret.alias_info is None or ret.alias_info.is_write  # else a view: no bytes move
            for leaf in tree_leaves(value)
            if isinstance(leaf, torch.Tensor)
        )
        return out


def summary_table(records: list[dict], extra: tuple[str, ...] = ()) -> pd.DataFrame:
    """The record fields a reader needs, bytes shown in MiB, one row per measured point (speed only for
    points that were timed: `timing=False` leaves `tokens_per_s` empty)."""
    df = pd.DataFrame(records)
    table = df[[key for key in ("cache", "loop", *extra) if key in df]].assign(
        KV_MiB=(df["kv_final_bytes"] / MIB).round(2),
        peak_above_weights_MiB=(df["overhead_bytes"] / MIB).round(2),
        **{"peak/KV": df["overhead_over_kv"].round(3)},
    )
    if df["tokens_per_s"].notna().any():
        table["tokens/s (unmetered)"] = pd.to_numeric(df["tokens_per_s"]).round(1)
    return table


def step_peaks(reports: dict, step: int) -> pd.Series:
    """Peak inside one decoding step (MiB) for each labelled report."""
    return pd.Series(
        {name: report.timeline[step].peak_bytes / MIB for name, report in reports.items()},
        name=f"peak in step {step} (MiB)",
    )


def set_theme():
    """One look for every notebook's figures (seaborn's whitegrid, tab10 colours)."""
    sns.set_theme(style="whitegrid", palette="tab10", context="notebook", font_scale=0.85)


def device_label(device: str) -> str:
    """The one way notebooks name their device: the processor or GPU model, then the torch device."""
    from ..lab.provenance import device_name

    return f"{device_name(device)} ({device})"


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


def two_fixes_terms(config, cache: str, loop: str, batch: int, prompt: int, dtype: str) -> dict:
    """The big terms of the first two steps (bytes) at a logits point, from the loop's description alone: step 0
    (the prompt's forward) holds the prompt's KV and, before v5, every prompt position's logits (twice in bf16:
    the model's dtype and the fp32 upcast); step 1 holds the cache (twice for the tuple round trip) and, under
    v4.40, the prompt's fp32 logits kept from step 0. Notebook 02 sets them beside the measured peaks."""
    from ..loops import LOOPS
    from ..models import element_size, kv_bytes_per_token

    release = LOOPS[loop]
    fp32_logits = batch * prompt * config.vocab_size * 4
    logits = batch * prompt * config.vocab_size * element_size(dtype) + (fp32_logits if element_size(dtype) != 4 else 0)
    per_token = kv_bytes_per_token(config, batch, dtype)
    return {
        "step 0: KV + prompt logits": per_token * prompt + (0 if release.major == 5 else logits),
        "step 1: KV (x2 for tuple) + kept logits": (2 if cache == "tuple" else 1) * per_token * (prompt + 1)
        + (fp32_logits if release.keeps_previous_outputs else 0),
    }


# Notebook 02's diff of PR #30536: the places of transformers 4.40.1 and 4.42.4 that decide what greedy decoding
# with a Llama model holds (the copy and the logits are unchanged; the others the PR changed). Each: a title, the
# file under transformers/, and per release the line after which to look (a def, a class or a unique line), the
# excerpt's first line and the line that ends it (not included), each as its text begins, indentation aside.
# 4.40.1's greedy search is `_greedy_search`; 4.42.4's generate() sends it to `_sample` (its `_greedy_search` is a
# deprecated wrapper). 4.42.4's excerpt of the cache it is given stops before the deprecation warning it logs.
PR_EXCERPTS = [
    (
        "DynamicCache.update: the copy",
        "cache_utils.py",
        {
            version: ("class DynamicCache(", "self.key_cache[layer_idx] = torch.cat", "return self.key")
            for version in ("4.40.1", "4.42.4")
        },
    ),
    (
        "LlamaModel.forward: the cache it is given",
        "models/llama/modeling_llama.py",
        {
            "4.40.1": ("class LlamaModel(", "past_seen_tokens = 0", "if cache_position is None:"),
            "4.42.4": ("class LlamaModel(", "return_legacy_cache = False", "logger.warning_once("),
        },
    ),
    (
        "LlamaModel.forward: the cache it returns",
        "models/llama/modeling_llama.py",
        {
            "4.40.1": ("class LlamaModel(", "next_cache = None", "if not return_dict:"),
            "4.42.4": ("class LlamaModel(", "next_cache = next_decoder_cache", "if not return_dict:"),
        },
    ),
    (
        "generate(): the cache it starts with (4.42.4: the branch for no `cache_implementation`)",
        "generation/utils.py",
        {
            "4.40.1": ("def generate(", "self._validate_generated_length(", "# 7. determine"),
            "4.42.4": ("def generate(", "# Use DynamicCache() instance by default", "# 7. determine"),
        },
    ),
    (
        "the greedy loop (4.42.4: `_sample`, where generate() sends greedy search): the next token's logits",
        "generation/utils.py",
        {
            "4.40.1": ("def _greedy_search(", "if synced_gpus and", "# pre-process"),
            "4.42.4": ("def _sample(", "if synced_gpus and", "# pre-process"),
        },
    ),
    (
        "the greedy loop (4.42.4: `_sample`): the end of a step",
        "generation/utils.py",
        {
            "4.40.1": ("def _greedy_search(", "unfinished_sequences = unfinished", "if streamer"),
            "4.42.4": ("def _sample(", "unfinished_sequences = unfinished", "if streamer"),
        },
    ),
    (
        "LlamaForCausalLM.forward: the logits",
        "models/llama/modeling_llama.py",
        {version: ("logits = torch.cat(logits, dim=-1)", "else:", "loss = None") for version in ("4.40.1", "4.42.4")},
    ),
]
PR_EXCERPTS_FILE = "reference/pr30536_excerpts.json"  # under data/: the excerpts where the releases are not installed


def release_excerpts(data_dir) -> tuple[dict, str]:
    """{release: {title: {"path", "line", "lines"}}} for PR_EXCERPTS, cut from the installed 4.40.1 and 4.42.4
    (kvlab.releases) when both are there (and then the same as the committed copy in `data_dir`/PR_EXCERPTS_FILE),
    else read from that copy; and which of the two."""
    import json
    from pathlib import Path

    from ..releases import RELEASES

    folders = {version: RELEASES[version][0] / "transformers" for version in ("4.40.1", "4.42.4")}
    if not all(folder.is_dir() for folder in folders.values()):
        return json.loads((Path(data_dir) / PR_EXCERPTS_FILE).read_text()), "the excerpt committed in data/"
    excerpts = {version: {} for version in folders}
    for title, path, anchors in PR_EXCERPTS:
        for version, (after, start, stop) in anchors.items():
            lines = (folders[version] / path).read_text().splitlines()
            first = next(i for i, line in enumerate(lines) if line.lstrip().startswith(after))
            begin = next(i for i in range(first, len(lines)) if lines[i].lstrip().startswith(start))
            end = next(i for i in range(begin + 1, len(lines)) if lines[i].lstrip().startswith(stop))
            excerpts[version][title] = {"path": path, "line": begin + 1, "lines": lines[begin:end]}
    committed = Path(data_dir) / PR_EXCERPTS_FILE
    if committed.is_file() and json.loads(committed.read_text()) != excerpts:
        raise ValueError(f"data/{PR_EXCERPTS_FILE} differs from the installed releases: write it again")
    return excerpts, "the installed releases"


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
    """kvlab.savers' stored rows (data/today/savers.csv) as lesson 08 shows them, one per saver: the KV it saves
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
