"""The waste that remains in transformers' own generate(): at the peak, every byte above "weights + final KV +
one step's activations", by what holds it (kvlab.explain), and what a fix measures. This module measures; the
command line stores (kvlab.lab.waste_table):

    python -m kvlab waste                  # every point of POINTS: data/today/waste.csv, provenance.json
    python -m kvlab waste 7b-greedy        # one point (its rows replace the stored ones)
    python -m kvlab waste growth           # the cache against generated tokens: data/today/cache_growth.csv

Each point runs generate() under the meter (its peak, each forward's peak), under `explain` (the storages at the
peak and their holders), and each fix under the meter. Rows: `baseline` (weights; the final KV from the shapes;
one step's activations), `term` (the cache update's op output, storage the cache's tensors do not show, the cache
against the final one, the attention mask with SDPA's float copy of it, activations above one step's, what only
the allocator saw inside kernels), `check` (the meter's peak, the CPU allocator's: baseline and terms add up to
it), `note` (not added up: the prompt's forward, the view kept after it, a static cache's unwritten capacity) and
`fix` (each fix's peak and what it saves).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import TYPE_CHECKING

import torch

from .compat import cache_argument
from .counts import sliding_windows, window_tokens
from .explain import explain, generate_call
from .meter import MemoryMeter, weight_bytes
from .models import kv_bytes_per_token, random_prompt
from .planner.sources import build_model

if TYPE_CHECKING:  # pandas is the lab extra's: cache_growth imports it where it builds its table
    import pandas as pd

COMMON = dict(batch=1, dtype="bfloat16", seed=0)
# The 7B shape: the Llama-2-7B twin, prompt 300, 200 new tokens. The long context: Mistral-7B-v0.1 as released
# (every layer slides, window 4096; the twin divides the widths by 32, not the window), a prompt past its window.
SEVEN_B = dict(preset="llama2-7b-twin", overrides={}, prompt=300, new=200)
LONG = dict(preset="mistral-7b-v0.1-twin", overrides={}, prompt=4608, new=32)
POINTS = {
    "7b-greedy": dict(SEVEN_B, generate={}, fix=["prealloc"]),
    "7b-static": dict(SEVEN_B, generate=dict(cache_implementation="static"), fix=["chunked-prefill"]),
    "7b-beam4": dict(SEVEN_B, generate=dict(num_beams=4), fix=["beam-prefill-once"]),
    "long-greedy": dict(LONG, generate={}, fix=["chunked-prefill", "prealloc"]),
}
# Where each term would be fixed upstream, in transformers 5.24 (file: class.function).
UPSTREAM = {
    "cat": "src/transformers/cache_utils.py: DynamicLayer.update (torch.cat of the whole layer every step)",
    "index_select": "src/transformers/cache_utils.py: CacheLayerMixin.reorder_cache (index_select of a whole layer)",
    "view": "src/transformers/cache_utils.py: DynamicSlidingWindowLayer.update (keeps a view of the cat's output)",
    "capacity": "src/transformers/cache_utils.py: StaticLayer.lazy_initialization (max_cache_len before the prompt)",
    "prefill": "src/transformers/generation/utils.py: GenerationMixin._prefill (the whole prompt in one forward "
    "unless generation_config.prefill_chunk_size)",
    "activations": "src/transformers/generation/utils.py: GenerationMixin.generate (_expand_inputs_for_generation "
    "before the prompt's forward, _prefill)",
    "mask": "src/transformers/masking_utils.py: and_masks (result = result & mask(...): each & a new bool tensor "
    "while the last is alive); src/transformers/integrations/sdpa_attention.py: sdpa_attention_forward (hands "
    "the bool mask to SDPA, which attends with a float copy of it)",
}
CACHE_TENSOR = re.compile(r"\.layers\[(\d+)\]\.(keys|values)$")
MASK_TENSOR = re.compile(r"^bool\[\d+, \d+, \d+, \d+\]$")  # an attention mask: (batch, heads or 1, queries, keys)
SDPA_MASK = "kwargs['attn_mask']"  # SDPA's float copy of a bool mask, held by its kernel's call
COLUMNS = [
    "point",
    "preset",
    "overrides",
    "generate",
    "batch",
    "prompt",
    "new",
    "dtype",
    "kind",
    "term",
    "bytes",
    "share_of_peak",
    "peak_forward",
    "holder",
    "upstream",
    "saves_bytes",
]


def held_cache_bytes(config, batch: int, prompt: int, new: int, dtype: str) -> int:
    """The cache generate() holds when it returns, from the shapes: prompt + new - 1 tokens per full layer (the last
    token is never fed back), at most window - 1 per sliding layer (what a later query can see): the rows' "final
    KV". The sweeps' kvlab.models.final_kv_bytes, which their overhead / KV divides by, counts all prompt + new
    tokens in every layer instead."""
    tokens = prompt + new - 1
    per_layer = kv_bytes_per_token(config, batch, dtype) // config.num_hidden_layers
    windows = sliding_windows(config)
    return sum(per_layer * window_tokens(window, tokens) for window in windows)


def metered(run, model) -> tuple[int, list[tuple[int, int]]]:
    """Peak bytes above the weights, and (live bytes at its start, peak bytes) for each forward of `model`."""
    meter = MemoryMeter("cpu", model)
    with model.register_forward_pre_hook(lambda *_: meter.step()), torch.no_grad(), meter:
        run()
        meter.step()
    report = meter.report()
    forwards = [(before.live_bytes, after.peak_bytes) for before, after in zip(report.timeline, report.timeline[1:])]
    return report.overhead_bytes, forwards


def _record_cache(model, sizes: list):
    """A forward hook (its handle a context manager) appending to `sizes`, after each forward, (bytes of the
    storages under the transformers cache's keys and values, bytes those tensors show)."""

    def record(module, args, kwargs, out):
        cache = kwargs.get(cache_argument(module))
        tensors = [t for layer in cache.layers for t in (layer.keys, layer.values) if t is not None]
        storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
        sizes.append((sum(storages.values()), sum(t.nbytes for t in tensors)))

    return model.register_forward_hook(record, with_kwargs=True)


def split_peak(explanation) -> dict:
    """The storages at the peak as the rows' terms: cache tensors, storage they do not show, the op's output where
    the op updates the cache, the attention masks (4-D bool tensors, and the float copy SDPA is given), and the rest
    (activations), with the masks' holders and the rest's three largest holders."""
    parts = dict.fromkeys(("cache_shown", "cache_hidden", "op_out", "mask", "rest"), 0)
    others, masks = Counter(), Counter()  # holder name (indices as [i]) -> bytes
    cache_op = "cache_utils.py" in explanation.where
    for item in explanation.held:
        holder = re.sub(r"\[\d+\]", "[i]", item.holders[0])
        if any(CACHE_TENSOR.search(name) for name in item.holders):
            parts["cache_shown"] += item.tensor_bytes
            parts["cache_hidden"] += item.nbytes - item.tensor_bytes
        elif cache_op and item.holders[0] == f"{explanation.op}: out":
            parts["op_out"] += item.nbytes
        elif MASK_TENSOR.match(item.tensor) or any(name.endswith(SDPA_MASK) for name in item.holders):
            parts["mask"] += item.nbytes
            masks[f"{holder} {item.tensor}"] += item.nbytes
        else:
            parts["rest"] += item.nbytes
            others[holder] += item.nbytes
    largest = "; ".join(f"{name} {_size(nbytes)}" for name, nbytes in others.most_common(3))
    mask_holders = "; ".join(f"{name} {_size(nbytes)}" for name, nbytes in masks.most_common())
    return dict(parts, largest=largest, masks=mask_holders)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 0.01 * 2**20 else f"{nbytes / 2**10:.2f} KiB"


def terms(name: str, point: dict | None = None) -> list[dict]:
    """The rows of one point: POINTS[name], or `point` given in the same form (see the module's docstring)."""
    point = point or POINTS[name]
    model = build_model(point["preset"], point["overrides"], dtype=COMMON["dtype"], seed=COMMON["seed"])
    ids = random_prompt(model.config.vocab_size, COMMON["batch"], point["prompt"], COMMON["seed"])
    beams = point["generate"].get("num_beams", 1)
    run = generate_call(model, ids, point["new"], **point["generate"])
    sizes = []
    with _record_cache(model, sizes):
        peak, forwards = metered(run, model)
    with torch.no_grad():
        explanation = explain(run, model=model)
    final = held_cache_bytes(model.config, COMMON["batch"] * beams, point["prompt"], point["new"], COMMON["dtype"])
    parts = split_peak(explanation)
    # At a decode step's peak the rest is one step's activations; at the prompt's, the last forward's rise is.
    step_activations = parts["rest"] if explanation.forward else forwards[-1][1] - forwards[-1][0]
    weights = weight_bytes(model)
    retained = sizes[0][0] - sizes[0][1]
    rows = [
        ("baseline", "weights", weights, "the model's parameters and buffers", ""),
        ("baseline", "final KV", final, "from the shapes: what generate() ends with", ""),
        (
            "baseline",
            "one step's activations",
            step_activations,
            "the last decode step" if not explanation.forward else "not cache, at the peak",
            "",
        ),
        *_peak_terms(name, explanation, parts, final, step_activations, beams),
        (
            "term",
            "allocated inside kernels",
            peak - explanation.peak_bytes,
            "the allocator's peak above the tensors explain counts at its peak (casts, workspaces inside a kernel)",
            "",
        ),
        ("check", "peak (the meter, its own run)", weights + peak, "MemoryMeter, the CPU allocator's events", ""),
        ("note", "peak of the prompt's forward", weights + forwards[0][1], "the meter, forward 0", ""),
        (
            "note",
            "storage the cache's tensors do not show after the prompt's forward",
            retained,
            f"the cache after forward 0: {sizes[0][0]} bytes of storage, {sizes[0][1]} shown",
            UPSTREAM["view"] if retained else "",
        ),
        *_fix_rows(model, ids, point, weights, forwards),
    ]
    if point["generate"].get("cache_implementation") == "static":  # inside the final KV, not added up
        written = point["prompt"] + explanation.forward  # tokens in the cache once the peak's forward has run
        unwritten = final - held_cache_bytes(model.config, COMMON["batch"] * beams, written, 1, COMMON["dtype"])
        after = f"after forward {explanation.forward}: {written} of {point['prompt'] + point['new'] - 1} tokens"
        rows.append(("note", "static capacity not yet written at the peak", unwritten, after, UPSTREAM["capacity"]))
    return _records(name, point, rows, weights + peak, explanation.forward)


def _peak_terms(name: str, explanation, parts: dict, final: int, step_activations: int, beams: int) -> list[tuple]:
    """The terms above weights + final KV + one step's activations at the peak, each with its holder."""
    op = explanation.op.removeprefix("aten.").split(".")[0]
    at = explanation.where.split(" (")[0]
    update = [("term", f"the cache update's {op} output", parts["op_out"], f"{explanation.op}: out, in {at}",
               UPSTREAM.get(op, ""))] if parts["op_out"] else []  # fmt: skip
    activations_upstream = (
        UPSTREAM["activations"] if beams > 1 else UPSTREAM["prefill"] if explanation.forward == 0 else ""
    )
    return [
        *update,
        (
            "term",
            "storage the cache's tensors do not show",
            parts["cache_hidden"],
            "cache .layers[i].keys/values: views of longer buffers",
            UPSTREAM["view"],
        ),
        (
            "term",
            "cache tensors beyond the final KV",
            parts["cache_shown"] - final,
            "cache .layers[i].keys/values (negative: not yet grown)",
            UPSTREAM["capacity"] if "static" in name else "",
        ),
        (
            "term",
            "the attention mask",
            parts["mask"],
            parts["masks"] or "4-D bool masks and SDPA's float copies: none at the peak",
            UPSTREAM["mask"] if parts["mask"] else "",
        ),
        (
            "term",
            "activations above one step's",
            parts["rest"] - step_activations,
            f"forward {explanation.forward} (0: the prompt's); largest: {parts['largest']}",
            activations_upstream,
        ),
    ]


def _fix_rows(model, ids, point: dict, weights: int, forwards: list) -> list[tuple]:
    """Each of the point's fixes, measured under the same meter: the peak with it."""
    rows = []
    for fix in point["fix"]:
        fix_peak = FIXES[fix](model, ids, point)
        if fix == "beam-prefill-once":  # it changes the prompt's forward only: the later forwards stay
            what = "beam-prefill-once: the prompt's forward at the batch, not at batch x beams"
            rows.append(("note", "peak of the prompt's forward, with the fix", weights + fix_peak, what,
                         UPSTREAM["activations"]))  # fmt: skip
            fix_peak = max([fix_peak] + [forward_peak for _, forward_peak in forwards[1:]])
        rows.append(("fix", fix, weights + fix_peak, " ".join(FIXES[fix].__doc__.split()), ""))
    return rows


def _records(name: str, point: dict, rows: list[tuple], peak: int, peak_forward: int) -> list[dict]:
    """The point's rows as waste.csv's records (COLUMNS): `peak` is the meter's, weights included."""
    shared = dict(point=name, preset=point["preset"], overrides=_text(point["overrides"]),
                  generate=_text(point["generate"]), batch=COMMON["batch"], prompt=point["prompt"], new=point["new"],
                  dtype=COMMON["dtype"])  # fmt: skip
    return [
        dict(
            shared,
            kind=kind,
            term=term,
            bytes=nbytes,
            share_of_peak=round(nbytes / peak, 5),
            peak_forward=peak_forward,
            holder=holder,
            upstream=upstream,
            saves_bytes=peak - nbytes if kind == "fix" else None,
        )  # fmt: skip
        for kind, term, nbytes, holder, upstream in rows
    ]


def _text(values: dict) -> str:
    return " ".join(f"{key}={value}" for key, value in values.items())


# -- the fixes, each measured at the point's own shape by the meter (peak bytes above the weights) --------------


def fix_prealloc(model, ids, point) -> int:
    """kvlab's `prealloc` under its 5.x loop: written in place (on sliding layers kvlab.designs.WindowLayer: the last
    window - 1 tokens in a buffer of window - 1 + 32 slots, nothing of the prompt's length kept)."""
    from . import designs  # noqa: F401 (registers kvlab's own designs, list and prealloc, with make_cache)
    from .decoding import Beams
    from .loops import generate

    return metered(
        lambda: generate(
            model,
            ids,
            point["new"],
            cache="prealloc",
            loop="v5",
            strategy=Beams(point["generate"]["num_beams"]) if point["generate"].get("num_beams") else "greedy",
        ),
        model,
    )[0]


def fix_chunked_prefill(model, ids, point) -> int:
    """transformers' own generate() with the prompt's forward in chunks of 32 tokens (generate()'s
    `prefill_chunk_size`): the full-capacity cache then meets a 32-token forward's activations only."""
    return metered(generate_call(model, ids, point["new"], prefill_chunk_size=32, **point["generate"]), model)[0]


def fix_beam_prefill_once(model, ids, point) -> int:
    """The prompt's forward at the batch, its cache then repeated for the beams (DynamicCache.batch_repeat_interleave),
    where generate() runs it at batch x beams: the peak of that prefill (terms takes the later forwards'
    peaks from generate()'s own run: the cache they start from is the same)."""
    from transformers import DynamicCache

    beams = point["generate"]["num_beams"]

    def prefill_once():
        cache = DynamicCache(config=model.config)
        logits = model(ids, **{cache_argument(model): cache}, logits_to_keep=1).logits
        cache.batch_repeat_interleave(beams)
        return logits.repeat_interleave(beams, dim=0), cache

    return metered(prefill_once, model)[0]


FIXES = {"prealloc": fix_prealloc, "chunked-prefill": fix_chunked_prefill, "beam-prefill-once": fix_beam_prefill_once}


# The cache against generated tokens: a full-attention model beside today's all-sliding (Mistral-7B-v0.1, its
# window 4096 cut to 512 so that the plateau comes within minutes on a CPU) and hybrid (Gemma-3-4B: 5 sliding
# layers of window 1024, then 1 full) layouts.
GROWTH = dict(
    presets=["llama2-7b-twin", "mistral-7b-v0.1-twin", "gemma-3-4b-twin"],
    prompt=64,
    new=1400,
    overrides={"mistral-7b-v0.1-twin": {"sliding_window": 512}},
)


def cache_growth(
    presets=GROWTH["presets"],
    prompt: int = GROWTH["prompt"],
    new: int = GROWTH["new"],
    every: int = 1,
    overrides: dict | None = GROWTH["overrides"],
) -> pd.DataFrame:
    """For each preset (bf16, batch 1; `overrides` maps a preset to its config overrides), the storage of
    transformers' own DynamicCache after each forward of generate() (a view counts its whole storage, as memory
    does): one row per forward (every `every`-th), with the tokens the model has seen by then and what the cache
    would hold with every layer full."""
    import pandas as pd

    rows = []
    for preset in presets:
        preset_overrides = (overrides or {}).get(preset) or {}
        model = build_model(preset, preset_overrides, dtype=COMMON["dtype"], seed=COMMON["seed"])
        ids = random_prompt(model.config.vocab_size, COMMON["batch"], prompt, COMMON["seed"])
        sizes = []
        with _record_cache(model, sizes), torch.no_grad():
            generate_call(model, ids, new)()
        token = kv_bytes_per_token(model.config, COMMON["batch"], COMMON["dtype"])  # every layer's, full attention
        rows += [
            dict(
                preset=preset,
                overrides=_text(preset_overrides),
                forward=i,
                tokens=prompt + i,
                cache_storage_bytes=storage,
                full_cache_bytes=token * (prompt + i),
            )
            for i, (storage, _) in enumerate(sizes)
            if i % every == 0 or i == len(sizes) - 1
        ]
    return pd.DataFrame(rows)
