"""The KV-cache designs of transformers' releases, as transformers cache layers that the model's own forward updates.

- tuple:    transformers <= 4.41: the caller holds a tuple of (keys, values) per layer; each forward wraps it in a
            fresh cache object, each layer `torch.cat`s into a new tensor, and a new tuple is handed back while
            the caller still holds the old one: both live at once.
- dynamic:  PR #30536 and transformers' `DynamicLayer`: ONE cache object for the loop; `self.keys = cat(...)`
            drops the only reference to the old tensor, freed at once (still a full copy per step, not kept).
- static:   transformers' own `StaticCache`, preallocated to `max_cache_len`.

kvlab's own designs, `list` and `prealloc`, live a layer up (kvlab.designs) and join `make_cache` through
`register` when that module is imported, as transformers' `AttentionInterface.register` adds an attention function.

On a model with sliding-window layers `dynamic` gives those layers their sliding form, as `generate()`'s default
cache does; a layer that is not attention (linear attention, Mamba, MoE-only, KV-sharing) keeps 5.x's own cache in
every design but `tuple`, which refuses such a model.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
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


# The layer each design puts on an attention layer: design -> layer(window, options), `window` the layer's sliding
# window (None: a full layer), `options` make_cache's (chunk_limit, block_tokens). `tuple` and `static` are whole
# caches, which make_cache builds itself; kvlab.designs adds kvlab's own designs (`register`).
LAYERS = {"dynamic": lambda window, options: SlidingCatLayer(window) if window else CatLayer()}


def register(name: str, layer) -> None:
    """Add design `name` (one of kvlab.schema.CACHES) to `make_cache`: `layer(window, options)` makes its layer for
    an attention layer (`LAYERS`)."""
    if name not in CACHES or name in ("tuple", "static"):
        raise ValueError(f"register takes a layer design of kvlab.schema.CACHES but tuple and static, got {name!r}")
    LAYERS[name] = layer


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
    others. windowed=False: every attention layer keeps every token, as 4.x's SDPA path grew it. `chunk_limit` and
    `block_tokens` are the options of kvlab's own designs (kvlab.designs), which the others ignore."""
    if name not in CACHES:
        raise ValueError(f"unknown cache {name!r}; choose one of: {', '.join(CACHES)}")
    if name not in (*LAYERS, "tuple", "static"):
        raise ValueError(f"the cache {name!r} is one of kvlab's own designs: import kvlab.designs to register it")
    check_layers(model.config, name)
    layers = num_layers(model)
    if name == "tuple":
        return TupleCache.from_tuples((), layers)
    if name == "static":
        if max_cache_len is None:
            raise ValueError("the static cache needs max_cache_len (prompt + new tokens)")
        return StaticCache(config=model.config, max_cache_len=max_cache_len)
    design, options = LAYERS[name], dict(chunk_limit=chunk_limit, block_tokens=block_tokens)
    return KVCache(
        [
            design(kw.get("sliding_window") if windowed and kind in WINDOWED else None, options)
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
    """The tensors one cache layer holds for its tokens: kvlab.designs' layers say so; 5.x's hold keys and values
    (None on a layer that caches nothing), conv and recurrent state, or both, and a quantized layer (quanto, HQQ,
    FP8) its packed integers, scales and zero points beside its full-precision residual."""
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
