"""Model presets: public config values, seeded random weights, no network.

Memory does not depend on weight values, so a model built from its public config with random
weights allocates exactly what the real checkpoint would. A hub id (anything with a "/") loads the
real weights instead, for Colab users with network access.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

# Values copied from each model's public config.json on the Hugging Face hub.
PRESETS: dict[str, tuple[type, dict]] = {
    # Small enough that CPU decoding of hundreds of tokens takes seconds.
    "toy": (LlamaConfig, dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=1000, max_position_embeddings=8192)),
    "tinyllama-1.1b": (LlamaConfig, dict(  # TinyLlama/TinyLlama-1.1B-Chat-v1.0
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5)),
    "qwen2.5-0.5b": (Qwen2Config, dict(  # Qwen/Qwen2.5-0.5B
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=True, use_sliding_window=False)),
    "llama2-7b": (LlamaConfig, dict(  # meta-llama/Llama-2-7b-hf
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5)),
    "mistral-7b": (MistralConfig, dict(  # mistralai/Mistral-7B-v0.1, sliding window off (as v0.2+)
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5,
        sliding_window=None)),
    "llama3-8b": (LlamaConfig, dict(  # meta-llama/Meta-Llama-3-8B
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=500000.0)),
}

# Twins: a real model's layers, heads and KV heads, every width divided by TWIN_SCALE. The peak's
# ratios (logits, activations and MLP bytes per KV byte) stay the same, and a point at the PR's
# shape runs on a 2-core CPU in under a minute instead of needing a GPU.
TWIN_SCALE = 32
TWIN_WIDTHS = ("hidden_size", "intermediate_size", "vocab_size")


def _twin(name: str) -> tuple[type, dict]:
    config_class, values = PRESETS[name]
    for key in TWIN_WIDTHS:
        assert values[key] % TWIN_SCALE == 0, f"{name}: {key} is not a multiple of {TWIN_SCALE}"
    return config_class, {**values, **{key: values[key] // TWIN_SCALE for key in TWIN_WIDTHS}}


TWINS = {f"{name}-twin": name for name in ("llama2-7b", "mistral-7b", "llama3-8b")}
PRESETS.update({twin: _twin(name) for twin, name in TWINS.items()})

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def is_hub_id(preset: str) -> bool:
    return "/" in preset


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of: {', '.join(DTYPES)}")
    return DTYPES[name]


def check_device(device: str) -> str:
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda", "meta"):
        raise ValueError(f"unknown device {device!r}; choose one of: cpu, cuda, meta")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for but no CUDA GPU is available; choose one of: cpu, meta")
    return device


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str | None = "auto") -> str:
    """`"auto"` (or nothing) → CUDA when present, else CPU; anything else is passed through."""
    return default_device() if device in (None, "", "auto") else device


def parse_value(text: str):
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_overrides(items) -> dict:
    """`["num_hidden_layers=2", "vocab_size=500"]`, `"num_hidden_layers=2,vocab_size=500"` or a dict
    → {key: typed value}."""
    if isinstance(items, dict):
        return dict(items)
    if isinstance(items, str):
        items = [item for item in items.split(",") if item.strip()]
    overrides = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not of the form key=value")
        overrides[key.strip()] = parse_value(value.strip())
    return overrides


def build_config(preset: str, overrides=None):
    """The preset's config with overrides applied; raises before anything is allocated."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)} (or a hub id like Qwen/Qwen2.5-0.5B)")
    config_class, values = PRESETS[preset]
    config = config_class(**values)
    overrides = parse_overrides(overrides)
    known = set(config.to_dict())
    for key, value in overrides.items():
        if key not in known:
            raise ValueError(f"override key {key!r} is not in the {preset} config; valid keys: {', '.join(sorted(known))}")
        setattr(config, key, value)
    # The KV cache only exists if the model uses it; decoding must never stop early, so no EOS.
    config.use_cache = True
    config.eos_token_id = None
    return config


def build_model(preset: str = "toy", overrides=None, device: str = "cpu", dtype: str = "float32", seed: int = 0):
    """A causal LM in eval mode: random weights (seeded) from a preset, or real weights from a hub id."""
    check_device(device)
    torch_dtype = parse_dtype(dtype)
    if is_hub_id(preset):
        model = AutoModelForCausalLM.from_pretrained(preset, dtype=torch_dtype).to(device)
        model.generation_config.eos_token_id = None
        return model.eval()
    config = build_config(preset, overrides)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters and buffers, each storage counted once (tied embeddings share one)."""
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        storage = tensor.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            total += storage.nbytes()
    return total


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def element_size(dtype: str) -> int:
    return torch.empty((), dtype=parse_dtype(dtype)).element_size()


def kv_bytes_per_token(config, batch: int, dtype: str) -> int:
    """Bytes one token adds to the KV cache of the whole model (keys and values, every layer)."""
    return 2 * config.num_hidden_layers * batch * config.num_key_value_heads * head_dim(config) * element_size(dtype)
