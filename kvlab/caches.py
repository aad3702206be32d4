"""The KV-cache designs, as transformers cache layers that the model's own forward updates.

- legacy:   transformers <= 4.41. The caller keeps a tuple of (key, value) per layer; each step it is
            wrapped in a fresh cache object (no copy), each layer `torch.cat`s into a new tensor, and a
            new tuple is handed back. The caller still holds the old tuple, so both live at once.
- list:     the first design of transformers PR #30536: a list of chunks per layer; attention gets
            their concatenation; every `chunk_limit` chunks the list is consolidated into one.
- inplace:  the PR's final design: ONE cache object for the whole loop; `self.keys = cat(...)` drops
            the only reference to the old tensor, which is freed at once.
- static:   transformers' own `StaticCache`, preallocated to `max_cache_len`.
- prealloc: ours: a buffer per layer that grows in blocks of `block_tokens`; each step writes in
            place and attention gets a view. No full-layer copy per step, no maximum length up front.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticCache

CACHES = ("legacy", "list", "inplace", "static", "prealloc")


class CatLayer(DynamicLayer):
    """Grow by `torch.cat` and replace: a new tensor per step, the old one freed if nobody holds it."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values

    def tensors(self):
        return [self.keys, self.values] if self.is_initialized else []


class ListLayer(DynamicLayer):
    """A list of chunks; attention gets their concatenation (a transient copy of the layer)."""

    def __init__(self, chunk_limit: int = 50):
        super().__init__()
        self.chunk_limit = chunk_limit
        self.key_chunks: list[torch.Tensor] = []
        self.value_chunks: list[torch.Tensor] = []

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.device, self.is_initialized = key_states.device, True
        self.key_chunks.append(key_states)
        self.value_chunks.append(value_states)
        if len(self.key_chunks) >= self.chunk_limit:  # consolidate: the list becomes one chunk
            self.key_chunks = [torch.cat(self.key_chunks, dim=-2)]
            self.value_chunks = [torch.cat(self.value_chunks, dim=-2)]
        if len(self.key_chunks) == 1:
            return self.key_chunks[0], self.value_chunks[0]
        return torch.cat(self.key_chunks, dim=-2), torch.cat(self.value_chunks, dim=-2)

    def get_seq_length(self) -> int:
        return sum(chunk.shape[-2] for chunk in self.key_chunks)

    def reorder_cache(self, beam_idx):
        self.key_chunks = [chunk.index_select(0, beam_idx.to(chunk.device)) for chunk in self.key_chunks]
        self.value_chunks = [chunk.index_select(0, beam_idx.to(chunk.device)) for chunk in self.value_chunks]

    def tensors(self):
        return self.key_chunks + self.value_chunks


class PreallocLayer(DynamicLayer):
    """A buffer that grows in blocks; each step writes the new tokens in place and returns views."""

    def __init__(self, block_tokens: int = 32):
        super().__init__()
        self.block_tokens = block_tokens
        self.key_buffer = self.value_buffer = None
        self.length = 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.device, self.is_initialized = key_states.device, True
        start, end = self.length, self.length + key_states.shape[-2]
        if self.key_buffer is None or end > self.key_buffer.shape[-2]:
            self.keys = self.values = None  # views of the old buffers would keep them alive
            self.key_buffer = self._grown(self.key_buffer, key_states, end)
            self.value_buffer = self._grown(self.value_buffer, value_states, end)
        self.key_buffer[:, :, start:end].copy_(key_states)
        self.value_buffer[:, :, start:end].copy_(value_states)
        self.length = end
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
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

    def crop(self, tokens_to_remove: int) -> None:
        self.length = max(0, self.length - abs(tokens_to_remove))
        if self.key_buffer is not None:
            self.keys, self.values = self.key_buffer[:, :, : self.length], self.value_buffer[:, :, : self.length]

    def reorder_cache(self, beam_idx):
        # One buffer at a time: the transient is one layer's keys (or values), as for `inplace`.
        self.keys = self.values = None
        self.key_buffer = self.key_buffer.index_select(0, beam_idx.to(self.device))
        self.value_buffer = self.value_buffer.index_select(0, beam_idx.to(self.device))
        self.keys, self.values = self.key_buffer[:, :, : self.length], self.value_buffer[:, :, : self.length]

    def tensors(self):
        return [t for t in (self.key_buffer, self.value_buffer) if t is not None]


class KVCache(DynamicCache):
    """A transformers cache made of our layers (a DynamicCache, so `generate()` accepts it too)."""

    def __init__(self, layers):
        Cache.__init__(self, layers=layers)


class LegacyTupleCache(KVCache):
    """The <= 4.41 round trip: tuple in, fresh cache object around it, new tuple out."""

    @classmethod
    def from_legacy_cache(cls, past, num_layers: int):
        cache = cls([CatLayer() for _ in range(num_layers)])
        for layer, (keys, values) in zip(cache.layers, past or ()):
            # Wrapping copies nothing: the layer points at the caller's tensors.
            layer.keys, layer.values, layer.device, layer.is_initialized = keys, values, keys.device, True
        return cache

    def to_legacy_cache(self):
        return tuple((layer.keys, layer.values) for layer in self.layers)


def num_layers(model) -> int:
    return model.config.get_text_config(decoder=True).num_hidden_layers


def make_cache(name: str, model, *, max_cache_len: int | None = None, chunk_limit: int = 50, block_tokens: int = 32):
    """An empty cache of design `name` for `model` (for `legacy`: None, i.e. no tuple yet)."""
    if name not in CACHES:
        raise ValueError(f"unknown cache {name!r}; choose one of: {', '.join(CACHES)}")
    layers = num_layers(model)
    if name == "legacy":
        return None
    if name == "inplace":
        return KVCache([CatLayer() for _ in range(layers)])
    if name == "list":
        return KVCache([ListLayer(chunk_limit) for _ in range(layers)])
    if name == "prealloc":
        return KVCache([PreallocLayer(block_tokens) for _ in range(layers)])
    if max_cache_len is None:
        raise ValueError("the static cache needs max_cache_len (prompt + new tokens)")
    return StaticCache(config=model.config, max_cache_len=max_cache_len)


def cache_tensors(cache) -> list[torch.Tensor]:
    """Every tensor a cache (object or legacy tuple) holds, for labelling and sizing."""
    if cache is None:
        return []
    if isinstance(cache, tuple):
        return [tensor for layer in cache for tensor in layer]
    tensors = []
    for layer in cache.layers:
        if hasattr(layer, "tensors"):
            tensors += layer.tensors()
        elif getattr(layer, "is_initialized", False):
            tensors += [layer.keys, layer.values]
    return tensors


def cache_length(cache) -> int:
    if cache is None:
        return 0
    if isinstance(cache, tuple):
        return cache[0][0].shape[-2] if cache else 0
    return int(cache.get_seq_length())


def cache_bytes(cache) -> int:
    """Bytes the cache holds (its storages, each once: static and prealloc count their capacity)."""
    seen, total = set(), 0
    for tensor in cache_tensors(cache):
        storage = tensor.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            total += storage.nbytes()
    return total
