"""What converting a KV cache between tuples and transformers' cache object costs, in memory and time.

In 5.x the way in, `DynamicCache(ddp_cache_data=tuples)`, copies every tensor (its first `DynamicLayer.update`
concatenates onto an empty one) while the caller still holds the tuples; the way out, `(layer.keys,
layer.values)`, returns the stored tensors: views, no copy. (<= 4.41 wrapped tuples without copying.)
"""

from __future__ import annotations

import statistics
import timeit

import torch
from transformers.cache_utils import DynamicCache

from ..compat import cache_argument, cache_from_outputs
from ..meter import MemoryMeter, storage_bytes


def random_tuples(layers: int, batch: int, kv_heads: int, length: int, head_dim: int):
    """A tuple cache of random float32 keys and values: ((k0, v0), (k1, v1), ...)."""
    shape = (batch, kv_heads, length, head_dim)
    return tuple((torch.randn(shape), torch.randn(shape)) for _ in range(layers))


def to_cache(tuples) -> DynamicCache:
    """Tuples in: transformers 5.x's only way (a copy of every tensor)."""
    return DynamicCache(ddp_cache_data=tuples)


def to_tuples(cache) -> tuple:
    """Tuples out: the stored tensors themselves."""
    return tuple((layer.keys, layer.values) for layer in cache.layers)


def conversion_cost(tuples, repeats: int = 5) -> dict:
    """Bytes allocated (peak, counted by the live-storage meter) and median seconds of each direction."""
    cache_bytes = storage_bytes(t for pair in tuples for t in pair)
    with MemoryMeter("cpu") as into:
        cache = to_cache(tuples)
    with MemoryMeter("cpu") as out:
        back = to_tuples(cache)
    stored = [(layer.keys, layer.values) for layer in cache.layers]
    copies = all(a.data_ptr() != b.data_ptr() for pair, kept in zip(tuples, stored) for a, b in zip(pair, kept))
    views = all(a.data_ptr() == b.data_ptr() for pair, kept in zip(back, stored) for a, b in zip(pair, kept))
    seconds = {
        name: statistics.median(timeit.repeat(convert, number=1, repeat=repeats))
        for name, convert in (("to_cache", lambda: to_cache(tuples)), ("to_tuples", lambda: to_tuples(cache)))
    }
    gib = cache_bytes / 2**30
    return dict(
        cache_bytes=cache_bytes,
        to_cache_peak_bytes=into.report().peak_bytes,
        to_cache_copies=copies,
        to_cache_seconds=seconds["to_cache"],
        to_cache_seconds_per_gib=seconds["to_cache"] / gib,
        to_tuples_peak_bytes=out.report().peak_bytes,
        to_tuples_views=views,
        to_tuples_seconds=seconds["to_tuples"],
        to_tuples_seconds_per_gib=seconds["to_tuples"] / gib,
    )


def conversion_table(
    sizes_mib=(16, 64, 256), layers: int = 32, batch: int = 8, kv_heads: int = 32, head_dim: int = 4, repeats: int = 5
):
    """`conversion_cost` for float32 caches of about `sizes_mib` MiB (the sequence length sets the size), as rows."""
    lengths = [max(1, round(size * 2**20 / (2 * layers * batch * kv_heads * head_dim * 4))) for size in sizes_mib]
    return [
        dict(tokens=length, **conversion_cost(random_tuples(layers, batch, kv_heads, length, head_dim), repeats))
        for length in lengths
    ]


def tuple_support(model) -> dict:
    """What the installed transformers still offers a tuple cache: the two conversion methods of <= 4.x's
    `DynamicCache`, and whether the model's forward accepts a tuple (after a prompt of 4 tokens)."""
    ids = torch.zeros(1, 4, dtype=torch.long, device=model.device)
    with torch.inference_mode():
        tuples = to_tuples(cache_from_outputs(model(ids, use_cache=True)))
        try:
            model(ids[:, :1], use_cache=True, **{cache_argument(model): tuples})
            forward = "accepted"
        except Exception as error:  # whatever the release raises is the finding
            forward = f"fails: {type(error).__name__}: {error}"
    found = {
        f"DynamicCache.{name}": "exists" if hasattr(DynamicCache, name) else "absent"
        for name in ("from_legacy_cache", "to_legacy_cache")
    }
    return found | {"a tuple passed to the forward": forward}
