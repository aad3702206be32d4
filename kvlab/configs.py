"""A model's config from a preset (kvlab.presets), with `key=value` overrides checked before anything is built; every
refusal is one line naming the choices. A local config.json (or its folder) or a hub id: kvlab.planner.sources."""

from __future__ import annotations

import contextlib

from .presets import CATALOGUES, DECODERS, ENCODER_DECODERS, PRESETS


def parse_value(text: str):
    """A command-line or grid value: bool, None, int, float, else the text."""
    lowered = text.lower()
    if lowered in ("true", "false", "none", "null"):
        return {"true": True, "false": False}.get(lowered)
    for cast in (int, float):
        with contextlib.suppress(ValueError):
            return cast(text)
    return text


def parse_overrides(items) -> dict:
    """`["num_hidden_layers=2", "vocab_size=500"]`, `"num_hidden_layers=2,vocab_size=500"` or a dict → {key: value}."""
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


# Sizes that must be positive integers (decoders, then T5, BART and Whisper); OPTIONAL_SIZES may be None (derived).
SIZE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "head_dim",
    "max_position_embeddings",
    "d_model",
    "d_kv",
    "d_ff",
    "num_layers",
    "num_decoder_layers",
    "num_heads",
    "encoder_layers",
    "decoder_layers",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
)
OPTIONAL_SIZES = ("head_dim", "num_key_value_heads", "num_decoder_layers")
# Config values derived from others at construction (a loaded config.json spells them out).
DERIVED = {"head_dim": ("hidden_size", "num_attention_heads"), "layer_types": ("num_hidden_layers",)}


def _listed(value) -> list:
    """A size, or a size per layer (Gemma 3n's intermediate_size), as a list."""
    return value if isinstance(value, list) and value else [value]


def check_sizes(values: dict) -> None:
    """Refuse sizes no model can have, before the config (let alone the model) is built."""
    for key in SIZE_KEYS:
        value = values.get(key)
        if key not in values or (value is None and key in OPTIONAL_SIZES):
            continue
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in _listed(value)):
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    heads = values.get("num_attention_heads")
    kv_heads = values.get("num_key_value_heads") or heads
    if heads and heads % kv_heads:
        divisors = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
        raise ValueError(
            f"num_key_value_heads={kv_heads} must divide num_attention_heads={heads}; choose one of: {divisors}"
        )
    hidden = values.get("hidden_size")
    if heads and hidden and not values.get("head_dim") and hidden % heads:
        raise ValueError(
            f"hidden_size={hidden} is not divisible by num_attention_heads={heads} and head_dim is not "
            f"set; choose a multiple of {heads} or set head_dim"
        )


def one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _construct(config_class: type, values: dict, name: str, overrides: dict | None = None):
    from huggingface_hub.errors import StrictDataclassError

    try:
        return config_class(**values)
    except (ValueError, TypeError, StrictDataclassError) as error:  # transformers' own validators: one line
        what = f"the overrides {overrides}" if overrides else "its values"
        raise ValueError(f"the {name} config refuses {what}: {one_line(error)}") from None


def finish_config(config_class: type, values: dict, overrides, name: str):
    """`config_class(**values)` with overrides checked and applied, built from the merged values so that derived
    sizes (head_dim = hidden_size / heads) follow an overridden hidden_size or head count."""
    overrides = parse_overrides(overrides)
    base = _construct(config_class, values, name)
    known = set(base.to_dict())
    for key in overrides:
        if key not in known:
            raise ValueError(
                f"override key {key!r} is not in the {name} config; valid keys: {', '.join(sorted(known))}"
            )
    merged = {**values, **overrides}
    for derived, sources in DERIVED.items():  # re-derived from the new sizes unless overridden too
        if derived not in overrides and any(key in overrides for key in sources):
            merged.pop(derived, None)
    if base.is_encoder_decoder:
        for key in ("decoder_start_token_id", "pad_token_id", "bos_token_id", "eos_token_id"):
            # A shrunk vocabulary (a small twin for tests) keeps its special tokens inside it.
            if merged.get(key) is not None and merged[key] >= merged["vocab_size"]:
                merged[key] = merged["vocab_size"] - 1 - (key == "decoder_start_token_id")
        for key in ("bos_token_id", "eos_token_id"):
            merged.setdefault(key, None)  # Whisper's config class defaults them to GPT-2's ids
    check_sizes(merged)
    config = _construct(config_class, merged, name, overrides)
    # The KV cache only exists if the model uses it; decoding must never stop early, so no EOS.
    config.use_cache = True
    config.eos_token_id = None
    if config.is_encoder_decoder:
        config.forced_eos_token_id = None
    return config


def choices() -> str:
    """The registered presets by kind (kvlab.planner.sources adds a config.json and a hub id)."""
    kinds = ((DECODERS, "decoders"), (ENCODER_DECODERS, "encoder-decoders"))
    return ", ".join(f"{', '.join(names)} ({kind})" for names, kind in kinds if names)


def config_class(model_type: str) -> type:
    """transformers' config class of a model type (imported here: transformers takes seconds to import)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def build_config(preset: str, overrides=None):
    """The preset's config with overrides applied; raises before anything is allocated."""
    if preset not in PRESETS:
        raise ValueError(
            f"unknown preset {preset!r}; choose one of: {choices()} ({CATALOGUES}; a config.json or a hub id: "
            "kvlab.planner.sources.load_config)"
        )
    model_type, values = PRESETS[preset]
    return finish_config(config_class(model_type), values, overrides, preset)
