"""The encoder–decoder presets, registered in kvlab.presets on import (`import kvlab.encdec` does it), and the scaling
of their random weights that makes each step's token differ (`vary_decoder`)."""

from __future__ import annotations

import torch

from ..presets import register

# Random weights at the default init decode one token over and over here too (T5 and BART: their LM head is the
# input embedding, and the greedy argmax stays on the token fed in), and the output ignores the encoder. These init
# values and the position scaling in vary_decoder() make each step's token differ, and differ with the encoder
# input, in our measurement (tests/test_encdec.py); weights' values change no byte count.
# BART keeps its default init_std 0.02 at its real width (a 64-wide BART needs 0.1: tests/test_encdec.py).
RANDOM_INIT = {"t5-small": dict(initializer_factor=1.5), "whisper-tiny": dict(init_std=0.5)}


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


def _register(name: str, model_type: str, values: dict) -> None:
    register(name, model_type, {**values, **RANDOM_INIT.get(name, {})}, encoder_decoder=True, after_init=vary_decoder)


# T5Config() and WhisperConfig() default to google-t5/t5-small and openai/whisper-tiny; BartConfig() to
# bart-large's widths. Their start and pad tokens are the checkpoints' own.
_register(
    "t5-small",
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
)
_register(
    "whisper-tiny",
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
)
_register(
    "bart-base",
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
)
