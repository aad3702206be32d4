"""Requests served one after the other with one cache design, each under kvlab's meter (appendix A10, section 4).

Modes: `hf-static` (transformers' `generate(cache_implementation="static")`: a new cache per call), `reused` and
`reused-max` (one `ReusableStaticCache`, shapes "exact" and "max"), `dynamic` (`kvlab.encdec.generate` on
transformers' default `DynamicCache` pair). Fields: docs/encoder-decoder.md.
"""

from __future__ import annotations

import gc
import types
import weakref

import torch

from ..compat import cache_from_outputs
from ..meter import MemoryMeter
from ..models import kv_bytes_per_token
from ..schema import check_choice
from . import decoder_shape, decoder_step, generate, generate_reference
from .reusable_cache import ReusableStaticCache

MODES = ("hf-static", "reused", "reused-max", "dynamic")


def decoder_kv_bytes(config, batch: int, positions: int, dtype) -> int:
    """Keys and values of `positions` positions of `batch` rows, every decoder layer: the decoder's shape
    handed to kvlab.models.kv_bytes_per_token (encoder-decoder configs name their layers and heads otherwise)."""
    layers, heads, head_dim = decoder_shape(config)
    decoder = types.SimpleNamespace(num_hidden_layers=layers, num_key_value_heads=heads, head_dim=head_dim)
    return kv_bytes_per_token(decoder, batch, str(dtype).removeprefix("torch.")) * positions


def predicted_cache_bytes(
    config, dtype, mode: str, batch: int, encoder_length: int, new_tokens: int, max_batch: int, max_encoder_length: int
) -> int:
    """The cache a request holds at its end: reused, the buffers at the maxima; per call (hf-static, dynamic),
    self-attention over the `new_tokens` positions fed (the start token and every new token but the last) plus
    cross-attention over the encoder output."""
    if mode.startswith("reused"):
        batch, encoder_length = max_batch, max_encoder_length
    return decoder_kv_bytes(config, batch, new_tokens + encoder_length, dtype)


def _serve_one(model, request, mode: str, new_tokens: int, reused: ReusableStaticCache | None):
    """(new tokens, the cache they were decoded through) of one request."""
    if mode == "hf-static":
        out = generate_reference(model, request, new_tokens, whole_output=True, cache_implementation="static")
        return out.sequences[:, 1:], cache_from_outputs(out)
    out = generate(model, request, new_tokens, reused)
    return out.new_tokens, out.cache


def serve(model, requests, mode: str, new_tokens: int) -> list[dict]:
    """Serve `requests` (kvlab.encdec.Request) in order in one mode, the reused cache sized at their largest batch
    and encoder length. One row per request: `held_bytes` (kept from earlier requests: the reused buffers),
    `peak_bytes` (the request's own allocations at their highest, under kvlab.meter.MemoryMeter), `footprint_bytes`
    = held + peak, `new_cache_bytes` (cache storage the request made), `cache_bytes` (all the storage its cache
    used), `predicted_cache_bytes`, `tokens` (the new tokens) and `tokens_match` (against `generate()`'s)."""
    check_choice("mode", mode, MODES)
    max_batch = max(request.batch for request in requests)
    max_encoder = max(request.encoder_length for request in requests)
    reused = None  # a server keeps it between requests; the first request builds it and pays for it
    seen = weakref.WeakValueDictionary()  # storage key -> base tensor of a cache storage an earlier request made
    rows = []
    for index, request in enumerate(requests):
        held = sum(t.nbytes for t in reused.buffers()) if reused else 0
        gc.collect()  # earlier requests' garbage freed inside the meter would lower the CUDA allocator's count
        with torch.no_grad(), MemoryMeter(model.device) as meter:
            if mode.startswith("reused") and reused is None:
                reused = ReusableStaticCache(
                    model.config,
                    max_batch,
                    new_tokens,
                    max_encoder,
                    device=model.device,
                    dtype=model.dtype,
                    shapes="max" if mode == "reused-max" else "exact",
                )
            tokens, cache = _serve_one(model, request, mode, new_tokens, reused)
        peak = meter.report().overhead_bytes
        tensors = [
            t
            for part in (cache.self_attention_cache, cache.cross_attention_cache)
            for layer in part.layers
            for t in (layer.keys, layer.values)
            if t is not None
        ]
        bases = {t.untyped_storage()._cdata: t if t._base is None else t._base for t in tensors}  # views' owners
        rows.append(
            dict(
                mode=mode,
                request=index,
                batch=request.batch,
                encoder_length=request.encoder_length,
                new_tokens=new_tokens,
                max_batch=max_batch,
                max_encoder_length=max_encoder,
                dtype=str(model.dtype).removeprefix("torch."),
                device=str(model.device),
                meter=meter.report().method,
                held_bytes=held,
                peak_bytes=peak,
                footprint_bytes=held + peak,
                new_cache_bytes=sum(b.untyped_storage().nbytes() for key, b in bases.items() if seen.get(key) is not b),
                cache_bytes=sum(b.untyped_storage().nbytes() for b in bases.values()),
                predicted_cache_bytes=predicted_cache_bytes(
                    model.config,
                    model.dtype,
                    mode,
                    request.batch,
                    request.encoder_length,
                    new_tokens,
                    max_batch,
                    max_encoder,
                ),
                tokens=tokens.tolist(),
                tokens_match=torch.equal(tokens, generate_reference(model, request, new_tokens)),
            )
        )
        seen.update(bases)
        del cache, tensors, bases
    return rows


def count_graphs(model, requests, mode: str, new_tokens: int, backend: str = "eager") -> list[int]:
    """The graphs dynamo compiles in each request, serving `requests` in order from a fresh dynamo: the decoder
    step compiled (reused, reused-max), or `generate()`'s forward (hf-static). The eager backend by default:
    dynamo's guards, hence its compiles and recompiles, do not depend on the backend, and inductor on a CPU
    costs a minute of C++ compilation per graph. Not `dynamic`: its cache changes shape every step."""
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    check_choice("mode", mode, MODES[:3])
    torch._dynamo.reset()
    step = torch.compile(decoder_step, backend=backend)
    config = CompileConfig(backend=backend, mode="default")
    config._compile_all_devices = True  # generate() compiles only on accelerators unless told
    reused = (
        None
        if mode == "hf-static"
        else ReusableStaticCache(
            model.config,
            max(r.batch for r in requests),
            new_tokens,
            max(r.encoder_length for r in requests),
            device=model.device,
            dtype=model.dtype,
            shapes="max" if mode == "reused-max" else "exact",
        )
    )
    graphs = []
    for request in requests:
        before = counters["stats"]["unique_graphs"]
        if reused is None:
            with torch.no_grad():
                generate_reference(model, request, new_tokens, cache_implementation="static", compile_config=config)
        else:
            generate(model, request, new_tokens, reused, step=step)
        graphs.append(counters["stats"]["unique_graphs"] - before)
    return graphs
