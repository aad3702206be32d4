"""Model presets: public config values, seeded random weights, no network.

Memory does not depend on weight values, so a model built from its public config with random
weights allocates exactly what the real checkpoint would. One registry holds the decoders (what a
point measures) and the encoder–decoders (what kvlab.encdec's request streams serve); a model is named
by a preset, a local config.json (or its folder), or a hub id (`owner/name`, real weights, for Colab
users with network access) when no such local path exists.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch
from huggingface_hub.errors import StrictDataclassError
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq,
                          BartConfig, LlamaConfig, MistralConfig, Qwen2Config, T5Config, WhisperConfig)
from transformers.models.auto.modeling_auto import MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES

# Values copied from each model's public config.json on the Hugging Face hub.
DECODERS: dict[str, tuple[type, dict]] = {
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
# shape runs on a 2-core CPU in a minute or two instead of needing a GPU.
TWIN_SCALE = 32
TWIN_WIDTHS = ("hidden_size", "intermediate_size", "vocab_size")


def _twin(name: str) -> tuple[type, dict]:
    config_class, values = DECODERS[name]
    for key in TWIN_WIDTHS:
        assert values[key] % TWIN_SCALE == 0, f"{name}: {key} is not a multiple of {TWIN_SCALE}"
    return config_class, {**values, **{key: values[key] // TWIN_SCALE for key in TWIN_WIDTHS}}


TWINS = {f"{name}-twin": name for name in ("llama2-7b", "mistral-7b", "llama3-8b")}
DECODERS.update({twin: _twin(name) for twin, name in TWINS.items()})

# Random weights at transformers' default std (initializer_range 0.02) decode one token over and over: in our
# measurement every position's logits share one dominant direction (cosine 0.4-0.5 with their mean on `toy` and
# the Llama-2 twin), so greedy and beam rows repeat 1-3 tokens and "same tokens" proves little. At 0.1 the
# context moves the argmax and rows are varied. Weights' values change no byte count.
RANDOM_INIT_STD = 0.1
for _, values in DECODERS.values():
    values["initializer_range"] = RANDOM_INIT_STD


def assert_varied(new_tokens, least: float = 0.5) -> None:
    """Fail unless every row of generated tokens (a tensor or lists, the prompt left out) has at least `least` of
    its tokens distinct: a check that two decoders agree means little if both repeat one token."""
    rows = new_tokens.tolist() if hasattr(new_tokens, "tolist") else [list(row) for row in new_tokens]
    distinct = [len(set(row)) for row in rows]
    assert rows and all(count >= max(2, least * len(row)) for count, row in zip(distinct, rows)), (
        f"degenerate output: distinct tokens per row {distinct} of {[len(row) for row in rows]}; first row {rows[0]}")

# T5Config() and WhisperConfig() default to google-t5/t5-small and openai/whisper-tiny; BartConfig() to
# bart-large's widths. Their start and pad tokens are the checkpoints' own.
ENCODER_DECODERS: dict[str, tuple[type, dict]] = {
    "t5-small": (T5Config, dict(  # google-t5/t5-small
        d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6, num_heads=8, vocab_size=32128,
        relative_attention_num_buckets=32, feed_forward_proj="relu", decoder_start_token_id=0, pad_token_id=0)),
    "whisper-tiny": (WhisperConfig, dict(  # openai/whisper-tiny
        d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6, decoder_attention_heads=6,
        encoder_ffn_dim=1536, decoder_ffn_dim=1536, vocab_size=51865, num_mel_bins=80, max_source_positions=1500,
        max_target_positions=448, decoder_start_token_id=50258, pad_token_id=50257)),
    "bart-base": (BartConfig, dict(  # facebook/bart-base
        d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12, decoder_attention_heads=12,
        encoder_ffn_dim=3072, decoder_ffn_dim=3072, vocab_size=50265, max_position_embeddings=1024,
        decoder_start_token_id=2, pad_token_id=1)),
}
# Random weights at the default init decode one token over and over here too (T5 and BART: their LM head is the
# input embedding, and the greedy argmax stays on the token fed in), and the output ignores the encoder. These init
# values and the position scaling in vary_decoder() make each step's token differ, and differ with the encoder
# input, in our measurement (tests/test_encdec.py); weights' values change no byte count.
# BART keeps its default init_std 0.02 at its real width (a 64-wide BART needs 0.1: tests/test_encdec.py).
RANDOM_INIT = {"t5-small": dict(initializer_factor=1.5), "whisper-tiny": dict(init_std=0.5)}
for _name, _init in RANDOM_INIT.items():
    ENCODER_DECODERS[_name][1].update(_init)
PRESETS = {**DECODERS, **ENCODER_DECODERS}


def vary_decoder(model) -> None:
    """Post-init scaling for the encoder-decoder presets' random weights: a decoder step whose input is mostly
    its token's embedding repeats that token (the tied head's argmax), so the position signal is made strong."""
    with torch.no_grad():
        if model.config.model_type == "t5":
            # No absolute positions: both stacks' relative-position biases (std 1.5 / sqrt(d_model)) raised to
            # std 5, and the shared embedding (std 1.5) cut 10-fold so that the residual stream is not the fed token.
            for stack in (model.encoder, model.decoder):
                bias = stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight
                bias.mul_(5.0 / (model.config.initializer_factor * model.config.d_model ** -0.5))
            model.shared.weight.mul_(0.1)
        elif model.config.model_type == "bart":
            # The decoder's learned positions 30x its token embeddings (both std init_std) before its embedding norm.
            model.model.decoder.embed_positions.weight.mul_(30.0)


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


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


# Sizes that must be positive integers (decoders, then T5, BART and Whisper); those in OPTIONAL_SIZES may be None
# (derived from the others).
SIZE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "vocab_size", "head_dim", "max_position_embeddings", "d_model", "d_kv", "d_ff", "num_layers",
             "num_decoder_layers", "num_heads", "encoder_layers", "decoder_layers", "encoder_attention_heads",
             "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim")
OPTIONAL_SIZES = ("head_dim", "num_key_value_heads", "num_decoder_layers")


# Config values derived from others at construction (a loaded config.json spells them out).
DERIVED = {"head_dim": ("hidden_size", "num_attention_heads"), "layer_types": ("num_hidden_layers",)}


def check_sizes(values: dict) -> None:
    """Refuse sizes no model can have, before the config (let alone the model) is built."""
    for key in SIZE_KEYS:
        value = values.get(key)
        if key not in values or (value is None and key in OPTIONAL_SIZES):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    heads = values.get("num_attention_heads")
    kv_heads = values.get("num_key_value_heads") or heads
    if heads and heads % kv_heads:
        divisors = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
        raise ValueError(f"num_key_value_heads={kv_heads} must divide num_attention_heads={heads}; "
                         f"choose one of: {divisors}")
    hidden = values.get("hidden_size")
    if heads and hidden and not values.get("head_dim") and hidden % heads:
        raise ValueError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads} and head_dim is not "
                         f"set; choose a multiple of {heads} or set head_dim")


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _construct(config_class: type, values: dict, name: str, overrides: dict | None = None):
    try:
        return config_class(**values)
    except (ValueError, TypeError, StrictDataclassError) as error:  # transformers' own validators: one line
        what = f"the overrides {overrides}" if overrides else "its values"
        raise ValueError(f"the {name} config refuses {what}: {_one_line(error)}") from None


def _finish_config(config_class: type, values: dict, overrides, name: str):
    """`config_class(**values)` with overrides checked and applied. Built from the merged values, so that
    derived sizes (head_dim = hidden_size / heads) follow an overridden hidden_size or head count."""
    overrides = parse_overrides(overrides)
    base = _construct(config_class, values, name)
    known = set(base.to_dict())
    for key in overrides:
        if key not in known:
            raise ValueError(f"override key {key!r} is not in the {name} config; valid keys: {', '.join(sorted(known))}")
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
    return (f"{', '.join(DECODERS)} (decoders), {', '.join(ENCODER_DECODERS)} (encoder-decoders), a config.json "
            "path or a hub id like Qwen/Qwen2.5-0.5B")


def build_config(preset: str, overrides=None):
    """The preset's config with overrides applied; raises before anything is allocated."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of: {choices()}")
    config_class, values = PRESETS[preset]
    return _finish_config(config_class, values, overrides, preset)


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
    where = ("the hub has no such model either" if online else
             "configs and weights cannot be downloaded here (no network to the Hugging Face hub)")
    return ValueError(f"{name!r} is not in the local Hugging Face cache and {where}; choose one of: {choices()}")


def is_hub_id(source: str) -> bool:
    """`owner/name` with no such local path (nor a .json name): a model on the Hugging Face hub."""
    if "/" not in source or source.endswith(".json") or Path(source).expanduser().exists():
        return False
    try:
        validate_repo_id(source)
    except HFValidationError:  # ./x/config.json, /abs/path, a/b/c: local paths
        return False
    return True


def _hub_config(source: str):
    try:
        return AutoConfig.from_pretrained(source, local_files_only=True)
    except OSError:
        online = hub_reachable()
        if online:
            try:
                return AutoConfig.from_pretrained(source)
            except OSError:
                pass
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
        raise ValueError(f"{file}: not a JSON file ({_one_line(error)})") from None
    try:
        return AutoConfig.from_pretrained(file)
    except Exception as error:  # any reason transformers gives (no model_type, a validator, a bad value): one line
        raise ValueError(f"{file}: transformers refuses this config ({_one_line(error)})") from None


def load_config(source: str, overrides=None):
    """A config from a preset name, a local config.json (or the folder holding one), or a hub id (local
    cache first, the hub if it can be reached); overrides checked and applied."""
    if source in PRESETS:
        return build_config(source, overrides)
    if is_hub_id(source):
        config = _hub_config(source)
    elif "/" in source or source.endswith(".json") or Path(source).exists():
        config = _local_config(source)
    else:
        return build_config(source, overrides)  # names the presets
    return _finish_config(type(config), config.to_dict(), overrides, source)


def model_class(config) -> type:
    """The Auto class of a config's generating model: decoders, text and speech encoder–decoders."""
    if not config.is_encoder_decoder:
        return AutoModelForCausalLM
    speech = config.model_type in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES  # Whisper
    return AutoModelForSpeechSeq2Seq if speech else AutoModelForSeq2SeqLM


def instantiate(config, dtype: torch.dtype):
    """The model of a config, on the default device; one that transformers cannot build is one line."""
    try:
        return model_class(config).from_config(config, dtype=dtype)
    except (KeyError, ValueError, TypeError) as error:  # e.g. hidden_act=nope: KeyError 'nope' from the layers
        raise ValueError(f"transformers cannot build a {config.model_type} model from this config "
                         f"({type(error).__name__}: {_one_line(error)})") from None


def build_model(preset: str = "toy", overrides=None, device: str = "cpu", dtype: str = "float32", seed: int = 0):
    """A model in eval mode (a decoder or an encoder–decoder): random weights (seeded) from a preset or a
    local config.json, or real weights from a hub id."""
    check_device(device)
    torch_dtype = parse_dtype(dtype)
    config = load_config(preset, overrides)
    if is_hub_id(preset):
        online = hub_reachable()
        try:
            model = model_class(config).from_pretrained(preset, config=config, dtype=torch_dtype,
                                                        local_files_only=not online).to(device)
        except OSError:
            raise hub_error(preset, online) from None
    else:
        config._attn_implementation = "sdpa"
        torch.manual_seed(seed)
        with torch.device(device):
            model = instantiate(config, torch_dtype)
        if preset in ENCODER_DECODERS:
            vary_decoder(model)
    g = model.generation_config
    g.eos_token_id = None
    if config.is_encoder_decoder:  # greedy argmax and nothing else: Whisper's suppresses tokens at the first step
        g.forced_eos_token_id = g.begin_suppress_tokens = g.suppress_tokens = g.forced_decoder_ids = None
    else:
        g.pad_token_id = 0
    return model.eval()


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def element_size(dtype: str) -> int:
    return torch.empty((), dtype=parse_dtype(dtype)).element_size()


def kv_bytes_per_token(config, batch: int, dtype: str) -> int:
    """Bytes one token adds to the KV cache of the whole model (keys and values, every layer)."""
    return 2 * config.num_hidden_layers * batch * config.num_key_value_heads * head_dim(config) * element_size(dtype)
