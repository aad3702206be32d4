"""Today's memory savers, measured: for each, on one point, the KV bytes it saves beside the peak bytes it saves,
what holds the difference at its peak (kvlab.explain names it), and both predicted before any run. This module
measures and predicts; the command line stores (kvlab.lab.savers_table):

    python -m kvlab savers                  # every saver of SAVERS: data/today/savers.csv, provenance.json
    python -m kvlab savers fp8 sliding      # some (their rows replace the stored ones)

Measured: transformers' own generate() with the saver and without it (the baseline: the same model, its default
cache) under the meter (the CPU allocator); the KV is every storage the returned cache holds.
Predicted, before anything is allocated: the KV from the shapes (`kv_bytes`: what the saver's layers keep, read in
transformers' and the backends' code), the peak by a dry run: kvlab's v5 loop on the meta device with the cache
generate() would make, every step (as `predict --dry-run` runs a design). For a twin, the same predictions for its
full-size model (`FULL_SIZE`, on meta). `same_tokens`: the share of new tokens equal to the baseline's, on random
weights (kvlab.lab.savers_table.saver_answers has real text).
"""

from __future__ import annotations

import functools
import json
import math
import re
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, DynamicCache, QuantizedCache

from .caches import cache_bytes
from .compat import cache_from_outputs
from .counts import element_size, head_dim, kv_heads, layer_bytes_per_token, sliding_windows, window_tokens
from .explain import explain, generate_call
from .meter import MemoryMeter, weight_bytes
from .models import random_prompt
from .planner.dry_run import dry_run
from .planner.sources import build_model
from .presets import RANDOM_INIT_STD

# One point for the cache savers: the Llama-2-7B twin (its widths / 32, its layers and ratios), bf16, batch 1,
# prompt 300, 200 new tokens (kvlab.waste's 7B point). The layout savers run on a model of that layout.
TWIN = dict(preset="llama2-7b-twin", overrides={}, batch=1, prompt=300, new=200, dtype="bfloat16")
# Tiny configs keeping a layout no preset has (4 layers, widths as tests/test_architectures.py's).
SIZES = dict(
    num_hidden_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    intermediate_size=96,
    max_position_embeddings=1024,
    pad_token_id=0,
    initializer_range=RANDOM_INIT_STD,  # varied tokens from random weights, as the presets' (kvlab.presets)
)
TINY = {
    # Llama 4: three chunked layers, then a full one; chunks of 64 tokens
    "llama4_text": dict(
        layer_types=["chunked_attention"] * 3 + ["full_attention"],
        attention_chunk_size=64,
        num_local_experts=4,
        intermediate_size_mlp=96,
        head_dim=16,
    ),
    # Gemma 3n: the last two layers read the first two's keys and values
    "gemma3n_text": dict(
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,
        vocab_size_per_layer_input=256,
        hidden_size_per_layer_input=8,
        sliding_window=512,  # wider than the point: only the sharing saves here
        head_dim=16,
        activation_sparsity_pattern=[0.0] * 4,
        initializer_range=0.02,  # transformers' default: its tokens repeat at the presets' 0.1 (3-4 distinct in 16)
    ),
    # DeepSeek-V3: multi-head latent attention, 4 heads of 16 + 8 (rotary) query/key and 16 value dimensions
    "deepseek_v3": dict(
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    ),
}
SMALL = dict(batch=1, prompt=32, new=480, dtype="float32")  # the tiny configs: a short prompt, a long generation


def _quantized(backend: str, **options) -> dict:
    return dict(cache_implementation="quantized", cache_config=dict(backend=backend, **options))


# Each saver: the point (preset, overrides, batch, prompt, new, dtype), generate()'s options with it on, the
# baseline's overrides (the same model without the saver) and where transformers does it.
SAVERS = {
    "quanto-int4": dict(
        TWIN,
        generate=_quantized("quanto", nbits=4),
        where="cache_utils.py: QuantoQuantizedLayer (optimum-quanto; groups of 64, the last < 128 tokens kept)",
    ),
    "quanto-int2": dict(TWIN, generate=_quantized("quanto", nbits=2), where="cache_utils.py: QuantoQuantizedLayer"),
    "hqq-int4": dict(TWIN, generate=_quantized("hqq", nbits=4), where="cache_utils.py: HQQQuantizedLayer (hqq)"),
    "fp8": dict(
        TWIN,
        generate=_quantized("fp8"),
        where="cache_utils.py: Fp8QuantizedLayer (float8_e4m3fn, one scale per tensor, dequantized every step)",
    ),
    "prefill-chunks": dict(
        TWIN,
        generate=dict(prefill_chunk_size=32),
        where="generation/utils.py: GenerationMixin._prefill (the prompt's forward in chunks of 32)",
    ),
    "offloaded": dict(
        TWIN,
        generate=dict(cache_implementation="offloaded"),
        where="cache_utils.py: Cache.update (each layer to the CPU after its update, the next one prefetched)",
    ),
    "sliding": dict(
        TWIN,
        preset="mistral-7b-v0.1-twin",
        overrides={"sliding_window": 128},
        baseline={"sliding_window": None},
        generate={},
        where="cache_utils.py: DynamicSlidingWindowLayer (the last window - 1 tokens of every layer)",
    ),
    "chunked": dict(
        SMALL,
        preset="tiny:llama4_text",
        overrides={},
        baseline={"layer_types": ["full_attention"] * 4},
        generate={},
        where="cache_utils.py: DynamicSlidingWindowLayer (a chunked layer kept as a window of its chunk)",
    ),
    "shared-kv": dict(
        SMALL,
        preset="tiny:gemma3n_text",
        overrides={},
        baseline={"num_kv_shared_layers": 0},
        generate={},
        where="cache_utils.py: DummyLayer (a KV-sharing layer caches nothing)",
    ),
    "mla": dict(
        SMALL,
        preset="tiny:deepseek_v3",
        overrides={},
        generate={},
        where="models/deepseek_v3: the latent and the rotary key cached, K and V re-expanded every step",
    ),
}
# What is not run here, with why: its side of the row is predicted only.
SAVER_NOT_RUN = {
    "offloaded": "predicted only: offloading needs CUDA streams (transformers' Cache(offloading=True)); it moves the "
    "KV to the CPU's memory, it does not save it"
}
BASELINE_NOT_RUN = {
    "mla": "the baseline (each head's K and V cached) from the shapes only: every release kvlab supports (5.17 on) "
    "caches MLA's latent"
}
COLUMNS = [
    "saver",
    "preset",
    "overrides",
    "baseline",
    "generate",
    "batch",
    "prompt",
    "new",
    "dtype",
    "weights_bytes",
    "kv_baseline_bytes",
    "kv_bytes",
    "kv_saved_bytes",
    "kv_saved_predicted_bytes",
    "peak_baseline_bytes",
    "peak_bytes",
    "peak_saved_bytes",
    "peak_saved_predicted_bytes",
    "peak_baseline_predicted_bytes",
    "peak_predicted_bytes",
    "peak_forward",
    "peak_op",
    "transient",
    "same_tokens",
    "full_size",
    "full_weights_bytes",
    "full_kv_saved_predicted_bytes",
    "full_peak_baseline_predicted_bytes",
    "full_peak_saved_predicted_bytes",
    "where",
    "note",
]


@functools.cache
def tiny_config(model_type: str) -> str:
    """The folder of TINY[model_type]'s config.json (written once per process, in the system's temporary folder):
    a preset kvlab's builders read."""
    folder = Path(tempfile.gettempdir()) / "kvlab-savers" / model_type
    folder.mkdir(parents=True, exist_ok=True)
    AutoConfig.for_model(model_type, **{**SIZES, **TINY[model_type]}).to_json_file(folder / "config.json")
    return str(folder)


def _source(preset: str) -> str:
    return tiny_config(preset.removeprefix("tiny:")) if preset.startswith("tiny:") else preset


def _model(point: dict, device: str = "cpu", baseline: bool = False):
    overrides = {**point["overrides"], **(point.get("baseline") or {})} if baseline else point["overrides"]
    return build_model(_source(point["preset"]), overrides, device, point["dtype"], 0)


# -- the KV from the shapes: what each saver's layers hold after `tokens` tokens -------------------------------


def kv_bytes(config, saver_generate: dict, batch: int, tokens: int, dtype: str, updates: int) -> int:
    """Bytes the cache generate() makes with `saver_generate` holds after `tokens` tokens fed in `updates` calls
    (the prompt's whole, then one per decode step): every layer's keys and values as the layer keeps them (MLA's
    latent and rotary key; nothing for a layer that caches no token, such as a KV-sharing one)."""
    options = saver_generate.get("cache_config") or {}
    backend = options.get("backend")
    if backend is not None and saver_generate.get("prefill_chunk_size"):
        raise ValueError("kv_bytes counts a quantized cache whose prompt came in one update, not in chunks")
    per_token = layer_bytes_per_token(config, batch, dtype)
    if backend is None:  # full and windowed layers
        fed = tokens if updates == 1 else 1  # what the last update fed
        layers = zip(per_token, sliding_windows(config))
        # a sliding layer also keeps its window as a 0-d int64 tensor
        return sum(n * window_tokens(window, tokens, fed) + 8 * (window is not None) for n, window in layers)
    text = config.get_text_config(decoder=True)
    one = batch * kv_heads(text) * head_dim(text)  # elements of one token of one layer's keys (or values)
    if backend == "fp8":  # 1 byte an element; a float32 scale per tensor
        return text.num_hidden_layers * 2 * (one * tokens + 4)
    quantized, residual = _kivi_split(tokens, updates, options.get("residual_length", 128))
    packed = _packed_bytes(backend, one * quantized, options.get("nbits", 4), options.get("q_group_size", 64), dtype)
    return text.num_hidden_layers * 2 * (packed + one * residual * element_size(dtype))


def _kivi_split(tokens: int, updates: int, residual_length: int) -> tuple[int, int]:
    """(quantized, full-precision) tokens of a QuantizedLayer after `updates` updates: the prompt's is quantized
    whole; each later one adds a token to the residual, which is quantized with everything before it once it
    would reach `residual_length` (transformers' QuantizedLayer.update)."""
    prompt = tokens - (updates - 1)
    quantized, residual = prompt, 0
    for _ in range(updates - 1):
        if residual + 1 >= residual_length:
            quantized, residual = quantized + residual + 1, 0
        else:
            residual += 1
    return quantized, residual


def _packed_bytes(backend: str, elements: int, nbits: int, group: int, dtype: str) -> int:
    """One quantized tensor: the packed integers and a scale and a zero point per group of `group` elements, in
    the cache's dtype. quanto packs whole rows of `group` into uint8 (rows rounded up), hqq packs a group's
    elements into group * nbits / 8 bytes (2, 4 and 8 bits)."""
    if backend == "hqq" and nbits not in (1, 2, 4, 8):
        raise ValueError(f"kv_bytes counts hqq's 1, 2, 4 and 8 bits, not {nbits} (3 bits pack into padded int32)")
    groups = math.ceil(elements / group)
    data = math.ceil(groups * nbits / 8) * group if backend == "quanto" else groups * group * nbits // 8
    return data + 2 * groups * element_size(dtype)


def per_head_kv_bytes(config, batch: int, tokens: int, dtype: str) -> int:
    """MLA's keys and values if each head's were cached (what the latent replaces): qk_nope + qk_rope key and
    v_head_dim value dimensions per head, every layer."""
    text = config.get_text_config(decoder=True)
    width = text.num_attention_heads * (text.qk_nope_head_dim + text.qk_rope_head_dim + text.v_head_dim)
    return text.num_hidden_layers * batch * width * tokens * element_size(dtype)


# -- measuring: transformers' own generate() ------------------------------------------------------------------


def measure_generate(model, ids, new: int, options: dict) -> dict:
    """transformers' own generate() with `options`: its peak (weights included; the CPU allocator's), the peak of
    the tensors the live-storage counter saw beside it (what the dry run predicts: the backends' kernels allocate
    scratch of their own), the KV its cache ends with, and the new tokens."""
    run = generate_call(model, ids, new, return_dict_in_generate=True, **options)
    with torch.no_grad(), MemoryMeter("cpu", model) as meter:
        run()
    report = meter.report()
    with torch.no_grad():
        out = run()
    return dict(
        peak=report.peak_bytes,
        tensors_peak=report.baseline_bytes + report.storages_peak_bytes,
        kv=cache_bytes(cache_from_outputs(out)),
        tokens=out.sequences[:, ids.shape[1] :],
    )


CACHE_HOLDER = re.compile(r"\.layers\[\d+\]")


def transient(model, ids, new: int, options: dict) -> tuple[int, str, str]:
    """At the peak of generate() with `options`, by kvlab.explain: the forward, the op, and the three largest
    storages that are not the cache's (their holders and bytes)."""
    with torch.no_grad():
        explanation = explain(generate_call(model, ids, new, **options), model=model)
    others = [item for item in explanation.held if not any(CACHE_HOLDER.search(name) for name in item.holders)]
    largest = sorted(others, key=lambda item: -item.nbytes)[:3]
    named = "; ".join(f"{item.holders[0]} {item.tensor} {item.nbytes} B" for item in largest)
    return explanation.forward, f"{explanation.op} in {explanation.where}", named


# -- predicting: kvlab's loop on meta with the cache generate() would make ------------------------------------


def generate_cache(model, options: dict):
    """The cache transformers' generate() makes for `options` (its default, or `cache_implementation="quantized"`
    with `cache_config`), for kvlab's loop to decode into."""
    if options.get("cache_implementation") == "quantized":
        config = dict(options["cache_config"])
        return QuantizedCache(
            backend=config.pop("backend"), config=model.config.get_text_config(decoder=True), **config
        )
    return DynamicCache(config=model.config)


def dry_run_peak(model, new: int, batch: int, prompt: int, options: dict) -> int:
    """The peak (weights included) of kvlab's v5 loop on the meta device (`model` built there), decoding into
    generate_cache(options), the prompt's forward in `prefill_chunk_size` chunks where asked."""
    return weight_bytes(model) + dry_run_report(model, new, batch, prompt, options).overhead_bytes


def dry_run_report(model, new: int, batch: int, prompt: int, options: dict):
    """dry_run_peak's run (the planner's dry run, every step: a quantized cache's peak can fall between its
    quantizations): the meter's report, whose timeline has each step's peak above the weights and inputs."""
    cache = generate_cache(model, options)
    return dry_run(model, batch, prompt, new, skip=False, cache=cache, prefill_chunk=options.get("prefill_chunk_size"))[
        0
    ]


def offloaded_peak(config, report, batch: int, prompt: int, tokens: int, dtype: str) -> int:
    """Our reading of transformers' offloading (Cache.update, prefetch, offload), from the baseline's dry run
    (`report`): in a layer's update the accelerator keeps that layer's keys and values and the next one's
    (prefetched; after the last layer, the first); every other full-attention layer's are on the CPU. The peak is
    the larger of the prompt's step and the last step, each less the layers away at that length."""
    per_layer = [n for n, window in zip(layer_bytes_per_token(config, batch, dtype), sliding_windows(config))
                 if window is None]  # fmt: skip
    away = sum(sorted(per_layer)[: max(len(per_layer) - 2, 0)])  # bytes per token on the CPU
    first, last = report.timeline[0], report.timeline[-1]
    return report.baseline_bytes + max(first.peak_bytes - away * prompt, last.peak_bytes - away * tokens)


def offloaded_kv_bytes(config, batch: int, tokens: int, dtype: str) -> int:
    """What stays on the accelerator when generate() returns, by the same reading: the first layer (prefetched by
    the last layer's update) and the sliding layers, which are not offloaded. The rest is on the CPU, not saved."""
    per_layer = layer_bytes_per_token(config, batch, dtype)
    windows = sliding_windows(config)
    full = [i for i, window in enumerate(windows) if window is None]
    kept = [i for i, window in enumerate(windows) if window is not None] + full[:1]
    return sum(per_layer[i] * window_tokens(windows[i], tokens, 1) for i in kept)


# -- one saver's row --------------------------------------------------------------------------------------------


def row(name: str, point: dict | None = None) -> dict:
    """One saver's row of savers.csv (COLUMNS): SAVERS[name], or `point` given in the same form."""
    point = point or SAVERS[name]
    options, new, batch = point["generate"], point["new"], point["batch"]
    model = _model(point)
    ids = random_prompt(model.config.vocab_size, batch, point["prompt"], 0)
    before = measured_baseline(point) if name not in BASELINE_NOT_RUN else dict(kv=None, peak=None)
    after = measure_generate(model, ids, new, options) if name not in SAVER_NOT_RUN else dict(kv=None, peak=None)
    forward, op, named = transient(model, ids, new, options) if name not in SAVER_NOT_RUN else (None, "", "")
    guess = predicted(name, point)
    full = predicted(name, dict(point, preset=FULL_SIZE[point["preset"]])) if point["preset"] in FULL_SIZE else {}
    return dict(
        saver=name,
        preset=point["preset"],
        overrides=options_text(point["overrides"]),
        baseline=options_text(point.get("baseline") or {}) or "the same model, generate()'s default cache",
        generate=options_text(options),
        **{key: point[key] for key in ("batch", "prompt", "new", "dtype")},
        weights_bytes=weight_bytes(model),
        kv_baseline_bytes=before["kv"],
        kv_bytes=after["kv"],
        kv_saved_bytes=_minus(before["kv"], after["kv"]),
        kv_saved_predicted_bytes=guess["kv_base"] - guess["kv"],
        peak_baseline_bytes=before["peak"],
        peak_bytes=after["peak"],
        peak_saved_bytes=_minus(before["peak"], after["peak"]),
        peak_saved_predicted_bytes=_minus(guess["peak_base"], guess["peak"]),
        peak_baseline_predicted_bytes=guess["peak_base"],
        peak_predicted_bytes=guess["peak"],
        peak_forward=forward,
        peak_op=op,
        transient=named,
        same_tokens=_same(before["tokens"], after["tokens"]) if "tokens" in before and "tokens" in after else None,
        full_size=FULL_SIZE.get(point["preset"]),
        full_weights_bytes=full.get("weights"),
        full_kv_saved_predicted_bytes=_minus(full.get("kv_base"), full.get("kv")),
        full_peak_baseline_predicted_bytes=full.get("peak_base"),
        full_peak_saved_predicted_bytes=_minus(full.get("peak_base"), full.get("peak")),
        where=point["where"],
        note=SAVER_NOT_RUN.get(name) or BASELINE_NOT_RUN.get(name, ""),
    )


# The twins' own models, for the prediction at full size (on meta: nothing is allocated)
FULL_SIZE = {"llama2-7b-twin": "llama2-7b", "mistral-7b-v0.1-twin": "mistral-7b-v0.1"}
_BASELINES = {}  # one baseline per model and point in a process: the quantized savers share the twin's


def _key(point: dict, *extra) -> str:
    fields = ("preset", "overrides", "baseline", "batch", "prompt", "new", "dtype")
    return json.dumps([point.get(field) for field in fields] + list(extra), sort_keys=True)


def measured_baseline(point: dict) -> dict:
    """transformers' own generate() on `point`'s model without the saver, its default cache (once per process)."""
    key = _key(point, "measured")
    if key not in _BASELINES:
        model = _model(point, baseline=True)
        ids = random_prompt(model.config.vocab_size, point["batch"], point["prompt"], 0)
        _BASELINES[key] = measure_generate(model, ids, point["new"], {})
    return _BASELINES[key]


def predicted(name: str, point: dict) -> dict:
    """Before anything is allocated: the weights, the KV (from the shapes) and the peak (the dry run; offloading:
    our reading of it) of `point` with saver `name` and without it (MLA's baseline: per-head KV, no peak)."""
    options, new, batch, dtype = point["generate"], point["new"], point["batch"], point["dtype"]
    tokens = point["prompt"] + new - 1  # the last new token is never fed back; one update per forward
    meta, base = _model(point, "meta"), _model(point, "meta", baseline=True)
    baseline = None  # the dry run of the model without the saver (MLA's baseline is not run: per-head K and V)
    if name in BASELINE_NOT_RUN:
        kv_base, peak_base = per_head_kv_bytes(meta.config, batch, tokens, dtype), None
    else:
        key = _key(point, "predicted")
        if key not in _BASELINES:
            _BASELINES[key] = dry_run_report(base, new, batch, point["prompt"], {})
        baseline = _BASELINES[key]
        kv_base, peak_base = kv_bytes(base.config, {}, batch, tokens, dtype, new), baseline.peak_bytes
    if name == "offloaded":
        if baseline is None:
            raise ValueError("offloading is predicted from the baseline's dry run, which this saver does not run")
        peak = offloaded_peak(meta.config, baseline, batch, point["prompt"], tokens, dtype)
        kv = offloaded_kv_bytes(meta.config, batch, tokens, dtype)
    else:
        peak = dry_run_peak(meta, new, batch, point["prompt"], options)
        kv = kv_bytes(meta.config, options, batch, tokens, dtype, new)
    return dict(weights=weight_bytes(meta), kv_base=kv_base, kv=kv, peak_base=peak_base, peak=peak)


def _minus(a, b):
    return None if a is None or b is None else a - b


def _same(a: torch.Tensor, b: torch.Tensor) -> float:
    """The share of new tokens equal to the baseline's, position by position."""
    return round((a == b).float().mean().item(), 3)


def options_text(values: dict) -> str:
    """generate()'s options (or config overrides) as one line: key=value, dicts and lists as JSON."""
    return " ".join(f"{key}={json.dumps(value) if isinstance(value, (dict, list)) else value}"
                    for key, value in values.items())  # fmt: skip
