"""A model's config from a preset (kvlab.presets), a local config.json (or its folder) or a hub id, with
`key=value` overrides checked before anything is built; every refusal is one line naming the choices."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

from .presets import DECODERS, ENCODER_DECODERS, PRESETS


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


def _finish_config(config_class: type, values: dict, overrides, name: str):
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
    return (
        f"{', '.join(DECODERS)} (decoders), {', '.join(ENCODER_DECODERS)} (encoder-decoders), a config.json "
        "path or a hub id like Qwen/Qwen2.5-0.5B"
    )


def config_class(model_type: str) -> type:
    """transformers' config class of a model type (imported here: transformers takes seconds to import)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def build_config(preset: str, overrides=None):
    """The preset's config with overrides applied; raises before anything is allocated."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of: {choices()}")
    model_type, values = PRESETS[preset]
    return _finish_config(config_class(model_type), values, overrides, preset)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers at all: without network, transformers retries for ~25 s."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    try:
        socket.create_connection((urlparse(constants.ENDPOINT).hostname, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def hub_error(name: str, online: bool) -> ValueError:
    where = (
        "the hub has no such model either"
        if online
        else "configs and weights cannot be downloaded here (no network to the Hugging Face hub)"
    )
    return ValueError(f"{name!r} is not in the local Hugging Face cache and {where}; choose one of: {choices()}")


def is_hub_id(source: str) -> bool:
    """`owner/name` with no such local path (nor a .json name): a model on the Hugging Face hub."""
    if "/" not in source or source.endswith(".json") or Path(source).expanduser().exists():
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(source)
    except HFValidationError:  # ./x/config.json, /abs/path, a/b/c: local paths
        return False
    return True


def _hub_config(source: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source, local_files_only=True)
    except OSError:
        online = hub_reachable()
        if online:
            with contextlib.suppress(OSError):
                return AutoConfig.from_pretrained(source)
        raise hub_error(source, online) from None


def _local_config(source: str):
    """A config.json, or the folder holding one; what is wrong with it, named, in one line."""
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(f"{source}: no such file or folder; choose one of: {choices()}")
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{path}: a folder without a config.json")
    try:  # JSON first: its error says where the file breaks, transformers' does not
        json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{file}: not a JSON file ({one_line(error)})") from None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(file)
    except Exception as error:  # any reason transformers gives (no model_type, a validator, a bad value): one line
        raise ValueError(f"{file}: transformers refuses this config ({one_line(error)})") from None


def check_decoder(config, source: str) -> None:
    """Refuse, in one line, a config kvlab cannot decode with: an encoder-decoder (notebook 06 serves those), an
    encoder-only model such as BERT (it reads text and generates none: its causal-LM head is a decoder only when
    built as one, with is_decoder) and a model with no causal LM at all, such as a vision model (ViT)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    kind = config.model_type
    if config.is_encoder_decoder:
        raise ValueError(
            f"{source} is an encoder-decoder model: measure, predict, compare and sweep run decoders; "
            "notebook 06 serves them (kvlab.encdec)"
        )
    if kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        why = f"{source} is an encoder-only model ({kind}): it reads text and generates none"
    elif kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        why = f"{source} is not a text decoder ({kind}: transformers has no causal language model of it)"
    else:
        return
    raise ValueError(f"{why}; kvlab measures generation: give a decoder, one of the presets {', '.join(DECODERS)}")


def load_config(source: str, overrides=None):
    """A config from a preset name, a local config.json (or its folder), or a hub id (local cache first, then the
    hub if it can be reached); overrides checked and applied."""
    if source in PRESETS:
        return build_config(source, overrides)
    if is_hub_id(source):
        config = _hub_config(source)
    elif "/" in source or source.endswith(".json") or Path(source).exists():
        config = _local_config(source)
    else:
        return build_config(source, overrides)  # names the presets
    text = config.get_text_config(decoder=True)
    if text is not config and not config.is_encoder_decoder:
        # An image-text checkpoint (Gemma-3's `gemma3`): the KV cache is its text decoder's, which is what is built.
        print(
            f"{source}: {config.model_type} is an image-text model; kvlab builds its text decoder "
            f"({text.model_type}), without the vision tower",
            file=sys.stderr,
        )
        config = text
    finished = _finish_config(type(config), config.to_dict(), overrides, source)
    if getattr(config, "_experts_implementation", None) and not getattr(finished, "_experts_implementation", None):
        finished._experts_implementation = config._experts_implementation  # to_dict leaves out how experts run
    return finished
