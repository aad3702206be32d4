"""The KV-cache designs, as transformers cache layers that the model's own forward updates.

- tuple:    transformers <= 4.41: the caller holds a tuple of (keys, values) per layer; each forward wraps it in a
            fresh cache object, each layer `torch.cat`s into a new tensor, and a new tuple is handed back while
            the caller still holds the old one: both live at once.
- dynamic:  PR #30536 and transformers' `DynamicLayer`: ONE cache object for the loop; `self.keys = cat(...)`
            drops the only reference to the old tensor, freed at once (still a full copy per step, not kept).
- list:     PR #30536's first design: chunks per layer, joined for attention, consolidated every `chunk_limit`.
- static:   transformers' own `StaticCache`, preallocated to `max_cache_len`.
- prealloc: ours: a buffer per layer that grows in blocks of `block_tokens`, written in place, read as a view;
            on a sliding-window layer, a window buffer of W - 1 + `block_tokens` slots (`WindowLayer`).

On a model with sliding-window layers `dynamic` and `prealloc` give those layers their sliding form, as
`generate()`'s default cache does; a layer that is not attention (linear attention, Mamba, MoE-only, KV-sharing)
keeps 5.x's own cache in every design but `tuple`, which refuses such a model. Our layers keep the whole contract
of transformers' `CacheLayerMixin`.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticCache,
)

from .compat import cache_argument
from .counts import ATTENTION, WINDOWED, layer_kinds
from .counts import sliding_windows as sliding_windows  # lesson 05 imports it from here
from .meter import storage_bytes
from .schema import CACHES, DEFAULTS


class CatLayer(DynamicLayer):
    """`dynamic` (and each layer of `tuple`): transformers' own `DynamicLayer` (cat and replace), named."""


class SlidingCatLayer(DynamicSlidingWindowLayer):
    """`dynamic` on a sliding layer: transformers' own layer, named. Each step cats the window and the new token
    and keeps a view of the last W - 1; after a prompt longer than the window, that view keeps the whole prompt's
    tensor alive until the first decode step."""


class _OwnLayer(CacheLayerMixin):
    """What our layers share. Each defines `_each(fn)` (replace every stored tensor by `fn` of it, one at a time:
    the transient is one chunk or buffer, never the layer), `_keep(length)` and `tensors()`."""

    is_croppable = True

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device, self.dtype, self.is_initialized = key_states.device, key_states.dtype, True

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1  # grows without a maximum

    def crop(self, tokens_to_remove: int) -> None:
        # As transformers 5.x's DynamicLayer.crop: minus the number of tokens to remove.
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes minus the number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove < 0 and self.get_seq_length() > 0:
            self._keep(max(0, self.get_seq_length() + tokens_to_remove))

    def reorder_cache(self, beam_idx) -> None:
        self._each(lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._each(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices) -> None:
        self._each(lambda tensor: tensor[indices, ...])

    def offload(self):
        self._each(lambda tensor: tensor.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.tensors() and self.tensors()[0].device != self.device:
            self._each(lambda tensor: tensor.to(self.device, non_blocking=True))


class _Joined:
    """`ListLayer.keys` / `.values`: the chunks joined at each read, not kept (a transient copy of the layer, as
    the concatenation `update` hands attention); setting one makes it the only chunk."""

    def __init__(self, chunks: str):
        self.chunks = chunks

    def __get__(self, layer, owner=None):
        if layer is None:
            return self
        chunks = getattr(layer, self.chunks)
        return torch.cat(chunks, dim=-2) if len(chunks) > 1 else chunks[0] if chunks else None

    def __set__(self, layer, tensor):
        setattr(layer, self.chunks, [] if tensor is None else [tensor])


class ListLayer(_OwnLayer):
    """`list`: chunks; attention gets their concatenation (a transient copy of the layer)."""

    keys, values = _Joined("key_chunks"), _Joined("value_chunks")

    def __init__(self, chunk_limit: int = DEFAULTS["chunk_limit"]):
        super().__init__()  # keys = values = None: no chunks
        self.chunk_limit = chunk_limit

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.key_chunks.append(key_states)
        self.value_chunks.append(value_states)
        if len(self.key_chunks) >= self.chunk_limit:  # consolidate: the list becomes one chunk
            self.key_chunks = [torch.cat(self.key_chunks, dim=-2)]
            self.value_chunks = [torch.cat(self.value_chunks, dim=-2)]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return sum(chunk.shape[-2] for chunk in self.key_chunks)

    def reset(self) -> None:
        self.keys = self.values = None

    def _keep(self, length: int) -> None:
        self.keys = self.keys[..., :length, :]
        self.values = self.values[..., :length, :]

    def _each(self, fn) -> None:
        for chunks in (self.key_chunks, self.value_chunks):
            for i, chunk in enumerate(chunks):
                chunks[i] = fn(chunk)

    def tensors(self):
        return self.key_chunks + self.value_chunks


class PreallocLayer(_OwnLayer):
    """`prealloc`: a buffer that grows in blocks; each step writes the new tokens in place and returns views."""

    def __init__(self, block_tokens: int = DEFAULTS["block_tokens"]):
        super().__init__()
        self.block_tokens = block_tokens
        self.key_buffer = self.value_buffer = None
        self.length = 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if self.key_buffer is None or end > self.key_buffer.shape[-2]:
            self.keys = self.values = None  # views of the old buffers would keep them alive
            self.key_buffer = self._grown(self.key_buffer, key_states, end)
            self.value_buffer = self._grown(self.value_buffer, value_states, end)
        self.key_buffer[:, :, start:end].copy_(key_states)
        self.value_buffer[:, :, start:end].copy_(value_states)
        self._keep(end)
        return self.keys, self.values

    def _grown(self, buffer, like, needed):
        """A buffer with room for `needed` tokens rounded up to a block; the old one dies on return."""
        capacity = math.ceil(needed / self.block_tokens) * self.block_tokens
        grown = like.new_empty((*like.shape[:-2], capacity, like.shape[-1]))
        if buffer is not None:
            grown[:, :, : self.length].copy_(buffer[:, :, : self.length])
        return grown

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self._keep(0)  # the buffers stay, to be written again

    def _keep(self, length: int) -> None:
        self.length = length
        self._views()

    def _views(self) -> None:
        if self.key_buffer is not None:
            self.keys, self.values = self.key_buffer[:, :, : self.length], self.value_buffer[:, :, : self.length]

    def _each(self, fn) -> None:
        if self.key_buffer is not None:
            self.keys = self.values = None  # views of the old buffers would keep them alive
            self.key_buffer = fn(self.key_buffer)
            self.value_buffer = fn(self.value_buffer)
            self._views()

    def tensors(self):
        return [t for t in (self.key_buffer, self.value_buffer) if t is not None]


class WindowLayer(PreallocLayer):
    """`prealloc` on a sliding layer of window W: the last W - 1 tokens (all a later query sees, what transformers'
    `DynamicSlidingWindowLayer` keeps), in order, in a buffer of W - 1 + `block_tokens` slots, written in place.
    When the buffer is full the window moves to its front: one copy every `block_tokens` steps, where
    transformers' layer cats every step. Of a prompt longer than the buffer only the last W - 1 tokens are kept.

    Why not a ring of W slots: attention would get the window rotated, and 5.24's masks index the padding mask by
    position in the keys (`masking_utils.padding_mask_function`): a left-padded batch would mask the wrong keys
    (a left-padded test in test_cache_contract.py pins the order)."""

    is_sliding = True

    def __init__(self, sliding_window: int, block_tokens: int = DEFAULTS["block_tokens"]):
        super().__init__(block_tokens)
        self.sliding_window = sliding_window
        self.start = self.end = 0  # buffer[start:end]: the kept tokens, oldest first
        self.cumulative_length = 0  # tokens seen, as transformers' layer counts them

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new, capacity = key_states.shape[-2], self.sliding_window - 1 + self.block_tokens
        self.cumulative_length += new
        if self.key_buffer is None:
            self.key_buffer = key_states.new_empty((*key_states.shape[:-2], capacity, key_states.shape[-1]))
            self.value_buffer = value_states.new_empty((*value_states.shape[:-2], capacity, value_states.shape[-1]))
        if self.end + new > capacity and self.start > 0:  # move the window to the front, to make room
            kept = self.end - self.start
            for buffer in (self.key_buffer, self.value_buffer):  # clone: source and target may overlap
                buffer[:, :, :kept].copy_(buffer[:, :, self.start : self.end].clone())
            self.start, self.end = 0, kept
        if self.end + new <= capacity:
            self.key_buffer[:, :, self.end : self.end + new].copy_(key_states)
            self.value_buffer[:, :, self.end : self.end + new].copy_(value_states)
            self.end += new
            keys, values = self.key_buffer[:, :, self.start : self.end], self.value_buffer[:, :, self.start : self.end]
        else:  # more tokens than the buffer holds: attention reads them joined, as transformers' layer does
            keys, values = key_states, value_states
            if self.end > self.start:
                keys = torch.cat([self.key_buffer[:, :, self.start : self.end], key_states], dim=-2)
                values = torch.cat([self.value_buffer[:, :, self.start : self.end], value_states], dim=-2)
            tail = min(self.sliding_window - 1, keys.shape[-2])
            self.key_buffer[:, :, :tail].copy_(keys[:, :, keys.shape[-2] - tail :])
            self.value_buffer[:, :, :tail].copy_(values[:, :, values.shape[-2] - tail :])
            self.start, self.end = 0, tail
        self.start = max(self.start, self.end - (self.sliding_window - 1))  # what no later query can see
        self._views()
        return keys, values

    def _views(self) -> None:
        if self.key_buffer is not None:
            self.keys = self.key_buffer[:, :, self.start : self.end]
            self.values = self.value_buffer[:, :, self.start : self.end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return DynamicSlidingWindowLayer.get_mask_sizes(self, query_length)  # the same counts, the same formula

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.sliding_window

    def crop(self, tokens_to_remove: int) -> None:
        # As transformers' layer without past recording: tokens that left the window cannot come back.
        if tokens_to_remove < 0 and self.cumulative_length >= self.sliding_window:
            raise RuntimeError("crop past the sliding window: the tokens before it are no longer kept")
        super().crop(tokens_to_remove)

    def _keep(self, length: int) -> None:  # only below the window (crop), where start is 0
        self.start, self.end = 0, length
        self.cumulative_length = length
        self._views()


class KVCache(Cache):
    """A transformers `Cache` made of our layers, so the model's forward (and `generate()`) accept it."""

    def __init__(self, layers):  # positional, as the designs are written
        super().__init__(layers=layers)

    @classmethod
    def from_tuples(cls, past, num_layers: int):
        """A cache whose layers point at the tensors of `past`, a tuple of (keys, values) per layer: no copy
        (<= 4.41's `DynamicCache.from_legacy_cache`)."""
        cache = cls([CatLayer() for _ in range(num_layers)])
        for layer, (keys, values) in zip(cache.layers, past):
            layer.keys, layer.values, layer.device, layer.is_initialized = keys, values, keys.device, True
        return cache

    def to_tuples(self) -> tuple:
        """The layers' own tensors as a tuple of (keys, values): no copy (<= 4.41's `to_legacy_cache`)."""
        return tuple((layer.keys, layer.values) for layer in self.layers if layer.is_initialized)


class TupleCache(KVCache):
    """`tuple`: the caller's tuple (this object's layers hold its tensors) and the <= 4.41 round trip."""

    def round_trip(self, model, **inputs):
        """One forward as <= 4.41 ran it; returns (outputs, the TupleCache of the new tuple). `self` is not
        changed: a caller who still holds it holds the old tuple."""
        step_cache = KVCache.from_tuples(self.to_tuples(), len(self.layers))  # a fresh cache object, no copy
        # Each layer cats into a new tensor while `self` still holds the old one: at the last layer, two caches.
        outputs = model(**inputs, **{cache_argument(model): step_cache})
        return outputs, TupleCache.from_tuples(step_cache.to_tuples(), len(self.layers))


def forward(model, cache, **inputs):
    """`model(**inputs)` reading and extending `cache`; returns (outputs, the cache to continue from): the same
    object, updated in place by the model's layers, for every design but `tuple`, which makes its round trip."""
    if isinstance(cache, TupleCache):
        return cache.round_trip(model, **inputs)
    return model(**inputs, **{cache_argument(model): cache}), cache


def num_layers(model) -> int:
    return model.config.get_text_config(decoder=True).num_hidden_layers


# The layers kvlab's designs hold: attention that caches keys and values per token (kvlab.counts.ATTENTION). Every
# other layer keeps the cache 5.x's DynamicCache(config=...) gives it (chunked attention counts as sliding, as
# there): conv and recurrent state (linear attention, Mamba, both beside attention in a hybrid layer), nothing
# (MoE/MLP-only and KV-sharing layers), an indexed layer.

# Model types whose forward refuses any cache but a class of their own (MiniMax's linear-attention state).
OWN_CACHE = {"minimax": "MiniMaxCache"}


def check_layers(config, cache: str = "dynamic") -> None:
    """Refuse, before anything is allocated, what kvlab cannot run: a layer type 5.x has no cache for, or `tuple`
    (<= 4.41's keys and values per layer) on a model with other layers."""
    kinds = [kind for kind, _ in layer_kinds(config)]
    if unknown := sorted(set(kinds) - set(DYNAMIC_LAYER_TYPE_MAPPING)):
        raise ValueError(f"{config.model_type}: layer type(s) {', '.join(unknown)} have no cache in this transformers")
    if "indexed_attention" in kinds:  # its layers cache an indexer's keys beside K and V, which kvlab does not count
        raise ValueError(
            f"{config.model_type}: indexed (sparse) attention layers cache indexer keys kvlab does not count; "
            "transformers' own generate() runs it (kind reference, cache dynamic, loop v5)"
        )
    if own := OWN_CACHE.get(config.model_type):
        raise ValueError(
            f"{config.model_type}: its forward takes only its own {own}, not kvlab's caches; transformers' own "
            "generate() runs it (kind reference, cache dynamic, loop v5)"
        )
    if cache == "tuple" and (other := sorted(set(kinds) - set(ATTENTION))):
        counts = ", ".join(f"{kinds.count(kind)} {kind}" for kind in other)
        raise ValueError(
            f"{config.model_type}: the tuple cache is keys and values on every layer, and {counts} of its layers "
            f"hold other state or none; choose one of: {', '.join(c for c in CACHES if c != 'tuple')}"
        )


def make_cache(
    name: str,
    model,
    *,
    max_cache_len: int | None = None,
    chunk_limit: int = DEFAULTS["chunk_limit"],
    block_tokens: int = DEFAULTS["block_tokens"],
    windowed: bool = True,
):
    """An empty cache of design `name` for `model`: the design on the attention layers, 5.x's own cache on the
    others. windowed=False: every attention layer keeps every token, as 4.x's SDPA path grew it."""
    if name not in CACHES:
        raise ValueError(f"unknown cache {name!r}; choose one of: {', '.join(CACHES)}")
    check_layers(model.config, name)
    layers = num_layers(model)
    if name == "tuple":
        return TupleCache.from_tuples((), layers)
    if name == "static":
        if max_cache_len is None:
            raise ValueError("the static cache needs max_cache_len (prompt + new tokens)")
        return StaticCache(config=model.config, max_cache_len=max_cache_len)
    design = {
        "dynamic": lambda window: SlidingCatLayer(window) if window else CatLayer(),
        "list": lambda window: ListLayer(chunk_limit),
        "prealloc": lambda window: WindowLayer(window, block_tokens) if window else PreallocLayer(block_tokens),
    }[name]
    return KVCache(
        [
            design(kw.get("sliding_window") if windowed and kind in WINDOWED else None)
            if kind in ATTENTION
            else DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw)
            for kind, kw in layer_kinds(model.config)
        ]
    )


def cache_tensors(cache) -> list[torch.Tensor]:
    """Every tensor a cache (object, or tuple of pairs) holds, for labelling and sizing."""
    if isinstance(cache, (tuple, list)):
        return [tensor for layer in cache for tensor in layer]
    return [tensor for layer in cache.layers for tensor in layer_tensors(layer)]


def layer_tensors(layer) -> list[torch.Tensor]:
    """The tensors one cache layer holds for its tokens: ours say so; 5.x's hold keys and values (None on a layer
    that caches nothing), conv and recurrent state, or both, and a quantized layer (quanto, HQQ, FP8) its packed
    integers, scales and zero points beside its full-precision residual."""
    if hasattr(layer, "tensors"):
        return layer.tensors()
    held = [layer.keys, layer.values] if getattr(layer, "is_initialized", False) else []
    for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
        held += states.values()
    for name in ("_quantized_keys", "_quantized_values"):
        held += every_tensor(getattr(layer, name, None))
    return [tensor for tensor in held if tensor is not None]


def every_tensor(value, depth: int = 0):
    """The plain tensors in `value`: a tensor, a backend's tensor subclass (quanto's packed tensors: its inner
    tensors), or tuples, lists, dicts and objects of them (HQQ's metadata, FP8's scale, a layer's counters)."""
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
            for name in value.__tensor_flatten__()[0]:
                yield from every_tensor(getattr(value, name), depth + 1)
        else:
            yield value
    elif depth < 4 and isinstance(value, (list, tuple)):
        for item in value:
            yield from every_tensor(item, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for item in value.values():
            yield from every_tensor(item, depth + 1)
    elif depth < 4 and hasattr(value, "__dict__") and not isinstance(value, type):
        for name, item in vars(value).items():
            if name not in ("quantizer", "optimizer"):  # the backends' helpers, not the cache's state
                yield from every_tensor(item, depth + 1)


def cache_length(cache) -> int:
    return int(cache.get_seq_length())


def cache_bytes(cache) -> int:
    """Bytes of every storage the cache holds, each once: its keys and values (static and prealloc count their
    capacity), a 5.x layer's conv and recurrent state, a quantized layer's packed tensors, scales and residual, and
    the layers' own counters (a 5.x sliding layer keeps its window as a 0-d int64 tensor)."""
    held = cache_tensors(cache)
    return storage_bytes(held if isinstance(cache, (tuple, list)) else [*held, *every_tensor(cache.layers)])
