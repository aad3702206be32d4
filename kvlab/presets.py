"""The preset registry: decoders and encoder–decoders by name, each a model type (kvlab.configs finds transformers'
config class for it) and the values copied from the model's public config.json on the Hugging Face hub, with their
twins and the random initialisation that makes their tokens vary. kvlab.models builds configs and models from them.
Plain values: a prediction reads them without importing transformers.
"""

from __future__ import annotations

import torch

# Values copied from each model's public config.json on the Hugging Face hub.
DECODERS: dict[str, tuple[str, dict]] = {
    # Small enough that CPU decoding of hundreds of tokens takes seconds.
    "toy": (
        "llama",
        dict(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=1000,
            max_position_embeddings=8192,
        ),
    ),
    "tinyllama-1.1b": (
        "llama",
        dict(  # TinyLlama/TinyLlama-1.1B-Chat-v1.0
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            vocab_size=32000,
            max_position_embeddings=2048,
            rms_norm_eps=1e-5,
        ),
    ),
    "qwen2.5-0.5b": (
        "qwen2",
        dict(  # Qwen/Qwen2.5-0.5B
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            use_sliding_window=False,
        ),
    ),
    "llama2-7b": (
        "llama",
        dict(  # meta-llama/Llama-2-7b-hf
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32000,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
        ),
    ),
    "smollm2-135m": (
        "llama",
        dict(  # HuggingFaceTB/SmolLM2-135M-Instruct, as its GGUF file says (real weights: kvlab.weights)
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            vocab_size=49152,
            max_position_embeddings=8192,
            rms_norm_eps=9.999999747378752e-06,  # 1e-5 as the file's float32
            rope_theta=100000.0,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "mistral-7b": (
        "mistral",
        dict(  # mistralai/Mistral-7B-v0.1, sliding window off (as v0.2+)
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
            max_position_embeddings=32768,
            rms_norm_eps=1e-5,
            sliding_window=None,
        ),
    ),
    "llama3-8b": (
        "llama",
        dict(  # meta-llama/Meta-Llama-3-8B
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
        ),
    ),
    "llama3-70b": (
        "llama",
        dict(  # meta-llama/Meta-Llama-3-70B: for planning with predict (80 layers; nothing this size is built here)
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
        ),
    ),
    # Today's attention layouts. Unlisted values are the config class's defaults in transformers 5.24, which
    # are these checkpoints' own except where a value is given here.
    "mistral-7b-v0.1": (
        "mistral",
        dict(  # mistralai/Mistral-7B-v0.1 as released: every layer slides, window 4096
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
            max_position_embeddings=32768,
            rms_norm_eps=1e-5,
            sliding_window=4096,
        ),
    ),
    "gemma-3-4b": (
        "gemma3_text",
        dict(  # google/gemma-3-4b-it's text_config: 5 sliding layers, then 1 full
            hidden_size=2560,
            intermediate_size=10240,
            num_hidden_layers=34,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            vocab_size=262208,
            sliding_window=1024,
            query_pre_attn_scalar=256,
        ),
    ),
    "gpt-oss-20b": (
        "gpt_oss",
        dict(  # openai/gpt-oss-20b: sliding (128) and full layers alternate; 32 experts
            hidden_size=2880,
            intermediate_size=2880,
            num_hidden_layers=24,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=201088,
            sliding_window=128,
            num_local_experts=32,
            num_experts_per_tok=4,
        ),
    ),
    "qwen3-8b": (
        "qwen3",
        dict(  # Qwen/Qwen3-8B: full attention in every layer
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        ),
    ),
}

# Twins: a real model's layers, heads and KV heads, every width divided by TWIN_SCALE (head_dim too where the
# config spells it out; elsewhere it follows hidden_size). The peak's ratios (logits, activations and MLP bytes
# per KV byte) stay the same, and a point at the PR's shape runs on a 2-core CPU in a minute or two instead of
# needing a GPU. Sliding windows and the layer pattern are kept: how far a prompt reaches past the window is
# what a sliding layer's bytes depend on.
TWIN_SCALE = 32
TWIN_WIDTHS = ("hidden_size", "intermediate_size", "vocab_size", "head_dim")


# GPT-OSS's experts run on torch's grouped_mm, which needs rows of a multiple of 16 bytes: 2880 / 32 = 90 is not,
# so its twin's hidden and expert widths are rounded up to 96 (activations 7 % wider than an exact 1/32 scale).
TWIN_EXCEPTIONS = {"gpt-oss-20b": dict(hidden_size=96, intermediate_size=96)}


def _twin(name: str) -> tuple[str, dict]:
    model_type, values = DECODERS[name]
    widths = [key for key in TWIN_WIDTHS if key in values and key not in TWIN_EXCEPTIONS.get(name, {})]
    for key in widths:
        assert values[key] % TWIN_SCALE == 0, f"{name}: {key} is not a multiple of {TWIN_SCALE}"
    return model_type, {
        **values,
        **{key: values[key] // TWIN_SCALE for key in widths},
        **TWIN_EXCEPTIONS.get(name, {}),
    }


TWINS = {
    f"{name}-twin": name
    for name in ("llama2-7b", "mistral-7b", "llama3-8b", "mistral-7b-v0.1", "gemma-3-4b", "gpt-oss-20b", "qwen3-8b")
}
DECODERS.update({twin: _twin(name) for twin, name in TWINS.items()})

# Random weights at transformers' default std (initializer_range 0.02) decode one token over and over: in our
# measurement every position's logits share one dominant direction (cosine 0.4-0.5 with their mean on `toy` and
# the Llama-2 twin), so greedy and beam rows repeat 1-3 tokens and "same tokens" proves little. At 0.1 the
# context moves the argmax and rows are varied. Weights' values change no byte count.
RANDOM_INIT_STD = 0.1
for _, values in DECODERS.values():
    values["initializer_range"] = RANDOM_INIT_STD
# Two twins still repeat a token at 0.1 (our measurement: 4 rows of 20 tokens after a 100-token prompt, fp32 and
# bf16, 1-15 distinct). GPT-OSS's (head_dim 2) varies at 0.3: 19-20 distinct. Gemma-3's varies (13-19) once its
# attention scores are not divided by sqrt(256), query_pre_attn_scalar 1; a wider init alone makes it worse. Random
# weights only: a scalar and an init std change no byte.
DECODERS["gpt-oss-20b-twin"][1]["initializer_range"] = 0.3
DECODERS["gemma-3-4b-twin"][1]["query_pre_attn_scalar"] = 1


# T5Config() and WhisperConfig() default to google-t5/t5-small and openai/whisper-tiny; BartConfig() to
# bart-large's widths. Their start and pad tokens are the checkpoints' own.
ENCODER_DECODERS: dict[str, tuple[str, dict]] = {
    "t5-small": (
        "t5",
        dict(  # google-t5/t5-small
            d_model=512,
            d_kv=64,
            d_ff=2048,
            num_layers=6,
            num_decoder_layers=6,
            num_heads=8,
            vocab_size=32128,
            relative_attention_num_buckets=32,
            feed_forward_proj="relu",
            decoder_start_token_id=0,
            pad_token_id=0,
        ),
    ),
    "whisper-tiny": (
        "whisper",
        dict(  # openai/whisper-tiny
            d_model=384,
            encoder_layers=4,
            decoder_layers=4,
            encoder_attention_heads=6,
            decoder_attention_heads=6,
            encoder_ffn_dim=1536,
            decoder_ffn_dim=1536,
            vocab_size=51865,
            num_mel_bins=80,
            max_source_positions=1500,
            max_target_positions=448,
            decoder_start_token_id=50258,
            pad_token_id=50257,
        ),
    ),
    "bart-base": (
        "bart",
        dict(  # facebook/bart-base
            d_model=768,
            encoder_layers=6,
            decoder_layers=6,
            encoder_attention_heads=12,
            decoder_attention_heads=12,
            encoder_ffn_dim=3072,
            decoder_ffn_dim=3072,
            vocab_size=50265,
            max_position_embeddings=1024,
            decoder_start_token_id=2,
            pad_token_id=1,
        ),
    ),
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
                bias.mul_(5.0 / (model.config.initializer_factor * model.config.d_model**-0.5))
            model.shared.weight.mul_(0.1)
        elif model.config.model_type == "bart":
            # The decoder's learned positions 30x its token embeddings (both std init_std) before its embedding norm.
            model.model.decoder.embed_positions.weight.mul_(30.0)
