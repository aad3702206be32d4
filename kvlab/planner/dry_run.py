"""The dry run: kvlab's loop on the meta device, where tensors have shapes and no data, with SDPA and the masks as a
CPU makes them (kvlab.planner.meta.MetaAsCpu), under the meter's live-storage count. At the steps that cannot hold
the peak (`peak_steps`) the forward is skipped: the cache grows by the step's token without it (`SkippingForward`,
generate()'s per-step hook). The count a CPU run gives, in a few forwards (tests/test_dry_run.py). Every dry run
asks the meta kernels from memory (kvlab.planner.meta.KnownShapes).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from .. import theory
from ..caches import KVCache, TupleCache, forward, make_cache
from ..decoding import decoding
from ..designs import ListLayer, PreallocLayer, WindowLayer
from ..loops import generate
from ..meter import MemoryMeter
from ..models import final_kv_bytes
from ..schema import DEFAULTS, beams, over_kv
from .meta import KnownShapes, MetaAsCpu
from .sources import build_model
from .theory import CUBLAS_TERM

# The output field that carries the cache back: renamed `cache` in 5.24 (kvlab.compat reads either).
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

# What a dry run whose experts' routing depends on the data answers (kvlab.planner.meta.MetaAsCpu).
ROUTING_BOUND = (
    "an upper bound: the experts' routing depends on the weights and the prompt, so the dry run gives every expert "
    "every token in every top-k slot; measure the exact peak of a prompt with kvlab measure (--seed draws it)"
)


def dry_run(
    model,
    batch: int,
    prompt: int,
    new: int,
    skip: bool = True,
    plan: BulkPlan | None = None,
    as_device=None,
    counter=None,
    **options,
):
    """kvlab's loop (`generate(**options)`) on the meta device for a model built there: (the meter's report, the
    cache it ends with). `skip`: the forward only at the steps that can hold the peak of a cache design of
    kvlab's (`peak_steps`); False, or a cache object of transformers' own to decode into: every step. `plan`:
    fewer forwards still, and only the plan's steps looped (`BulkSkippingForward`), the timeline numbered as in
    the whole loop. The loop's own tensors of a token per step (the ids, positions, beam search's buffers) are then
    shorter by the steps not looped (kvlab.planner.fast extrapolates them).
    `as_device`: the device the forward allocates as (kvlab.planner.meta; default `MetaAsCpu()`); `counter`: the
    meter's live-storage counter, if one that notes more than kvlab.meter's (kvlab.planner.fast's shares)."""
    ids = torch.empty((batch, prompt), dtype=torch.long, device="meta")
    cache = options.get("cache", "dynamic")
    if plan is not None and not (skip and isinstance(cache, str)):
        raise ValueError("a dry run loops a plan's steps only when it skips the others")
    if skip and isinstance(cache, str):
        step_forward = (
            BulkSkippingForward(plan) if plan else skipping_forward(cache, new, options.get("cache_options") or {})
        )
        options = {"step_forward": step_forward, **options}
    meter = MemoryMeter("meta", model)
    if counter is not None:
        meter.counter = counter
        counter.labels = meter.labels  # what the meter names each storage, for a counter that splits its own
    with as_device or MetaAsCpu(), KnownShapes(), meter:
        out = generate(model, ids, len(plan.visits) if plan else new, meter=meter, **options)
    report = meter.report()
    if plan:
        steps = [dataclasses.replace(s, step=plan.visits[s.step]) for s in report.timeline]
        report = dataclasses.replace(report, timeline=steps)
    return report, out.cache


def peak_steps(
    cache: str,
    new_tokens: int,
    block_tokens: int = DEFAULTS["block_tokens"],
    chunk_limit: int = DEFAULTS["chunk_limit"],
) -> frozenset[int]:
    """The steps whose forward can hold a run's peak: the prompt's (0), the first decode step (where what the
    prompt's step left still lives) and the last; for `prealloc` the last `block_tokens` steps, for `list` the last
    `chunk_limit` ones. Why (tested against full runs' timelines in tests/test_dry_run.py): from
    step 2 on each step holds what the one before held with a token more in every growing tensor, so a later
    step holds at least as much; except where a design reallocates only every few steps (prealloc's buffers and
    window moves every `block_tokens`, list's consolidation every `chunk_limit - 1`), and the last such step
    holds at least as much as any earlier one."""
    period = _period(cache, block_tokens, chunk_limit)
    last = new_tokens - 1
    return frozenset(step for step in (0, 1, *range(last - period + 1, last + 1)) if 0 <= step <= last)


def _period(cache: str, block_tokens: int, chunk_limit: int) -> int:
    """How many steps apart a design reallocates: 1 where it does so every step (or never)."""
    return {"prealloc": block_tokens, "list": chunk_limit}.get(cache, 1)


def skipping_forward(cache: str, new: int, cache_options: dict) -> SkippingForward:
    """The dry run's `step_forward` for a run of design `cache` (its `cache_options`) decoding `new` tokens."""
    block_tokens = cache_options.get("block_tokens", DEFAULTS["block_tokens"])
    return SkippingForward(
        peak_steps(cache, new, block_tokens, cache_options.get("chunk_limit", DEFAULTS["chunk_limit"]))
    )


class SkippingForward:
    """generate()'s `step_forward` for a dry run: the model's forward at `steps`; at every other step the cache grows
    by the fed tokens without it, and the outputs are the logits the forward would have returned (their shape and
    dtype: they stay alive into the next step, as the forward's would). `tuple` makes its round trip as its
    forward does: a new tuple cat-ed while the old one is still held."""

    def __init__(self, steps):
        self.steps = steps

    def __call__(self, step, model, cache, **inputs):
        if step in self.steps:
            return forward(model, cache, **inputs)
        fed = inputs["input_ids"].shape
        # 5.x computes the last position's logits in the model's dtype; 4.x every fed position's, upcast to fp32.
        kept = inputs.get("logits_to_keep")
        shape = (fed[0], kept or fed[1], model.config.get_text_config(decoder=True).vocab_size)
        logits = torch.empty(shape, dtype=model.dtype if kept else torch.float32, device="meta")
        grown = KVCache.from_tuples(cache.to_tuples(), len(cache.layers)) if isinstance(cache, TupleCache) else cache
        self.grow(grown, step, fed[1])
        returned = TupleCache.from_tuples(grown.to_tuples(), len(cache.layers)) if grown is not cache else cache
        return CausalLMOutputWithPast(logits=logits, **{CACHE_FIELD: grown}), returned

    def grow(self, cache, step: int, tokens: int) -> None:
        advance(cache, tokens)


def _design_period(cache: str, cache_options: dict) -> int:
    return _period(
        cache,
        cache_options.get("block_tokens", DEFAULTS["block_tokens"]),
        cache_options.get("chunk_limit", DEFAULTS["chunk_limit"]),
    )


class ForwardRule:
    """Which steps of a run of `new` tokens a bulk dry run runs the forward at, asked before each step of the cache
    as it is then: 0, 1, the last, and in the window (the last `period` steps, `peak_steps`') the last time a
    layer reallocates (`reallocates`: a list layer consolidating, a prealloc buffer growing, a window moving): one
    whose next reallocation, a period on, would come after the last step. A step more is kept than that needs, and
    so is a prealloc layer's reallocation a period on from its first block, which holds the prompt and fills
    sooner. Between the kept steps every step holds what the one before held and a token more.
    tests/test_fast.py holds the kept steps against CPU runs' timelines."""

    def __init__(self, new: int, period: int):
        self.last, self.window = new - 1, max(2, new - period)

    def __call__(self, step: int, cache) -> bool:
        return step in (0, 1, self.last) or (step >= self.window and reallocates(cache, self.last - step - 1))


@dataclasses.dataclass(frozen=True)
class BulkPlan:
    """The steps a bulk dry run loops (`visits`, in the whole loop's numbering) and those of them that run the
    forward (`kept`): 0, 1, 2 and the kept steps, and before a kept step that follows another after a gap, the step
    before it (which adds the gap's tokens: a kept step's own timeline holds its forward alone)."""

    visits: tuple[int, ...]
    kept: frozenset[int]

    @classmethod
    def of(cls, kept: set[int], new: int) -> BulkPlan:
        visits: list[int] = []
        for step in sorted({step for step in (0, 1, 2) if step < new} | kept):
            if step > 2 and visits[-1] in kept and visits[-1] != step - 1:
                visits.append(step - 1)
            visits.append(step)
        return cls(tuple(visits), frozenset(kept))


def bulk_plan(model, cache: str, prompt: int, new: int, cache_options: dict) -> BulkPlan:
    """The plan of a bulk dry run of `model` decoding `new` tokens after `prompt` into a cache of design `cache`
    (its `cache_options`): the kept steps (`ForwardRule`) found on a stand-in, the same design's cache for `model`
    grown by tensors of one token's worth of one number (on the CPU, no meter) as the run grows it, a token a step:
    when its layers reallocate depends on the tokens they hold alone (kvlab.designs; `BulkSkippingForward` checks it
    at each kept step of the run)."""
    rule = ForwardRule(new, _design_period(cache, cache_options))
    kept = {step for step in (0, 1, rule.last) if step >= 0}
    stand_in = make_cache(cache, model, **cache_options) if rule.window < rule.last else None
    layers = [layer for layer in getattr(stand_in, "layers", ()) if isinstance(layer, (ListLayer, PreallocLayer))]
    if layers:
        token = lambda n: torch.zeros((1, 1, n, 1))  # noqa: E731
        for layer in layers:
            layer.update(token(prompt), token(prompt))
        advance_bulk(stand_in, rule.window - 1)  # the tokens held before the window's first step
        for step in range(rule.window, rule.last):
            if rule(step, stand_in):
                kept.add(step)
            advance(stand_in, 1)
    return BulkPlan.of(kept, new)


class BulkSkippingForward(SkippingForward):
    """`SkippingForward` with fewer forwards and no token-by-token growth: the loop runs a plan's steps (`BulkPlan`,
    its step numbers the loop's index into `visits`), the forward at its kept steps; each other step adds its
    token and those of the steps not looped up to the next one (`advance_bulk`: the layers end as token-by-token
    growth leaves them; the transient of the growth differs, which the kept steps never hold). tests/test_fast.py
    holds the answer against the whole model's dry run."""

    def __init__(self, plan: BulkPlan):
        self.plan = plan
        super().__init__(frozenset())  # the forward is this class's to run

    def __call__(self, step, model, cache, **inputs):
        real, last = self.plan.visits[step], self.plan.visits[-1]
        if real in self.plan.kept:
            if 1 < real < last and not reallocates(cache):  # the stand-in and the run disagree
                raise RuntimeError(f"a dry run's plan kept step {real}, where its cache reallocates nothing")
            return forward(model, cache, **inputs)
        return super().__call__(step, model, cache, **inputs)

    def grow(self, cache, step: int, tokens: int) -> None:
        visits = self.plan.visits
        steps = visits[step + 1] - 1 - visits[step - 1]  # its own and the steps not looped, to the next one
        (advance_bulk if steps > 1 else advance)(cache, tokens * steps)


def reallocates(cache, steps_left: int | None = None) -> bool:
    """Whether a layer of kvlab's periodic designs allocates anew at the next token (a list layer consolidates, a
    prealloc buffer grows, a window buffer moves: kvlab.designs, the rules of their `update`); with `steps_left`,
    only a layer that will not do so again in that many steps (its period on: the last time holds the most)."""
    periods = [_reallocating(layer) for layer in cache.layers]
    return any(period is not None and (steps_left is None or period > steps_left) for period in periods)


def _reallocating(layer) -> int | None:
    """The layer's period (steps from one reallocation to the next) if its next token reallocates; else None."""
    if isinstance(layer, ListLayer):
        return layer.chunk_limit - 1 if len(layer.key_chunks) + 1 >= layer.chunk_limit else None
    if isinstance(layer, WindowLayer):
        full = layer.key_buffer is None or layer.end + 1 > layer.sliding_window - 1 + layer.block_tokens
        return layer.block_tokens if full else None
    if isinstance(layer, PreallocLayer):
        full = layer.key_buffer is None or layer.length + 1 > layer.key_buffer.shape[-2]
        return layer.block_tokens if full else None
    return None


def advance_bulk(cache, tokens: int) -> None:
    """`advance(cache, tokens)` in a few updates per layer, each layer left as `tokens` single-token updates leave
    it (the same tensors, of the same shapes): the transient of the growth differs (one update's), which the dry
    run's kept steps never hold. Per design: a prealloc buffer grows to the same block in one update; a list layer
    gets its tokens up to its last consolidation as one chunk, joined as that consolidation joins them, then the
    rest one by one; a window buffer's phase is its every token's, so it grows token by token, but only until its
    phase repeats (`_advance_window`); transformers' layers get all but one token in one update and the last alone
    (a sliding layer keeps a view of the last update's concatenation: its storage is the last update's size)."""
    for layer in cache.layers:
        if tokens < 1 or (held := _last_written(layer)) is None:
            continue
        like = [(t.shape, t.dtype, t.device) for t in held]  # keys and values: MLA's differ in width
        del held
        grow = functools.partial(_grow, layer, like)
        if isinstance(layer, WindowLayer):
            _advance_window(layer, tokens, grow)
            continue
        for n in _bulk_updates(layer, tokens):
            if n:
                grow(n)
            else:  # a list layer's consolidation, as its update makes it: the chunks joined into one
                layer.keys, layer.values = layer.keys, layer.values


def _bulk_updates(layer, tokens: int) -> list[int]:
    """The updates `advance_bulk` gives a layer, in tokens each; 0: a list layer's chunks joined."""
    if isinstance(layer, PreallocLayer):
        return [tokens]
    if isinstance(layer, ListLayer):
        # One at a time, the appends that consolidate are the (limit - chunks)-th and every (limit - 1)-th after.
        first, every = layer.chunk_limit - len(layer.key_chunks), layer.chunk_limit - 1
        if tokens < first:
            return [1] * tokens
        last = first + (tokens - first) // every * every
        return [last, 0] + [1] * (tokens - last)
    return [tokens - 1, 1] if tokens > 1 else [tokens]


def _advance_window(layer: WindowLayer, tokens: int, grow) -> None:
    """`tokens` single-token updates of a window layer, looped only until its phase repeats. After its first update
    its buffer is never reallocated, and where the next token goes (`start`, `end`) is a function of where the last
    one went (kvlab.designs.WindowLayer.update): from a repeated phase on, the phases cycle, so the phase after the
    last token is one already seen, and the layer is left there: its views of the same buffer, and the tokens it
    has seen (`cumulative_length`) counted."""
    phases: dict[tuple[int, int], int] = {}  # phase -> how many tokens were in before it
    for done in range(tokens):
        phase = (layer.start, layer.end)
        if phase in phases:
            first = phases[phase]
            end_phase = list(phases)[first + (tokens - first) % (done - first)]
            layer.start, layer.end = end_phase
            layer.cumulative_length += tokens - done
            layer._views()
            return
        phases[phase] = done
        grow(1)


def _grow(layer, like, tokens: int) -> None:
    """One update of `layer` by `tokens` new tokens of the shapes and dtypes `like` (keys', values'). A list layer
    appends them as its update does, without the join its update returns for attention, which no skipped step
    runs (a transient of the layer's size, and half of a skipped step's time)."""
    keys, values = (
        torch.empty((*shape[:-2], tokens, shape[-1]), dtype=dtype, device=device) for shape, dtype, device in like
    )
    if not isinstance(layer, ListLayer):
        layer.update(keys, values)
        return
    layer.key_chunks.append(keys)
    layer.value_chunks.append(values)
    if len(layer.key_chunks) >= layer.chunk_limit:  # ListLayer.update's consolidation
        layer.key_chunks = [torch.cat(layer.key_chunks, dim=-2)]
        layer.value_chunks = [torch.cat(layer.value_chunks, dim=-2)]


def advance(cache, tokens: int) -> None:
    """Grow every attention layer of `cache` by `tokens` tokens, one at a time as decoding steps add them, without
    a forward: on meta, where no value is read, this is what a step the dry run skips leaves behind (but for the
    transients of a list layer's update, `_grow`). Recurrent state does not grow; a layer that caches nothing is
    left alone."""
    for layer in cache.layers:
        if (held := _last_written(layer)) is None:
            continue
        # Shapes, not the tensors: holding the layer's old keys and values would keep them alive while it grows.
        like = [(t.shape, t.dtype, t.device) for t in held]
        del held
        for _ in range(tokens):
            _grow(layer, like, 1)


def _last_written(layer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A tensor of the layer's keys and one of its values (their shapes but the length are the next token's), read
    without a copy (ListLayer.keys would join its chunks); None for a layer without keys and values."""
    if isinstance(layer, ListLayer):
        return (layer.key_chunks[-1], layer.value_chunks[-1]) if layer.key_chunks else None
    if isinstance(layer, PreallocLayer):
        return (layer.key_buffer, layer.value_buffer) if layer.key_buffer is not None else None
    keys = getattr(layer, "keys", None)
    return (keys, layer.values) if getattr(layer, "is_initialized", False) and keys is not None else None


def held_tokens(cache) -> list[int]:
    """Tokens each layer's storage has room for (a sliding layer's view of a longer buffer counts the buffer, a list
    layer its chunks); 0 for a layer without keys and values."""
    held = []
    for layer in cache.layers:
        keys = layer.key_chunks if isinstance(layer, ListLayer) else [(_last_written(layer) or (None,))[0]]
        held.append(sum(_storage_tokens(t) for t in keys if t is not None))
    return held


def _storage_tokens(tensor: torch.Tensor) -> int:
    per_token = tensor.numel() // tensor.shape[-2] * tensor.element_size() if tensor.shape[-2] else 0
    return tensor.untyped_storage().nbytes() // per_token if per_token else 0


class DryRun:
    """predict's walk for every decoder kvlab.theory does not model: a dry run per design."""

    def __init__(self, p: dict, as_device=None):
        if p["restart_new"]:
            raise ValueError(
                "predict's dry run decodes one call; measure a restart on the meta device (measure --device meta)"
            )
        self.p, self.as_device = p, as_device or (lambda: MetaAsCpu())  # a fresh mode for every run
        self.model = build_model(p["preset"], p["overrides"], "meta", p["dtype"], p["seed"])

    def overhead(self, design: dict) -> int:
        return self.measure(design)[0].overhead_bytes

    def breakdown(self, design: dict) -> dict:
        bounded = MetaAsCpu.bounded
        report, held = self.measure(design)
        routed = MetaAsCpu.bounded > bounded  # the routing was answered by its bound
        config, d = self.model.config, design
        kv_final = final_kv_bytes(config, d["batch"] * beams(dict(self.p, **d)), d["prompt"] + d["new"], d["dtype"])
        peak_step = max(report.timeline, key=lambda s: s.peak_bytes).step
        return {
            "predicted_overhead_bytes": report.overhead_bytes,
            "kv_final_bytes": kv_final,
            "cache_tokens_per_layer": theory.tokens_per_layer(held),
            "overhead_over_kv": over_kv(report.overhead_bytes, kv_final),
            "peak_at": f"step {peak_step} (dry run on meta{', routing bounded' if routed else ''})",
            **({"bound": ROUTING_BOUND} if routed else {}),
            "terms_bytes": {f"{part} at the peak": n for part, n in report.at_peak.items() if n and part != "weights"},
        }

    def measure(self, design: dict):
        """One design's count: (the meter's report, the tokens each layer's storage holds at the end)."""
        report, cache = self.run(design)
        return report, held_tokens(cache)

    def run(self, design: dict, model=None, plan: BulkPlan | None = None, counter=None, step_forward=None):
        """The meta run of one design (of `model`, else the whole model; `plan`, `counter`: as `dry_run`;
        `step_forward`: the plan's, if not `BulkSkippingForward`): (the meter's report, the cache it ends with)."""
        d = design
        strategy = decoding(d["strategy"], d["num_beams"])
        return dry_run(
            self.model if model is None else model,
            d["batch"],
            d["prompt"],
            d["new"],
            cache=d["cache"],
            loop=d["loop"],
            strategy=strategy,
            cache_options=cache_options(d),
            as_device=self.as_device(),
            plan=plan,
            counter=counter,
            **({"step_forward": step_forward} if step_forward else {}),
        )


def cache_options(design: dict) -> dict:
    """The options of a design's cache (kvlab.caches.make_cache)."""
    d = design
    return dict(block_tokens=d["block_tokens"], chunk_limit=d["chunk_limit"], max_cache_len=d["prompt"] + d["new"] - 1)


class PlusWorkspace:
    """A dry run for a CUDA target (`DryRun` or the fast one), plus cuBLAS's workspace, which a process's first matrix
    product allocates through the caching allocator (kvlab.cuda_memory) and no meta forward shows."""

    def __init__(self, walk, workspace: int):
        self.walk, self.workspace = walk, workspace

    def overhead(self, design: dict) -> int:
        return self.walk.overhead(design) + self.workspace

    def breakdown(self, design: dict) -> dict:
        row = self.walk.breakdown(design)
        row["predicted_overhead_bytes"] += self.workspace
        row["terms_bytes"][CUBLAS_TERM] = self.workspace
        row["overhead_over_kv"] = over_kv(row["predicted_overhead_bytes"], row["kv_final_bytes"])
        return row
