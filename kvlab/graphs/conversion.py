"""What converting a KV cache between tuples and transformers' cache object costs, in memory and time.

transformers <= 4.41 wrapped a tuple in a cache object without copying (`from_legacy_cache`). 5.x has
no such method; the way in is `DynamicCache(ddp_cache_data=tuples)`, whose first `DynamicLayer.update`
concatenates each tensor onto an empty one: a full copy of the cache, made while the caller still holds
the tuples. The way out, `(layer.keys, layer.values)`, returns the stored tensors: views, no copy.
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers.cache_utils import DynamicCache

from ..meter import MemoryMeter

MIB = 2**20


def random_tuples(layers: int, batch: int, kv_heads: int, length: int, head_dim: int, dtype=torch.float32):
    """A tuple cache of random keys and values: ((k0, v0), (k1, v1), ...)."""
    shape = (batch, kv_heads, length, head_dim)
    return tuple((torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(layers))


def to_cache(tuples) -> DynamicCache:
    """Tuples in: transformers 5.x's only way (a copy of every tensor)."""
    return DynamicCache(ddp_cache_data=tuples)


def to_tuples(cache) -> tuple:
    """Tuples out: the stored tensors themselves."""
    return tuple((layer.keys, layer.values) for layer in cache.layers)


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
        del result
    return statistics.median(times)


def conversion_cost(tuples, repeats: int = 5) -> dict:
    """Bytes allocated (peak, counted by the live-storage meter) and median seconds of each direction."""
    cache_bytes = sum(t.untyped_storage().nbytes() for pair in tuples for t in pair)
    with MemoryMeter("cpu") as meter:
        cache = to_cache(tuples)
    into_peak = meter.report().peak_bytes
    copies = all(a.data_ptr() != b.data_ptr() for pair, layer in zip(tuples, cache.layers)
                 for a, b in zip(pair, (layer.keys, layer.values)))
    with MemoryMeter("cpu") as meter:
        back = to_tuples(cache)
    out_peak = meter.report().peak_bytes
    views = all(a.data_ptr() == b.data_ptr() for pair, layer in zip(back, cache.layers)
                for a, b in zip(pair, (layer.keys, layer.values)))
    del cache, back
    into = _timed(lambda: to_cache(tuples), repeats)
    cache = to_cache(tuples)
    out = _timed(lambda: to_tuples(cache), repeats)
    gib = cache_bytes / 2**30
    return dict(cache_bytes=cache_bytes, to_cache_peak_bytes=into_peak, to_cache_copies=copies,
                to_cache_seconds=into, to_cache_seconds_per_gib=into / gib,
                to_tuples_peak_bytes=out_peak, to_tuples_views=views,
                to_tuples_seconds=out, to_tuples_seconds_per_gib=out / gib)


def conversion_table(sizes_mib=(16, 64, 256), layers: int = 32, batch: int = 8, kv_heads: int = 32,
                     head_dim: int = 4, dtype=torch.float32, repeats: int = 5):
    """`conversion_cost` for caches of about `sizes_mib` MiB (the sequence length sets the size), as rows."""
    rows = []
    element = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * layers * batch * kv_heads * head_dim * element
    for size in sizes_mib:
        length = max(1, round(size * MIB / per_token))
        tuples = random_tuples(layers, batch, kv_heads, length, head_dim, dtype)
        rows.append(dict(tokens=length, **conversion_cost(tuples, repeats)))
        del tuples
    return rows
