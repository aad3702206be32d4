"""The decoder catalogue: the real models beyond the lessons' presets, with their twins, registered in kvlab.presets on
import. The planner, the lab, the savers, the waste and the command line take them (kvlab.planner.sources imports
this module); the lessons' presets are kvlab.presets' own.
"""

from __future__ import annotations

from .presets import register, twin

# Values copied from each model's public config.json on the Hugging Face hub.
register(
    "tinyllama-1.1b",
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
)
register(
    "qwen2.5-0.5b",
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
)
register(
    "llama3-8b",
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
)
register(
    "llama3-70b",
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
)
# Today's attention layouts. Unlisted values are the config class's defaults in transformers 5.24, which
# are these checkpoints' own except where a value is given here.
register(
    "mistral-7b-v0.1",
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
)
register(
    "gemma-3-4b",
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
)
register(
    "gpt-oss-20b",
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
)
register(
    "qwen3-8b",
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
)

# Twins (kvlab.presets.twin). Two still repeat a token at kvlab.presets.RANDOM_INIT_STD (our measurement: 4 rows of
# 20 tokens after a 100-token prompt, fp32 and bf16, 1-15 distinct). GPT-OSS's (head_dim 2) varies at 0.3: 19-20
# distinct. Gemma-3's varies (13-19) once its attention scores are not divided by sqrt(256), query_pre_attn_scalar 1;
# a wider init alone makes it worse. Random weights only: a scalar and an init std change no byte.
register("llama3-8b-twin", *twin("llama3-8b"))
register("mistral-7b-v0.1-twin", *twin("mistral-7b-v0.1"))
_type, _values = twin("gemma-3-4b")
register("gemma-3-4b-twin", _type, {**_values, "query_pre_attn_scalar": 1})
# GPT-OSS's experts run on torch's grouped_mm, which needs rows of a multiple of 16 bytes: 2880 / 32 = 90 is not, so
# its twin's hidden and expert widths are rounded up to 96 (activations 7 % wider than an exact 1/32 scale).
_type, _values = twin("gpt-oss-20b", hidden_size=96, intermediate_size=96)
register("gpt-oss-20b-twin", _type, {**_values, "initializer_range": 0.3})
register("qwen3-8b-twin", *twin("qwen3-8b"))
