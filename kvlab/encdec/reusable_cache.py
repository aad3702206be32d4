"""One static cache for every request of an encoder–decoder model (transformers issue #35444).

transformers' `StaticCache` allocates each layer at the batch of its first update and writes with
`index_copy_`, so a cache made at batch 4 fails at batch 2 ("Source/destination tensor must have same
slice shapes"); its cross-attention half must be exactly as long as the encoder output, because a longer
one is read whole: the unused positions are attended to and every score changes, silently.
`generate(cache_implementation="static")` avoids both by building a new cache on every call.

`ReusableStaticCache` allocates the buffers once, at a maximum batch, decoder length and encoder length,
and serves each request through `for_request(batch, encoder_output, encoder_mask, new_tokens)` in one of
two ways:

- `shapes="exact"` (default): every layer becomes a view of the first `batch` rows (and, for
  cross-attention, the first `encoder_length` positions) of its buffer. The model sees the shapes of a
  freshly sized cache, so it computes the same thing; no memory is allocated, no padding is computed.
  `torch.compile` sees a new shape for each new batch or encoder length.
- `shapes="max"`: the request is padded to the maximum batch and encoder length, and the padded encoder
  positions are masked. Every request has the same shapes (one compiled graph), at the price of computing
  the padding. Only for models whose decoder applies the encoder mask in cross-attention (T5, BART):
  Whisper's decoder drops it (`encoder_attention_mask=None` in `WhisperDecoder.forward`), so refused there.

Either way a layer refuses, with a one-line error, an update that does not fit the shape it was given:
a batch other than the request's, or an encoder output shorter than its cross-attention view (the
unmasked case that gives wrong scores in transformers), or a request beyond the maxima.
"""

from __future__ import annotations

import torch
from transformers import EncoderDecoderCache
from transformers.cache_utils import Cache, StaticLayer

from . import decoder_shape, is_whisper

SHAPES = ("exact", "max")


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
            raise ValueError(f"this request was bound to batch {self.batch_size} but the model sent batch {batch}; "
                             f"call ReusableStaticCache.for_request() with the request's batch")
        if self.cross and length != self.max_cache_len:
            raise ValueError(
                f"encoder output of {length} positions for a cross-attention cache of {self.max_cache_len}: the "
                f"{self.max_cache_len - length} unused positions would be attended to without a mask and change "
                f"every score; pass the encoder output through ReusableStaticCache.for_request(), which narrows "
                f"the cache to it or pads and masks it")
        return super().update(key_states, value_states, *args, **kwargs)


class ReusableStaticCache:
    """Self- and cross-attention buffers for at most `max_batch` rows, `max_new_tokens` decoder steps and
    `max_encoder_length` encoder positions, allocated here, once; `for_request` hands out the
    `EncoderDecoderCache` for one request (see the module's docstring for `shapes`)."""

    def __init__(self, config, max_batch: int, max_new_tokens: int, max_encoder_length: int, *,
                 device="cpu", dtype=torch.float32, shapes: str = "exact"):
        for name, value in (("max_batch", max_batch), ("max_new_tokens", max_new_tokens),
                            ("max_encoder_length", max_encoder_length)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if shapes not in SHAPES:
            raise ValueError(f"unknown shapes {shapes!r}; choose one of: {', '.join(SHAPES)}")
        if shapes == "max" and is_whisper(config):
            raise ValueError("shapes='max' pads the encoder output and masks it, but Whisper's decoder passes no "
                             "encoder mask to cross-attention; use shapes='exact'")
        self.max_batch, self.max_new_tokens, self.max_encoder_length = max_batch, max_new_tokens, max_encoder_length
        self.shapes = shapes
        layers, heads, head_dim = decoder_shape(config)

        def buffer(length):
            return torch.zeros(max_batch, heads, length, head_dim, device=device, dtype=dtype)

        # The decoder's self-attention holds the start token and every generated token but the last.
        self.self_layers = [ReusedLayer(buffer(max_new_tokens), buffer(max_new_tokens), cross=False)
                            for _ in range(layers)]
        self.cross_layers = [ReusedLayer(buffer(max_encoder_length), buffer(max_encoder_length), cross=True)
                             for _ in range(layers)]
        self.cache = EncoderDecoderCache(Cache(layers=self.self_layers), Cache(layers=self.cross_layers))

    def buffers(self) -> list[torch.Tensor]:
        return [t for layer in self.self_layers + self.cross_layers for t in (layer.key_buffer, layer.value_buffer)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.buffers())

    def check(self, batch: int, encoder_length: int, new_tokens: int) -> None:
        """Refuse a request larger than the buffers, naming the limit, before anything runs."""
        for name, value, limit in (("batch", batch, self.max_batch), ("encoder length", encoder_length,
                                   self.max_encoder_length), ("new tokens", new_tokens, self.max_new_tokens)):
            if value > limit:
                raise ValueError(f"request {name} {value} exceeds this cache's maximum of {limit}; build the "
                                 f"ReusableStaticCache with a larger max_{name.replace(' ', '_')}")

    def for_request(self, batch: int, encoder_output: torch.Tensor, encoder_mask: torch.Tensor | None,
                    new_tokens: int):
        """(cache, encoder output, encoder mask) to decode one request with; the output and mask are padded
        to the maxima when `shapes="max"`, else returned as they are."""
        length = encoder_output.shape[1]
        self.check(batch, length, new_tokens)
        if self.shapes == "max":
            encoder_output, encoder_mask = self._pad(encoder_output, encoder_mask)
            batch, length = self.max_batch, self.max_encoder_length
        for layer in self.self_layers:
            layer.bind(batch, self.max_new_tokens)
        for layer in self.cross_layers:
            layer.bind(batch, length)
        for index in self.cache.is_updated:  # the cross-attention part is filled again at the first step
            self.cache.is_updated[index] = False
        return self.cache, encoder_output, encoder_mask

    def _pad(self, hidden: torch.Tensor, mask: torch.Tensor | None):
        """Zero rows and positions up to the maxima; the mask hides the padded positions (padded rows see
        every position, so no row is all masked; their tokens are dropped)."""
        batch, length = hidden.shape[:2]
        padded = hidden.new_zeros(self.max_batch, self.max_encoder_length, hidden.shape[2])
        padded[:batch, :length] = hidden
        padded_mask = torch.ones(self.max_batch, self.max_encoder_length, dtype=torch.long, device=hidden.device)
        padded_mask[:batch, length:] = 0
        if mask is not None:
            padded_mask[:batch, :length] = mask
        return padded, padded_mask


# -- what goes wrong without it: transformers' StaticCache reused as is ----------------------------------
def _scores(model, request, new_tokens, cache=None, **kwargs):
    if cache is not None:  # generate() takes the cache under the forward's name (5.24: cache, 5.17: past_key_values)
        from ..compat import cache_argument
        kwargs[cache_argument(model)] = cache
    out = model.generate(**request.inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, **kwargs)
    return out.sequences[:, 1:], torch.stack(out.scores)


def static_cache_at_smaller_batch(model, max_batch: int, batch: int, encoder_length: int, new_tokens: int) -> str:
    """Fill transformers' `StaticCache` pair at `max_batch`, reset it, reuse it at `batch`: the error's text."""
    from transformers import StaticCache
    from . import make_request
    config = model.config
    cache = EncoderDecoderCache(StaticCache(config, max_cache_len=new_tokens),
                                StaticCache(config, max_cache_len=encoder_length))
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
    from transformers import StaticCache
    from . import make_request

    def cache():
        return EncoderDecoderCache(StaticCache(model.config, max_cache_len=new_tokens),
                                   StaticCache(model.config, max_cache_len=cache_length))

    request = make_request(model, batch, encoder_length)
    tokens, scores = _scores(model, request, new_tokens)
    unmasked_tokens, unmasked = _scores(model, request, new_tokens, cache=cache())
    pad = cache_length - encoder_length
    ids, mask = request.inputs["input_ids"], request.inputs["attention_mask"]
    padded = dict(input_ids=torch.nn.functional.pad(ids, (0, pad), value=model.config.pad_token_id),
                  attention_mask=torch.nn.functional.pad(mask, (0, pad), value=0))
    masked_tokens, masked = _scores(model, type(request)(batch, cache_length, padded), new_tokens, cache=cache())
    return dict(unmasked_max_abs_score_diff=(unmasked - scores).abs().max().item(),
                unmasked_tokens_agree=(unmasked_tokens == tokens).float().mean().item(),
                masked_max_abs_score_diff=(masked - scores).abs().max().item(),
                masked_tokens_agree=(masked_tokens == tokens).float().mean().item())
