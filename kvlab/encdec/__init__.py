"""Encoder–decoder models: requests, and `generate`, greedy decoding written out so that a cache can be handed
in (its tokens equal `model.generate()`'s); docs/encoder-decoder.md. The presets are kvlab.encdec.presets, registered
on import. transformers is imported where it is used: the planner imports this package for the presets' names, and a
prediction from a preset never imports transformers (kvlab.planner.plain)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..compat import cache_argument
from . import presets as presets


def decoder_shape(config) -> tuple[int, int, int]:
    """(decoder layers, heads, head dim) of the caches: the same for self- and cross-attention."""
    if hasattr(config, "d_kv"):  # T5
        return config.num_decoder_layers, config.num_heads, config.d_kv
    return config.decoder_layers, config.decoder_attention_heads, config.d_model // config.decoder_attention_heads


def is_whisper(model_or_config) -> bool:
    return getattr(model_or_config, "config", model_or_config).model_type == "whisper"


@dataclass
class Decoded:
    """What `generate` returns. Unlike kvlab.loops.Generation's `tokens` (prompt + new), only the new tokens:
    an encoder-decoder's input is the encoder's, and its decoder starts from one start token."""

    new_tokens: torch.Tensor  # [batch, new tokens], the decoder start token left out
    cache: object  # the EncoderDecoderCache decoded through
    seconds: float  # wall time, the encoder included unless its output was handed in


@dataclass
class Request:
    """`batch` sequences, an encoder output of `encoder_length` positions (the longest row's). Whisper: a 30 s
    window of mel features (transformers' encoder takes no other), its output cut to `encoder_length`."""

    batch: int
    encoder_length: int
    inputs: dict  # keyword arguments of the model's encoder


def make_request(model, batch: int, encoder_length: int, seed: int = 0, ragged: bool = False) -> Request:
    """A request of random tokens (or mel features); `ragged`: rows of different lengths, padded and masked."""
    if batch < 1 or encoder_length < 1:
        raise ValueError(f"batch and encoder_length must be positive integers, got {batch} and {encoder_length}")
    config, device = model.config, model.device
    generator = torch.Generator().manual_seed(seed)
    if is_whisper(config):
        if encoder_length > config.max_source_positions:
            raise ValueError(
                f"Whisper's encoder gives at most {config.max_source_positions} positions (30 s); "
                f"got encoder_length={encoder_length}"
            )
        frames = 2 * config.max_source_positions  # the feature extractor pads every clip to 30 s
        features = torch.randn(batch, config.num_mel_bins, frames, generator=generator).to(device, model.dtype)
        return Request(batch, encoder_length, dict(input_features=features))
    ids = torch.randint(3, config.vocab_size, (batch, encoder_length), generator=generator)
    mask = torch.ones(batch, encoder_length, dtype=torch.long)
    if ragged and batch > 1:  # the other rows shorter, right-padded: a batch of sentences of different lengths
        lengths = torch.randint(max(1, encoder_length // 2), encoder_length + 1, (batch,), generator=generator)
        lengths[0] = encoder_length
        mask = (torch.arange(encoder_length)[None, :] < lengths[:, None]).long()
        ids = ids.masked_fill(mask == 0, config.pad_token_id)
    return Request(batch, encoder_length, dict(input_ids=ids.to(device), attention_mask=mask.to(device)))


def encode(model, request: Request) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(encoder hidden states [batch, length, d_model], encoder mask or None): run once per request."""
    hidden = model.get_encoder()(**request.inputs).last_hidden_state
    if is_whisper(model):
        hidden = hidden[:, : request.encoder_length]
    return hidden, request.inputs.get("attention_mask")


def generate_reference(model, request: Request, new_tokens: int, whole_output: bool = False, **generate_kwargs):
    """transformers' own `generate()`, greedy, `new_tokens` steps (`whole_output`: its output with the cache).
    Whisper: the shared `GenerationMixin.generate`, without Whisper's language / timestamp logic."""
    from transformers import GenerationMixin
    from transformers.modeling_outputs import BaseModelOutput

    options = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        num_beams=1,
        return_dict_in_generate=whole_output,
        **generate_kwargs,
    )
    if is_whisper(model):
        hidden, _ = encode(model, request)
        start = torch.full((request.batch, 1), model.config.decoder_start_token_id, device=hidden.device)
        out = GenerationMixin.generate(
            model, encoder_outputs=BaseModelOutput(last_hidden_state=hidden), decoder_input_ids=start, **options
        )
    else:
        out = model.generate(**request.inputs, **options)
    return out if whole_output else out[:, 1:]


def generate(model, request: Request, new_tokens: int, cache=None, *, step=None, encoder_output=None) -> Decoded:
    """Greedy decoding: the encoder once (unless `encoder_output`, (hidden, mask), is given), then `new_tokens`
    decoder steps through one `EncoderDecoderCache` (default: two `DynamicCache`s, as `generate()`), or through
    what `cache.for_request(batch, hidden, mask, new_tokens)` hands out (`ReusableStaticCache`). `step`: the
    forward after the first step, which fills the cross-attention cache eagerly (e.g. a compiled `decoder_step`)."""
    from transformers import DynamicCache, EncoderDecoderCache

    if new_tokens < 1:
        raise ValueError(f"new_tokens must be a positive integer, got {new_tokens}")
    started = time.perf_counter()
    with torch.no_grad():
        hidden, mask = encoder_output if encoder_output is not None else encode(model, request)
        if cache is None:
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        elif hasattr(cache, "for_request"):
            cache, hidden, mask = cache.for_request(request.batch, hidden, mask, new_tokens)
        tokens = torch.full(
            (hidden.shape[0], 1), model.config.decoder_start_token_id, dtype=torch.long, device=hidden.device
        )
        generated = []
        for index in range(new_tokens):
            logits = (decoder_step if step is None or index == 0 else step)(model, tokens, hidden, mask, cache)
            tokens = logits.argmax(-1, keepdim=True)
            generated.append(tokens)
            del logits
        out = torch.cat(generated, dim=1)[: request.batch]
    return Decoded(out, cache, time.perf_counter() - started)


def decoder_step(model, tokens, hidden, mask, cache) -> torch.Tensor:
    """One decoder forward over the last tokens; the next-token logits [batch, vocab]."""
    outputs = model(
        encoder_outputs=(hidden,),
        attention_mask=mask,
        decoder_input_ids=tokens,
        use_cache=True,
        **{cache_argument(model): cache},
    )
    return outputs.logits[:, -1]
