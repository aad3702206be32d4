"""One static cache for every request of an encoder–decoder model (transformers issue #35444).

transformers' `StaticCache` reused at a smaller batch fails; a cross-attention cache longer than the encoder
output silently changes every score. `ReusableStaticCache` allocates once, at the maxima, and serves each
request as views of its buffers (`shapes="exact"`) or padded and masked to the maxima (`shapes="max"`, one shape
for a compiler; not Whisper, whose decoder drops the encoder mask). The why and the facts: docs/encoder-decoder.md.
"""

from __future__ import annotations

import torch
from transformers import EncoderDecoderCache, StaticCache
from transformers.cache_utils import Cache, StaticLayer

from ..compat import cache_argument
from ..schema import check_choice
from . import Request, decoder_shape, is_whisper, make_request


class ReusedLayer(StaticLayer):
    """One layer's keys and values, views of buffers allocated once; `bind` picks the part a request uses."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, cross: bool):
        super().__init__(max_cache_len=keys.shape[2])
        self.key_buffer, self.value_buffer, self.cross = keys, values, cross
        self.device = keys.device
        self.num_heads, self.k_head_dim, self.v_head_dim = keys.shape[1], keys.shape[3], values.shape[3]
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.bind(keys.shape[0], keys.shape[2])

    def bind(self, batch: int, length: int) -> None:
        """Serve the next request from the first `batch` rows and `length` positions; forget the last one."""
        self.keys = self.key_buffer[:batch, :, :length]  # views: no allocation, same storage every request
        self.values = self.value_buffer[:batch, :, :length]
        self.batch_size, self.max_cache_len = batch, length
        self.cumulative_length.zero_()
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):
        raise RuntimeError("a ReusedLayer's buffers are allocated when the cache is built")

    def update(self, key_states, value_states, *args, **kwargs):
        batch, length = key_states.shape[0], key_states.shape[2]
        if batch != self.batch_size:
            raise ValueError(
                f"this request was bound to batch {self.batch_size} but the model sent batch {batch}; "
                f"call ReusableStaticCache.for_request() with the request's batch"
            )
        if self.cross and length != self.max_cache_len:
            raise ValueError(
                f"encoder output of {length} positions for a cross-attention cache of {self.max_cache_len}: the "
                f"{self.max_cache_len - length} unused positions would be attended to without a mask and change "
                f"every score; pass the encoder output through ReusableStaticCache.for_request(), which narrows "
                f"the cache to it or pads and masks it"
            )
        return super().update(key_states, value_states, *args, **kwargs)


class ReusableStaticCache:
    """Self- and cross-attention buffers for at most `max_batch` rows, `max_new_tokens` decoder steps and
    `max_encoder_length` encoder positions, allocated here, once; `for_request` hands out the
    `EncoderDecoderCache` of one request."""

    def __init__(
        self,
        config,
        max_batch: int,
        max_new_tokens: int,
        max_encoder_length: int,
        *,
        device="cpu",
        dtype=torch.float32,
        shapes: str = "exact",
    ):
        for name, value in (
            ("max_batch", max_batch),
            ("max_new_tokens", max_new_tokens),
            ("max_encoder_length", max_encoder_length),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        check_choice("shapes", shapes, ("exact", "max"))
        if shapes == "max" and is_whisper(config):
            raise ValueError(
                "shapes='max' pads the encoder output and masks it, but Whisper's decoder passes no "
                "encoder mask to cross-attention; use shapes='exact'"
            )
        self.max_batch, self.max_new_tokens, self.max_encoder_length = max_batch, max_new_tokens, max_encoder_length
        self.shapes = shapes
        layers, heads, head_dim = decoder_shape(config)

        def layer(length, cross):
            keys, values = (torch.zeros(max_batch, heads, length, head_dim, device=device, dtype=dtype) for _ in "kv")
            return ReusedLayer(keys, values, cross)

        # The decoder's self-attention holds the start token and every generated token but the last.
        self.self_layers = [layer(max_new_tokens, cross=False) for _ in range(layers)]
        self.cross_layers = [layer(max_encoder_length, cross=True) for _ in range(layers)]
        self.cache = EncoderDecoderCache(Cache(layers=self.self_layers), Cache(layers=self.cross_layers))

    def buffers(self) -> list[torch.Tensor]:
        return [t for layer in self.self_layers + self.cross_layers for t in (layer.key_buffer, layer.value_buffer)]

    def check(self, batch: int, encoder_length: int, new_tokens: int) -> None:
        """Refuse a request larger than the buffers, naming the limit, before anything runs."""
        for name, value, limit in (
            ("batch", batch, self.max_batch),
            ("encoder length", encoder_length, self.max_encoder_length),
            ("new tokens", new_tokens, self.max_new_tokens),
        ):
            if value > limit:
                raise ValueError(
                    f"request {name} {value} exceeds this cache's maximum of {limit}; build the "
                    f"ReusableStaticCache with a larger max_{name.replace(' ', '_')}"
                )

    def for_request(self, batch: int, encoder_output: torch.Tensor, encoder_mask: torch.Tensor | None, new_tokens: int):
        """(cache, encoder output, encoder mask) to decode one request with; with `shapes="max"` the output is
        zero-padded to the maxima and the mask hides the padded positions (padded rows see every position, so
        no row is all masked; their tokens are dropped)."""
        length = encoder_output.shape[1]
        self.check(batch, length, new_tokens)
        if self.shapes == "max":
            padded = encoder_output.new_zeros(self.max_batch, self.max_encoder_length, encoder_output.shape[2])
            padded[:batch, :length] = encoder_output
            mask = torch.ones(self.max_batch, self.max_encoder_length, dtype=torch.long, device=padded.device)
            mask[:batch, length:] = 0
            if encoder_mask is not None:
                mask[:batch, :length] = encoder_mask
            encoder_output, encoder_mask = padded, mask
            batch, length = self.max_batch, self.max_encoder_length
        for layer in self.self_layers:
            layer.bind(batch, self.max_new_tokens)
        for layer in self.cross_layers:
            layer.bind(batch, length)
        self.cache.is_updated = dict.fromkeys(self.cache.is_updated, False)  # cross-attention refilled at step 1
        return self.cache, encoder_output, encoder_mask


# -- what goes wrong without it: transformers' StaticCache reused as is ----------------------------------
def _scores(model, request, new_tokens, cache=None):
    """generate()'s tokens and scores; the cache under the forward's name (5.24: cache, 5.17: past_key_values)."""
    out = model.generate(
        **request.inputs,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        **({cache_argument(model): cache} if cache is not None else {}),
    )
    return out.sequences[:, 1:], torch.stack(out.scores)


def static_cache_at_smaller_batch(model, max_batch: int, batch: int, encoder_length: int, new_tokens: int) -> str:
    """Fill transformers' `StaticCache` pair at `max_batch`, reset it, reuse it at `batch`: the error's text."""
    cache = EncoderDecoderCache(
        StaticCache(model.config, max_cache_len=new_tokens), StaticCache(model.config, max_cache_len=encoder_length)
    )
    _scores(model, make_request(model, max_batch, encoder_length), new_tokens, cache=cache)
    cache.reset()
    try:
        _scores(model, make_request(model, batch, encoder_length, seed=1), new_tokens, cache=cache)
    except RuntimeError as error:
        return str(error).splitlines()[0]
    raise AssertionError("transformers' StaticCache accepted a smaller batch: this installed release fixed #35444")


def longer_cross_attention_cache(model, batch: int, encoder_length: int, cache_length: int, new_tokens: int) -> dict:
    """A cross-attention `StaticCache` of `cache_length` > the encoder output, used (a) as is and (b) with the
    encoder input right-padded to `cache_length` and masked; each against `generate()`'s own cache.
    Returns the largest |score difference| over every step and the share of tokens that still agree."""
    request = make_request(model, batch, encoder_length)
    tokens, scores = _scores(model, request, new_tokens)
    pad = (0, cache_length - encoder_length)
    padded = Request(
        batch,
        cache_length,
        dict(
            input_ids=torch.nn.functional.pad(request.inputs["input_ids"], pad, value=model.config.pad_token_id),
            attention_mask=torch.nn.functional.pad(request.inputs["attention_mask"], pad, value=0),
        ),
    )
    found = {}
    for name, used in (("unmasked", request), ("masked", padded)):
        cache = EncoderDecoderCache(
            StaticCache(model.config, max_cache_len=new_tokens), StaticCache(model.config, max_cache_len=cache_length)
        )
        other_tokens, other = _scores(model, used, new_tokens, cache=cache)
        found[f"{name}_max_abs_score_diff"] = (other - scores).abs().max().item()
        found[f"{name}_tokens_agree"] = (other_tokens == tokens).float().mean().item()
    return found
