"""Decoding through a graph: how the KV cache crosses the boundary of a traced or exported decoder
(transformers issue #31962; docs/graphs.md). Runtimes: `jit-trace` (`torch.jit.trace` of `TupleStep`, the
cache as flat tuples: the caller holds the old tuple while the graph builds the new one), `convert` (tuples to a
`DynamicCache` and back around every eager forward, a copy each time in 5.x), `export` (`torch.export` of
transformers' `TorchExportableModuleWithStaticCache`, buffers updated in place), `eager` (kvlab.loops). Each
decodes greedily as 5.x's `generate()` does and gives its exact tokens.
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache
from transformers.utils import logging as hf_logging

from .. import designs  # noqa: F401 (registers kvlab's own designs, list and prealloc, with make_cache)
from ..caches import TupleCache, num_layers
from ..compat import cache_argument
from ..loops import Generation, generate
from ..schema import check_choice
from ..timing import interleaved
from .conversion import to_cache, to_tuples

# runtime -> the cache designs it can carry (the first is its default).
RUNTIMES = {
    "eager": ("dynamic", "tuple", "list", "static", "prealloc"),
    "jit-trace": ("tuple",),
    "convert": ("dynamic",),
    "export": ("static",),
}
# Metered by the profiler: the counter cannot see inside TorchScript (C++ ops); export shares the graphs' meter.
GRAPH_RUNTIMES = ("jit-trace", "export")


def check_runtime(runtime: str, cache: str | None = None, loop: str = "v5", strategy: str = "greedy") -> None:
    """Refuse a runtime that does not exist or cannot carry this cache, loop or strategy; one line each."""
    check_choice("runtime", runtime, RUNTIMES)
    if runtime == "eager":
        return
    carried = RUNTIMES[runtime]
    if cache is not None and cache not in carried:
        why = {
            "jit-trace": "torch.jit.trace passes only tensors and tuples across the graph boundary",
            "convert": "it converts tuples to transformers' DynamicCache and back",
            "export": "torch.export needs a cache whose buffers exist before the graph runs",
        }[runtime]
        raise ValueError(
            f"runtime {runtime!r} cannot carry the {cache!r} cache ({why}); use cache={carried[0]!r}, "
            f"or runtime 'eager' for {cache!r}"
        )
    if loop != "v5":
        raise ValueError(f"runtime {runtime!r} runs transformers 5.x's loop only; use loop='v5'")
    if strategy != "greedy":
        raise ValueError(f"runtime {runtime!r} decodes greedily only; use strategy='greedy'")


class TupleStep(torch.nn.Module):
    """One forward, the cache as flat tensors (what `torch.jit.trace` accepts): (input_ids, position_ids, k0, v0,
    ...) -> (next-token logits, new k0, v0, ...); inside, `kvlab.caches.TupleCache` wraps them without copying."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.layers = num_layers(model)

    def forward(self, input_ids, position_ids, *flat_cache):
        pairs = [(flat_cache[i], flat_cache[i + 1]) for i in range(0, len(flat_cache), 2)]
        outputs, new = TupleCache.from_tuples(pairs, self.layers).round_trip(
            self.model, input_ids=input_ids, position_ids=position_ids, use_cache=True, logits_to_keep=1
        )
        return (outputs.logits[:, -1, :],) + tuple(t for pair in new.to_tuples() for t in pair)


@dataclass
class Graphs:
    """What a runtime built before decoding, and how long building it took (not part of any decode)."""

    runtime: str
    prefill: object = None  # jit-trace: the prompt's graph (no cache in); export: the one program
    decode: object = None  # jit-trace: a step's graph (cache in, cache out)
    build_seconds: float | None = None  # None: nothing to build (eager, convert)
    max_cache_len: int = 0  # prompt + new tokens - 1 it was built for: an exported static cache holds no more
    batch: int = 0


def _positions(rows: int, start: int, stop: int, device) -> torch.Tensor:
    return torch.arange(start, stop, device=device).expand(rows, -1)


def build_graphs(model, input_ids: torch.Tensor, new_tokens: int, runtime: str, trace: bool = True) -> Graphs:
    """Trace or export `model` for decoding `new_tokens` after `input_ids` (their shapes, not values).
    `trace=False` (jit-trace): the untraced `TupleStep`, the same ops run eagerly, seen by the live-storage counter."""
    check_runtime(runtime)
    if runtime in ("eager", "convert"):
        return Graphs(runtime)
    start = time.perf_counter()
    graphs = Graphs(runtime, max_cache_len=input_ids.shape[1] + new_tokens - 1, batch=input_ids.shape[0])
    verbosity = hf_logging.get_verbosity()
    # Tracing warns at every Python branch it freezes (the mask shortcuts; the token tests at other lengths pin
    # them) and reads every attribute of the model (transformers logs a line when `loss_function` is read).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_logging.set_verbosity_error()
        try:
            if runtime == "export":
                graphs.prefill = _export(model, input_ids, graphs.max_cache_len)
            elif not trace:
                graphs.prefill = graphs.decode = TupleStep(model).eval()
            else:
                graphs.prefill, graphs.decode = _trace(TupleStep(model).eval(), input_ids)
        finally:
            hf_logging.set_verbosity(verbosity)
    graphs.build_seconds = time.perf_counter() - start
    return graphs


def _trace(step: TupleStep, input_ids):
    """Two traced graphs: the prompt's (no cache in) and a step's (the cache after the prompt in and out)."""
    rows, prompt = input_ids.shape
    device = input_ids.device
    with torch.no_grad():
        prefill = torch.jit.trace(step, (input_ids, _positions(rows, 0, prompt, device)), check_trace=False)
        out = prefill(input_ids, _positions(rows, 0, prompt, device))
        next_ids = out[0].argmax(-1, keepdim=True)
        decode = torch.jit.trace(
            step, (next_ids, _positions(rows, prompt, prompt + 1, device), *out[1:]), check_trace=False
        )
    return prefill, decode


def _export(model, input_ids, max_cache_len):
    """transformers' exportable static-cache module, exported with a dynamic length: one program, every step."""
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    config = model.generation_config
    before = config.cache_implementation
    config.cache_implementation = "static"  # the wrapper refuses any other
    try:
        wrapper = TorchExportableModuleWithStaticCache(
            model, batch_size=input_ids.shape[0], max_cache_len=max_cache_len, device=input_ids.device
        )
    finally:
        config.cache_implementation = before
    length = torch.export.Dim("tokens", min=1, max=max_cache_len)
    with torch.no_grad():
        program = torch.export.export(
            wrapper,
            args=(),
            kwargs=dict(input_ids=input_ids, cache_position=torch.arange(input_ids.shape[1], device=input_ids.device)),
            dynamic_shapes=dict(input_ids={1: length}, cache_position={0: length}),
            strict=False,
        )
    return program.module()


def _fresh_cache_buffers(module) -> list[torch.Tensor]:
    """Allocate the program's cache state (keys, values, each layer's length counter) anew, zeroed, as a
    runtime does when it loads the program: inside the caller's meter, so the overhead includes it."""
    fresh = []
    for name, buffer in list(module.named_buffers()):
        if not name.split(".")[-1].startswith(("key_cache_", "value_cache_", "cumulative_length_")):
            continue
        owner, _, attribute = name.rpartition(".")
        tensor = torch.zeros_like(buffer)
        (module.get_submodule(owner) if owner else module).register_buffer(attribute, tensor, persistent=False)
        fresh.append(tensor)
    return fresh


def generate_graph(
    model, input_ids: torch.Tensor, new_tokens: int, runtime: str, graphs: Graphs | None = None, meter=None
) -> Generation:
    """Greedy decoding of `new_tokens` tokens through `runtime` (not `eager`: kvlab.loops), as 5.x's loop: the next
    token's logits an fp32 copy held until the next forward returns. `graphs`: built here, unmetered, if not given."""
    check_runtime(runtime)
    if runtime == "eager":
        raise ValueError("runtime 'eager' decodes with kvlab.loops.generate")
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be positive, got {new_tokens}")
    if graphs is None:
        graphs = build_graphs(model, input_ids, new_tokens, runtime)
    rows, prompt = input_ids.shape
    if graphs.build_seconds is not None and (
        graphs.runtime != runtime or graphs.batch != rows or prompt + new_tokens - 1 > graphs.max_cache_len
    ):
        # Past the end of an exported static cache the write would go out of bounds: refuse instead.
        raise ValueError(
            f"graphs built for runtime {graphs.runtime}, batch {graphs.batch}, {graphs.max_cache_len} "
            f"cached tokens cannot decode {runtime}, batch {rows}, prompt {prompt} + {new_tokens} new"
        )
    device, tokens = input_ids.device, input_ids
    kv = _fresh_cache_buffers(graphs.prefill) if runtime == "export" else ()  # jit-trace, convert: tuples
    if meter is not None:
        meter.label(kv, "kv")
    start = time.perf_counter()
    with torch.no_grad():
        for step in range(new_tokens):
            fed = tokens[:, -1:] if step else tokens
            cached = tokens.shape[1] - fed.shape[1]
            positions = _positions(rows, cached, tokens.shape[1], device)
            if runtime == "jit-trace":
                out = (graphs.decode if step else graphs.prefill)(fed, positions, *kv)  # old tuple alive till here
                next_logits = out[0].to(copy=True, dtype=torch.float32)
                kv = out[1:]  # the old tuple dies here
                del out
            elif runtime == "convert":
                # The maintainers' suggestion: tuples -> cache object -> forward -> tuples. 5.x's
                # DynamicCache copies the tuples it is given, while the caller still holds them.
                cache = to_cache(kv) if kv else DynamicCache()
                outputs = model(
                    input_ids=fed,
                    position_ids=positions,
                    use_cache=True,
                    logits_to_keep=1,
                    **{cache_argument(model): cache},
                )
                next_logits = outputs.logits[:, -1, :].to(copy=True, dtype=torch.float32)
                kv = to_tuples(cache)  # views: no copy
                del cache, outputs
            else:
                logits = graphs.prefill(
                    input_ids=fed, cache_position=torch.arange(cached, tokens.shape[1], device=device)
                )
                next_logits = logits[:, -1, :].to(copy=True, dtype=torch.float32)
                del logits
            del positions
            tokens = torch.cat([tokens, next_logits.argmax(dim=-1, keepdim=True)], dim=-1)
            if meter is not None:
                meter.label(kv, "kv")
                meter.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return Generation(tokens, kv, time.perf_counter() - start)


# The comparison of appendix A9: (runtime, cache), the eager references first.
VARIANTS = (
    ("eager", "dynamic"),
    ("eager", "prealloc"),
    ("jit-trace", "tuple"),
    ("convert", "dynamic"),
    ("export", "static"),
)


def decode_variant(model, input_ids, new_tokens, runtime, cache, graphs=None, meter=None) -> Generation:
    check_runtime(runtime, cache)
    if runtime == "eager":
        return generate(model, input_ids, new_tokens, cache=cache, loop="v5", meter=meter)
    return generate_graph(model, input_ids, new_tokens, runtime, graphs, meter=meter)


def time_variants(model, input_ids, new_tokens, variants=VARIANTS, repeats: int = 3, every: bool = False) -> dict:
    """Median seconds per decode of each variant (`every=True`: the seconds of every repeat, in order), unmetered,
    interleaved `repeats` times (kvlab.timing); graphs are built once, before any timing."""
    graphs = {variant: build_graphs(model, input_ids, new_tokens, variant[0]) for variant in variants}
    # Warm-up with a few tokens: TorchScript's profiling executor optimises a graph on its first runs.
    seconds = interleaved(
        {v: (lambda v=v: decode_variant(model, input_ids, new_tokens, *v, graphs[v]).seconds) for v in variants},
        repeats,
        warmup={v: (lambda v=v: decode_variant(model, input_ids, min(new_tokens, 3), *v, graphs[v])) for v in variants},
    )
    return seconds if every else {variant: statistics.median_high(times) for variant, times in seconds.items()}
