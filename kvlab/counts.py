"""Bytes and tokens counted from a config's sizes alone: no model built, no transformers imported (a prediction from
a config file answers in a process that never imports it). The element size of a dtype, the heads and head size a
layer caches, each layer's cache type, the bytes one token adds, how many tokens a sliding layer holds, and the
scratch CPU flash attention allocates inside its kernel.
"""

from __future__ import annotations

import functools

import torch

# Layers that keep only a window of tokens (a chunked layer's window is its chunk: 5.x caches it as a sliding layer),
# and attention that caches keys and values per token: the layers kvlab's designs hold.
WINDOWED = ("sliding_attention", "chunked_attention")
ATTENTION = ("full_attention", *WINDOWED)

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of: {', '.join(DTYPES)}")
    return DTYPES[name]


def element_size(dtype: str) -> int:
    return torch.empty((), dtype=parse_dtype(dtype)).element_size()


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_heads(config) -> int:
    """Heads of keys and values a layer caches: grouped (num_key_value_heads) where the model type has that field,
    else one per query head (GPT-2, GPT-J, OPT: a stray num_key_value_heads in their config.json is not read);
    Falcon's own rule (its attention: multi-query caches one head, its new decoder architecture one per query)."""
    if getattr(config, "model_type", None) == "falcon":
        if config.new_decoder_architecture:
            return config.num_attention_heads
        return 1 if config.multi_query else config.num_kv_heads
    if hasattr(config, "num_key_value_heads") and _has_field(type(config), "num_key_value_heads"):
        return config.num_key_value_heads or config.num_attention_heads
    return config.num_attention_heads


@functools.cache
def _has_field(config_class, name: str) -> bool:
    """Whether a config class itself defines `name` (not just a value passed to it)."""
    return not hasattr(config_class, "model_type") or hasattr(config_class(), name)


def layer_kinds(config) -> list[tuple[str, dict]]:
    """Each decoder layer's cache type and its keywords (a window, a number of states), as 5.x's
    `DynamicCache(config=...)` reads a (model's) config. A config without transformers' class (kvlab.planner's
    `PlainConfig`) spells out its layer_types: its sliding layers get the window, as transformers' rule gives them."""
    if not hasattr(config, "get_text_config"):
        return [
            (kind, {"sliding_window": config.sliding_window} if kind in WINDOWED else {}) for kind in config.layer_types
        ]
    from transformers.cache_utils import get_layer_types_and_kwargs  # 5.x only: the 4.x workers never call this

    kinds, options = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    if isinstance(options, dict):  # older 5.x (5.17): one kwargs dict for every layer, not a list per layer
        options = [options] * len(kinds)
    return list(zip(kinds, options))


# Layers that add nothing per token: recurrent state (linear attention, Mamba, conv) and no cache at all
# (MoE/MLP-only layers, layers that read another layer's keys and values).
PER_TOKEN_FREE = ("linear_attention", "conv", "dummy", "moe", "mlp")  # moe, mlp: 5.17's names


def kv_bytes_per_token(config, batch: int, dtype: str) -> int:
    """Bytes one token adds to the KV cache of the whole model: keys and values of every layer that caches them
    per token, or, with multi-head latent attention, the latent and the rotary key that 5.x caches instead."""
    return sum(layer_bytes_per_token(config, batch, dtype))


def layer_bytes_per_token(config, batch: int, dtype: str) -> list[int]:
    """kv_bytes_per_token layer by layer: 0 for a layer that caches nothing per token."""
    if not hasattr(config, "get_text_config"):  # a bare shape (kvlab.encdec's decoder, a PlainConfig): every layer
        return [batch * _token_width(config) * element_size(dtype)] * config.num_hidden_layers
    text = config.get_text_config(decoder=True)
    # Gemma 4: a layer's own config where its head size or heads differ from the others'
    layers = getattr(text, "per_layer_config", None) or [text] * text.num_hidden_layers
    kinds = [kind for kind, _ in layer_kinds(config)]
    size = element_size(dtype)
    return [0 if kind in PER_TOKEN_FREE else batch * _token_width(layer) * size for kind, layer in zip(kinds, layers)]


def _token_width(layer) -> int:
    """Elements one token adds to one layer's cache."""
    if latent := getattr(layer, "kv_lora_rank", None):  # multi-head latent attention: one "head" each
        return latent + layer.qk_rope_head_dim
    return 2 * kv_heads(layer) * head_dim(layer)


def final_kv_bytes(config, sequences: int, tokens: int, dtype: str) -> int:
    """The final KV: every layer's keys and values for `tokens` tokens of each of `sequences` rows (batch x beams),
    sliding layers too (the whole sequence's KV, not what a windowed cache keeps). It is what a point's overhead
    is divided by (`overhead_over_kv`): the cache a run would hold if it were stored once, in full."""
    return kv_bytes_per_token(config, sequences, dtype) * tokens


def sliding_windows(config) -> list[int | None]:
    """Each layer's window, None for a layer that keeps every token, as 5.x's `DynamicCache(config=...)` reads a
    (model's) config: `layer_types` where it has them, else `sliding_window` for every layer (Mistral). A chunked
    layer's window is its chunk: 5.x caches it as a sliding layer, only its mask differs."""
    return [kw.get("sliding_window") if kind in WINDOWED else None for kind, kw in layer_kinds(config)]


def window_tokens(window: int | None, tokens: int, fed: int = 0) -> int:
    """Tokens a 5.x layer of `window` (None: a full layer) holds after `tokens` were fed, `fed` of them by the last
    update: a full layer all of them; a sliding layer its last update's cat output, at most window - 1 tokens from
    before and the `fed` ones (it keeps a view of the last window - 1, what a later query can see)."""
    return tokens if window is None else min(tokens - fed, window - 1) + fed


def flash_scratch_bytes(q_len: int, kv_len: int, head_size: int, reduced: bool, threads: int | None = None) -> int:
    """The scratch CPU flash attention allocates inside its kernel and frees before it returns, which no op
    output shows: per torch thread, one query block's scores against one key block, their row maxima and sums and an
    output block (fp32), plus the scores in the input dtype when that is bf16/fp16 (`reduced`) (ATen's
    `cpu_flash_attention`: query blocks of 32, 64 or 256 rows by length, key blocks of 512; checked against
    PyTorch's profiler). A CPU that packs bf16 keys for its matrix units (AMX) allocates more than this. `threads`:
    the torch threads of the process that runs it (default: this process's)."""
    q_split = min(256 if q_len >= 768 else 64 if q_len >= 192 else 32, q_len)
    kv_split = min(512, kv_len)
    per_thread = (q_split * kv_split + 2 * q_split + q_split * head_size) * 4 + reduced * q_split * kv_split * 2
    return (threads or torch.get_num_threads()) * per_thread  # one block per thread
