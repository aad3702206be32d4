"""The KV-cache designs, as transformers cache layers that the model's own forward updates.

- tuple:    transformers <= 4.41. The caller keeps a tuple of (key, value) per layer; each step it is
            wrapped in a fresh cache object (no copy), each layer `torch.cat`s into a new tensor, and a
            new tuple is handed back. The caller still holds the old tuple, so both live at once.
- dynamic:  PR #30536's final design and transformers' `DynamicLayer` today: ONE cache object for the
            whole loop; `self.keys = cat(...)` drops the only reference to the old tensor, which is
            freed at once. Still a full copy of the layer per step (the new tensor), just not kept.
- list:     the first design of PR #30536: a list of chunks per layer; attention gets their
            concatenation; every `chunk_limit` chunks the list is consolidated into one.
- static:   transformers' own `StaticCache`, preallocated to `max_cache_len`.
- prealloc: ours: a buffer per layer that grows in blocks of `block_tokens`; each step writes in
            place and attention gets a view. No full-layer copy per step, no maximum length up front.

Layers subclass transformers' `CacheLayerMixin` (as `StaticLayer` does) and implement every method of
its contract; a method a design cannot honour raises instead of silently acting on a view.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, StaticCache

CACHES = ("tuple", "dynamic", "list", "static", "prealloc")
RENAMED = {"legacy": "tuple", "inplace": "dynamic"}  # names before the fidelity issue


def check_cache_name(name: str) -> None:
    if name in RENAMED:
        raise ValueError(f"cache {name!r} is now called {RENAMED[name]!r}; choose one of: {', '.join(CACHES)}")
    if name not in CACHES:
        raise ValueError(f"unknown cache {name!r}; choose one of: {', '.join(CACHES)}")


class CatLayer(DynamicLayer):
    """`dynamic`: transformers' own `DynamicLayer.update` (cat and replace), kept as a named class so the
    meter and the notebooks can point at it; everything else is DynamicLayer's."""

    def tensors(self):
        return [self.keys, self.values] if self.is_initialized else []


class _OwnLayer(CacheLayerMixin):
    """The contract methods our own layers share; what a design cannot do raises with its name."""

    is_croppable = True

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device, self.dtype, self.is_initialized = key_states.device, key_states.dtype, True

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1  # grows without a maximum

    def _unsupported(self, what: str):
        raise NotImplementedError(f"{type(self).__name__} (kvlab) does not support {what}")

    def offload(self):
        self._unsupported("offloading (its keys/values are views or chunks, not the stored tensors)")

    def prefetch(self):
        self._unsupported("prefetching")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("batch_repeat_interleave (contrastive search / assisted decoding)")

    def batch_select_indices(self, indices) -> None:
        self._unsupported("batch_select_indices")


class ListLayer(_OwnLayer):
    """`list`: chunks; attention gets their concatenation (a transient copy of the layer)."""

    def __init__(self, chunk_limit: int = 50):
        super().__init__()
        self.chunk_limit = chunk_limit
        self.key_chunks: list[torch.Tensor] = []
        self.value_chunks: list[torch.Tensor] = []

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
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

    def reset(self) -> None:
        self.key_chunks, self.value_chunks = [], []

    def crop(self, tokens_to_remove: int) -> None:
        keep = max(0, self.get_seq_length() - abs(tokens_to_remove))
        if self.key_chunks:
            self.key_chunks = [torch.cat(self.key_chunks, dim=-2)[..., :keep, :]]
            self.value_chunks = [torch.cat(self.value_chunks, dim=-2)[..., :keep, :]]

    def reorder_cache(self, beam_idx):
        # Chunk by chunk: the transient is one chunk, never the whole layer.
        for chunks in (self.key_chunks, self.value_chunks):
            for i, chunk in enumerate(chunks):
                chunks[i] = chunk.index_select(0, beam_idx.to(chunk.device))

    def tensors(self):
        return self.key_chunks + self.value_chunks


class PreallocLayer(_OwnLayer):
    """`prealloc`: a buffer that grows in blocks; each step writes the new tokens in place and returns views."""

    def __init__(self, block_tokens: int = 32):
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
        self.length = end
        self._expose()
        return self.keys, self.values

    def _expose(self):
        self.keys, self.values = self.key_buffer[:, :, : self.length], self.value_buffer[:, :, : self.length]

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
        self.length = 0
        if self.key_buffer is not None:
            self._expose()

    def crop(self, tokens_to_remove: int) -> None:
        self.length = max(0, self.length - abs(tokens_to_remove))
        if self.key_buffer is not None:
            self._expose()

    def reorder_cache(self, beam_idx):
        # One buffer at a time: the transient is one layer's keys (or values), as for `dynamic`.
        if self.key_buffer is None:
            return
        self.keys = self.values = None
        self.key_buffer = self.key_buffer.index_select(0, beam_idx.to(self.device))
        self.value_buffer = self.value_buffer.index_select(0, beam_idx.to(self.device))
        self._expose()

    def tensors(self):
        return [t for t in (self.key_buffer, self.value_buffer) if t is not None]


class KVCache(Cache):
    """A transformers `Cache` made of our layers, so the model's forward (and `generate()`) accept it."""

    def __init__(self, layers):
        super().__init__(layers=layers)


class TupleRoundTripCache(KVCache):
    """The <= 4.41 round trip: tuple in, fresh cache object around it, new tuple out."""

    @classmethod
    def from_tuples(cls, past, num_layers: int):
        cache = cls([CatLayer() for _ in range(num_layers)])
        for layer, (keys, values) in zip(cache.layers, past or ()):
            # Wrapping copies nothing: the layer points at the caller's tensors.
            layer.keys, layer.values, layer.device, layer.is_initialized = keys, values, keys.device, True
        return cache

    def to_tuples(self):
        return tuple((layer.keys, layer.values) for layer in self.layers)


def num_layers(model) -> int:
    return model.config.get_text_config(decoder=True).num_hidden_layers


def make_cache(name: str, model, *, max_cache_len: int | None = None, chunk_limit: int = 50, block_tokens: int = 32):
    """An empty cache of design `name` for `model` (for `tuple`: None, i.e. no tuple yet)."""
    check_cache_name(name)
    layers = num_layers(model)
    if name == "tuple":
        return None
    if name == "dynamic":
        return KVCache([CatLayer() for _ in range(layers)])
    if name == "list":
        return KVCache([ListLayer(chunk_limit) for _ in range(layers)])
    if name == "prealloc":
        return KVCache([PreallocLayer(block_tokens) for _ in range(layers)])
    if max_cache_len is None:
        raise ValueError("the static cache needs max_cache_len (prompt + new tokens)")
    return StaticCache(config=model.config, max_cache_len=max_cache_len)


def cache_tensors(cache) -> list[torch.Tensor]:
    """Every tensor a cache (object or tuple) holds, for labelling and sizing."""
    if cache is None:
        return []
    if isinstance(cache, (tuple, list)):
        return [tensor for layer in cache if layer is not None for tensor in layer]
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
    if isinstance(cache, (tuple, list)):
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
