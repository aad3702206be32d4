"""A model from a preset: public config values, seeded random weights; the seeded prompt it is fed; the bytes of its
KV cache (a local config.json or a hub id: kvlab.planner.sources).

Memory does not depend on weight values, so a model built from its public config with random weights
allocates exactly what the real checkpoint would. The presets are kvlab.presets; reading and checking a
config is kvlab.configs. Both are imported where a model is built, not at the top: the real releases' worker
(kvlab.lab.reference, under transformers 4.40.1) imports this module for `random_prompt`, and the presets
name 5.x's config classes.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch

# Counted from a config alone (kvlab.counts); the lessons import them from here, beside the model they count.
from .counts import DTYPES as DTYPES
from .counts import element_size as element_size
from .counts import final_kv_bytes as final_kv_bytes
from .counts import head_dim as head_dim
from .counts import kv_bytes_per_token as kv_bytes_per_token
from .counts import kv_heads as kv_heads
from .counts import layer_bytes_per_token as layer_bytes_per_token
from .counts import layer_kinds as layer_kinds
from .counts import parse_dtype


def assert_varied(new_tokens, least: float = 0.5) -> None:
    """Fail unless every row of generated tokens has at least `least` of its tokens distinct: a check that two
    decoders agree means little if both repeat one token."""
    rows = new_tokens.tolist() if hasattr(new_tokens, "tolist") else [list(row) for row in new_tokens]
    distinct = [len(set(row)) for row in rows]
    assert rows and all(count >= max(2, least * len(row)) for count, row in zip(distinct, rows)), (
        f"degenerate output: distinct tokens per row {distinct} of {[len(row) for row in rows]}; first row {rows[0]}"
    )


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


def resolve_device(device: str | None = "auto") -> str:
    """`"auto"` (or nothing) → CUDA when present, else CPU; anything else is passed through."""
    if device in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def device_name(device: str) -> str:
    """The processor or GPU model a torch device runs on (a record's `device_name`, a notebook's device label)."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    if kind == "meta":
        return "meta (no data)"
    try:  # Linux names the processor model here; platform.processor() is often empty
        return next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def model_class(config) -> type:
    """The Auto class of a config's generating model: decoders, text and speech encoder–decoders."""
    # Imported here, not at the top: a prediction from a config file never builds a model, nor imports transformers.
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq
    from transformers.models.auto.modeling_auto import MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES

    if not config.is_encoder_decoder:
        return AutoModelForCausalLM
    speech = config.model_type in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES  # Whisper
    return AutoModelForSpeechSeq2Seq if speech else AutoModelForSeq2SeqLM


def attention_of(config) -> str:
    """SDPA, or eager where transformers has no SDPA path for the model (GPT-OSS: its attention sinks)."""
    model = model_class(config)._model_mapping.get(type(config), None)
    return "sdpa" if getattr(model, "_supports_sdpa", True) else "eager"


def instantiate(config, dtype: torch.dtype):
    """The model of a config, on the default device; one that transformers cannot build is one line."""
    from .configs import one_line

    try:
        return model_class(config).from_config(config, dtype=dtype)
    # e.g. hidden_act=nope: KeyError 'nope' from the layers; a pad_token_id beyond the vocabulary: AssertionError;
    # a value the layers read and the config lacks (DBRX's attn_config without rope_theta): AttributeError
    except (KeyError, ValueError, TypeError, AssertionError, AttributeError) as error:
        raise ValueError(
            f"transformers cannot build a {config.model_type} model from this config "
            f"({type(error).__name__}: {one_line(error)})"
        ) from None


def build_model(preset: str = "toy", overrides=None, device: str = "cpu", dtype: str = "float32", seed: int = 0):
    """A model in eval mode (a decoder or an encoder–decoder) from a preset: seeded random weights, real ones for the
    presets of `kvlab.weights.REAL_WEIGHTS`. A local config.json or a hub id: kvlab.planner.sources.build_model."""
    from .configs import build_config

    check_device(device)
    torch_dtype = parse_dtype(dtype)
    return random_model(build_config(preset, overrides), device, torch_dtype, seed, preset)


def random_model(config, device: str, dtype: torch.dtype, seed: int, preset: str | None = None):
    """The model of `config` with weights drawn from `seed`, on `device`; a preset's own touches: its scaling of the
    drawn weights (kvlab.presets.AFTER_INIT: the encoder-decoders'), the real weights of kvlab.weights.REAL_WEIGHTS."""
    from .presets import AFTER_INIT
    from .weights import REAL_WEIGHTS, load_state, state_file

    config._attn_implementation = attention_of(config)
    torch.manual_seed(seed)
    with torch.device(device):
        model = instantiate(config, dtype)
    if preset in AFTER_INIT:
        AFTER_INIT[preset](model)
    if preset in REAL_WEIGHTS:
        load_state(model, state_file(preset), dtype)
    return ready_to_generate(model)


def ready_to_generate(model):
    """The model in eval mode, its generation config decoding every step asked for: no EOS, nothing suppressed."""
    g = model.generation_config
    g.eos_token_id = None
    if model.config.is_encoder_decoder:  # greedy argmax and nothing else: Whisper's suppresses tokens at the first step
        g.forced_eos_token_id = g.begin_suppress_tokens = g.suppress_tokens = g.forced_decoder_ids = None
    else:
        g.pad_token_id = 0
    return model.eval()


def random_prompt(vocab_size: int, batch: int, prompt: int, seed: int) -> torch.Tensor:
    """The seeded prompt of a point: `batch` rows of `prompt` token ids, drawn on the CPU so that every device (and
    every release's worker) gets the same ids."""
    return torch.randint(0, vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(seed))
