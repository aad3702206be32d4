"""The analytic peak for any point planned for: kvlab.theory's walk (the lesson's: greedy, one generate() call,
full attention, CPU and meta) extended through a richer `Run` (`PlannedRun`: its rules) and its `CacheWalk`
(`DesignWalk`) to kvlab's own designs (list and prealloc: kvlab.designs; `Buffers`), beam search and sampling,
restarts (a second generate() call), kvlab.graphs' runtimes, sliding windows (their masks, 5.x's static and sliding
layers: `Layers`) and GPT-OSS's eager attention and experts, and to a CUDA GPU and transformers' exported program.
On CUDA the kernel SDPA picks adds what it allocates inside (kvlab.cuda_memory.sdpa_terms), every term becomes a
block of the caching allocator, and cuBLAS's workspace joins once the first matrix product has run. The exported
static-cache program (kvlab.graphs, runtime export) has phases of its own (`_exported_peak`).

The same signatures as kvlab.theory's, with the GPU's architecture (`arch`, kvlab.cuda_memory.ARCHES) beside the
CPU's threads: `peak_phases`, `phase_terms`, `predict_overhead`, `breakdown`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

from ..counts import final_kv_bytes, sliding_windows, window_tokens
from ..cuda_memory import block, cublas_workspace, reserved_estimate, sdpa_backend, sdpa_terms
from ..theory import (
    FP32,
    INT64,
    PHASES,
    CacheWalk,
    Run,
    Shape,
    Step,
    attention_inputs,
    call_steps,
    design_point,
    explained,
    held_through_the_step,
    largest_phase,
    walk_phases,
)

CUBLAS_TERM = "cuBLAS workspace (the process's first matrix product allocates it)"


def peak_phases(config, threads: int | None = None, arch: str = "hopper", **point):
    """kvlab.theory.peak_phases on any device and runtime: (peak, the phase that makes it, its terms, final KV,
    tokens each layer's storage holds at the end). On CUDA what the kernel SDPA picks on a GPU of `arch` allocates,
    every term a block of the caching allocator and cuBLAS's workspace (`_on_cuda`)."""
    p = design_point(point)
    cuda = _on_a_gpu(p)
    if p["runtime"] == "export":
        s = Shape(config, p["batch"], p["dtype"], p["strategy"], p["num_beams"])
        peak, where, terms, held = _exported_peak(s, p["prompt"], p["new"])
        if cuda:
            terms = _on_cuda(terms, arch, matrix_products_ran=True)
        kv_final = final_kv_bytes(config, s.rows, p["prompt"] + p["new"], p["dtype"])
        return sum(terms.values()), where, terms, kv_final, held
    r = PlannedRun(config, p, threads)
    walk = DesignWalk(r)
    kv_final = final_kv_bytes(config, r.s.rows, r.max_len, p["dtype"])
    return (*largest_phase(_device_phases(r, walk, arch)), kv_final, walk.held_tokens())


def phase_terms(config, step: int, phase: str, threads: int | None = None, arch: str = "hopper", **point) -> dict:
    """The terms of one phase of one step (`peak_phases` keeps the largest), e.g. a long prompt's attention."""
    p = design_point(point)
    r = PlannedRun(config, p, threads)
    return terms_at(_device_phases(r, DesignWalk(r), arch), step, phase)


def terms_at(phases, step: int, phase: str) -> dict:
    for at, name, terms in phases:
        if at.index == step and name == phase:
            return terms
    raise ValueError(f"step {step} has no phase {phase!r} at this point")


def predict_overhead(config, threads: int | None = None, arch: str = "hopper", **point) -> int:
    """The predicted peak bytes above the weights for one point (see `peak_phases`)."""
    return int(peak_phases(config, threads, arch, **point)[0])


def breakdown(config, threads: int | None = None, arch: str = "hopper", **point) -> dict:
    """kvlab.theory.breakdown on any device; on CUDA also the bytes the allocator reserves for the peak's blocks
    (kvlab.cuda_memory.reserved_estimate: an estimate, a floor)."""
    total, where, terms, kv_final, held = peak_phases(config, threads, arch, **point)
    reserved = reserved_estimate([v for v in terms.values() if v]) if _on_a_gpu(design_point(point)) else None
    return explained(total, where, terms, kv_final, held, reserved)


def _on_a_gpu(p: dict) -> bool:
    return str(p["device"]).startswith("cuda")


def _device_phases(r: Run, walk: CacheWalk, arch: str):
    """kvlab.theory.walk_phases; on CUDA with SDPA's kernel terms and each phase as the allocator counts it."""
    if r.device != "cuda":
        yield from walk_phases(r, walk)
        return
    r.gpu_kernel = partial(_cuda_sdpa, arch)
    for step, name, terms in walk_phases(r, walk):
        # the first forward's mask is built before its first matrix product
        yield step, name, _on_cuda(terms, arch, matrix_products_ran=step.index > 0 or name != "mask")


def _cuda_sdpa(arch: str, r: Run, step: Step, masked: bool, grouped: bool) -> dict:
    """What the SDPA call allocates inside on a GPU of `arch`: the kernel it picks (kvlab.cuda_memory.sdpa_terms)."""
    s = r.s
    backend = sdpa_backend(arch, s.e, s.head_dim, masked, grouped)
    mask = r.mask_rows * step.fed * step.keys if masked else 0  # the bool mask's elements: (rows, 1, fed, keys)
    return sdpa_terms(backend, s.rows, s.heads, step.fed, step.keys, s.head_dim, s.e, mask)


def _on_cuda(terms: dict, arch: str, matrix_products_ran: bool) -> dict:
    """A phase's terms as the CUDA caching allocator counts them: each a block rounded up to 512 bytes (a term that
    sums several tensors is rounded once: at most 511 bytes per tensor under the allocator's count), and cuBLAS's
    workspace once the first matrix product has run (kvlab.cuda_memory)."""
    terms = {name: block(int(value)) for name, value in terms.items()}
    if matrix_products_ran:
        terms[CUBLAS_TERM] = cublas_workspace(arch)
    return terms


def _exported_peak(s: Shape, prompt: int, new: int):
    """transformers' exported static-cache program (kvlab.graphs, runtime export), greedy, one program for
    the prompt and every step. Its buffers (prompt + new - 1 tokens) are written in place. The program is
    an FX graph that frees each intermediate after its last use (the embeddings too, unlike the eager
    forward); it returns every fed position's logits, and with a static cache the attention gets a mask,
    so grouped-query models run SDPA on repeat_kv copies of the whole buffer."""
    held, static_len = s.kv(prompt + new - 1), prompt + new - 1
    groups = s.heads // s.kv_heads
    copies = 2 * groups * s.t * static_len if groups > 1 else 0
    best = (-1, None, None)
    last = prompt + new - 1
    for index, fed, length in ((0, prompt, prompt), (new - 1, 1, last)):
        base = {"static cache buffers": held, "tokens (int64)": s.rows * length * INT64}
        if index:
            base["previous step's next-token logits (fp32)"] = s.rows * s.vocab * FP32
        residual = s.rows * fed * s.hidden * s.e
        phases = {
            "attention": {
                "repeat_kv copies of one layer (masked SDPA)": copies,
                "residual stream, q, k and v": residual + s.rows * fed * (s.heads + 2 * s.kv_heads) * s.head_dim * s.e,
            },
            "mlp": {"gate, up and their product": 3 * s.rows * fed * s.intermediate * s.e, "residual stream": residual},
            "lm_head": {"logits of every fed position": s.rows * fed * s.vocab * s.e, "final hidden states": residual},
        }
        for name, terms in phases.items():
            terms = {**base, **terms}
            total = sum(terms.values())
            if total > best[0]:
                best = (total, f"step {index} ({name})", terms)
    return best[0], best[1], best[2], [last] * s.layers


class PlannedRun(Run):
    """kvlab.theory's `Run` of point `p`, walked with the planner's rules (kvlab.theory's, and kvlab's own designs,
    beams, sampling, restarts and GPT-OSS's eager attention and experts), and what the lesson's walk leaves out: kvlab's
    own designs' options, a restart, kvlab.graphs' runtime and the config's sliding windows."""

    def __init__(self, config, p: dict, threads: int | None):
        super().__init__(config, p, threads)
        self.phases, self.held, self.previous, self.inputs = (
            _phases,
            _held_through_the_step,
            _previous_locals,
            _attention_inputs,
        )
        self.chunk_limit, self.block_tokens = p["chunk_limit"], p["block_tokens"]
        self.runtime, self.restart_from, self.restart_new = p["runtime"], p["restart_from"], p["restart_new"]
        self.max_len = self.prompt + self.new + self.restart_new  # the restart's tokens too
        self.static_len = self.max_len - 1
        self.held_after_first = self.prompt + self.new - 1  # tokens of the first call's cache: the caller's tuple
        self.windows = windows = sliding_windows(config)
        self.window = next((w for w in windows if w), None)  # the sliding mask's (one for every sliding layer)
        self.last_window, self.has_full = windows[-1], None in windows
        self.mask_rows = self.s.rows if self.passes_mask else 1
        # 5.x's StaticCache gives a sliding layer min(W, length) slots; empty where no layer is shorter.
        static = [min(w or self.static_len, self.static_len) for w in windows] if self.cache == "static" else []
        self.static_windows = static if any(w != self.static_len for w in static) else []


class Buffers:
    """Token slots of each layer's buffers under kvlab's `prealloc` (kvlab.designs). A full layer (`PreallocLayer`)
    grows in blocks; a sliding layer of window W (`WindowLayer`) holds W - 1 + block_tokens slots from its first
    update on: a prompt longer than that is read as it came and only its last W - 1 tokens are copied in, and when
    the buffer is full the kept window (at most W - 1 tokens) moves to the front through a clone."""

    def __init__(self, sliding: list, block_tokens: int):
        self.sliding, self.block = sliding, block_tokens
        self.storage = [0] * len(sliding)  # slots of each layer's keys (= values) buffer now
        self.start = [0] * len(sliding)  # a sliding layer's kept tokens: buffer[start:end]
        self.end = [0] * len(sliding)

    def update(self, fed: int, before: int) -> int:
        """Write `fed` tokens after `before`; returns the largest transient of one layer, in tokens: an old values
        buffer while it grows, or the clone of a window as it moves."""
        transient = 0
        for i, window in enumerate(self.sliding):
            if window is None:
                grown = math.ceil((before + fed) / self.block) * self.block
                if before > 0 and grown > self.storage[i]:
                    transient = max(transient, self.storage[i])
                self.storage[i] = max(self.storage[i], grown)
                continue
            capacity = self.storage[i] = window - 1 + self.block
            start, end = self.start[i], self.end[i]
            if end + fed > capacity and start > 0:
                transient, start, end = max(transient, end - start), 0, end - start
            if end + fed <= capacity:
                end += fed
            else:  # more than the buffer holds: only the last W - 1 tokens are copied in
                start, end = 0, min(window - 1, end - start + fed)
            self.start[i], self.end[i] = max(start, end - (window - 1)), end
        return transient


@dataclass
class DesignStep(Step):
    """kvlab.theory's `Step`, and the restart's call, a sliding layer's keys and what kvlab's own designs do in its
    update."""

    call: int = 0  # 0: the first generate() call; 1: the restart's
    first_of_call: bool = False
    seen: int = 0  # keys a sliding layer attends to (every key on a full-attention model)
    transient: int = 0  # prealloc: tokens of one layer's buffer copied aside during the update
    chunks: int = 0  # list: chunks per layer after the update
    consolidated: bool = False  # list: this update joined the chunks into one

    def where(self, phase: str) -> str:
        """kvlab.theory's, a restart's step named so."""
        return f"step {self.index} ({'restart ' if self.call else ''}{phase})"


class DesignWalk(CacheWalk):
    """kvlab.theory's walk, and a restart's second call, the sliding layers' storage (5.x's dynamic `Layers`, its
    static cache's shorter buffers) and kvlab's own designs: prealloc's buffers (`Buffers`), the list's chunk
    count."""

    def __init__(self, run: PlannedRun):
        super().__init__(run)
        # 5.x's dynamic cache on a sliding or hybrid config: each layer's storage walked step by step.
        sliding = run.windows if run.cache == "dynamic" and run.release.major == 5 else []
        self.layers = Layers(list(sliding)) if any(sliding) else None
        self.buffers = Buffers(run.windows, run.block_tokens) if run.cache == "prealloc" else None
        self.chunks = self.transient = self.call = self.seen = 0

    def steps(self):
        for index, (call, fed, before, after) in enumerate(_calls(self.run)):
            self.call = call
            yield self._advance(index, fed, before, after)

    def _advance(self, index: int, fed: int, before: int, after: int) -> DesignStep:
        r, consolidated = self.run, False
        self.transient, self.seen = 0, after
        step = super()._advance(index, fed, before, after)  # the storage, `seen` and `transient`: `_storage`
        if r.cache == "list":
            self.chunks = 1 if index == 0 else self.chunks + 1
            if self.chunks >= r.chunk_limit:
                self.chunks, consolidated = 1, True
        mask = _mask(r, fed, self.seen, step.keys)  # step.keys: what a full layer attends to
        return DesignStep(
            **{
                **vars(step),
                # convert: the caller's tuple stays referenced while the copied cache object grows
                "old_tuple": r.s.kv(before) if r.runtime == "convert" else step.old_tuple,
                "keys": self.seen if r.last_window else step.keys,
                "mask": mask,
                "masked": bool(mask and fed > 1 and r.last_window),  # more than one query past the window
            },
            call=self.call,
            first_of_call=index == 0 or (self.call == 1 and before == r.held_after_first),
            seen=self.seen,
            transient=self.transient,
            chunks=self.chunks,
            consolidated=consolidated,
        )

    def _storage(self, index: int, fed: int, before: int, after: int) -> tuple:
        r = self.run
        if self.buffers is not None:
            last_slots = self.buffers.storage[-1]
            self.transient = self.buffers.update(fed, before)
            self.seen = window_tokens(r.window, after, fed)  # a sliding layer: its kept window + fed
            return 2 * r.s.t * sum(self.buffers.storage), before, self.buffers.storage[-1] - last_slots
        if self.layers is not None:
            old_last = self.layers.storage[-1]
            self.layers.update(fed)
            if r.window:
                self.seen = self.layers.storage[r.windows.index(r.window)]
            return 2 * r.s.t * sum(self.layers.storage), old_last, self.layers.storage[-1] - old_last
        if r.static_windows:  # each layer allocates its whole buffers at its first update
            return 2 * r.s.t * sum(r.static_windows), before, r.static_windows[-1] if index == 0 else 0
        return super()._storage(index, fed, before, after)

    def held_tokens(self) -> list:
        """Tokens each layer's storage holds at the end (sliding layers plateau at the window, the rest grow)."""
        storage = self.buffers or self.layers
        return list(storage.storage) if storage else self.run.static_windows or super().held_tokens()


def _calls(r: PlannedRun) -> list:
    """(call, tokens fed, cache length before, after) for every forward: the first generate() call's, then the
    restart's, one token a step."""
    first = [(0, *step) for step in call_steps(r.prompt, r.new)]
    length = first[-1][-1] if first else 0
    return first + [(1, 1, length + i, length + i + 1) for i in range(r.restart_new)]


class Layers:
    """Token lengths of each layer's key (= value) storage under 5.x's dynamic layers. A sliding layer
    (`DynamicSlidingWindowLayer`) cats the new tokens onto the last window - 1 it kept and keeps a view of that
    result: its storage is min(cached, W - 1) + fed, so after a prefill of P > W tokens the whole P-token
    buffer stays alive until the first decode step; a beam reorder copies the view (W - 1, contiguous)."""

    def __init__(self, sliding: list):
        self.sliding = sliding
        self.storage = [0] * len(sliding)  # tokens of each layer's storage now
        self.kept = [0] * len(sliding)  # tokens each layer's view (what the next cat copies) holds

    def update(self, fed: int) -> None:
        for i, window in enumerate(self.sliding):
            self.storage[i] = self.kept[i] + fed
            self.kept[i] = window_tokens(window, self.storage[i])

    def reorder(self, t: int) -> int:
        """The peak of a beam reorder, one tensor at a time (keys then values, layer by layer), in bytes."""
        total, peak = 2 * t * sum(self.storage), 0
        for i in range(len(self.storage)):
            for _ in "kv":
                peak = max(peak, total + t * self.kept[i])
                total += t * (self.kept[i] - self.storage[i])
            self.storage[i] = self.kept[i]
        return peak


def _mask(r: PlannedRun, fed: int, seen: int, full_seen: int) -> dict:
    """The attention mask a forward builds, alive until the decoder stack returns (before the lm_head). SDPA gets
    one only past a sliding window (else its is_causal shortcut needs none): a bool per (query, key). Eager attention
    (GPT-OSS) gets one per layer type at every step, in the model's dtype."""
    s = r.s
    if not s.eager:
        return (
            {"sliding-window attention mask (bool)": r.mask_rows * fed * seen} if r.window and seen >= r.window else {}
        )
    return {
        "attention masks (model dtype)": s.rows * fed * s.e * (full_seen * r.has_full + seen * (r.window is not None))
    }


def _update_phase(r: Run, step: DesignStep) -> dict:
    """kvlab.theory's update, and the copies kvlab's own designs make in theirs (the list's consolidation, a prealloc
    buffer's growth or its window's move); a restart from tuples: the second call's first cat reads the caller's
    tuple, which holds the old values (not the cache's own)."""
    terms = PHASES["update"](r, step)
    if step.consolidated:
        terms["consolidation: old chunks during the cat"] = r.s.t * step.after
    if step.transient:
        terms["old values buffer during growth, or a window's clone as it moves"] = r.s.t * step.transient
    if step.call == 1 and step.first_of_call and r.restart_from == "tuples":
        terms.pop("old values tensor during its cat", None)
    return terms


def _attention_inputs(r: Run, step: DesignStep) -> dict:
    """kvlab.theory's: what the last layer's attention sits on; the layer's new keys and values stay alive where
    prealloc's window buffer is too short for the feed (attention reads them as they came), and the list joins its
    chunks for attention."""
    s, fed, terms = r.s, step.fed, attention_inputs(r, step)
    if r.cache == "prealloc" and r.last_window and fed > r.last_window - 1 + r.block_tokens:
        terms["activations of one layer"] += 2 * s.t * fed
    if r.cache == "list" and step.chunks > 1:
        terms["keys and values concatenated for attention"] = 2 * s.t * step.after
    return terms


def _eager_attention_phase(r: Run, step: Step) -> dict:
    """Eager attention (GPT-OSS) peaks as it shifts the scores for the softmax: the masked scores, the scores with
    one sink column, their shifted copy and the row maxima, beside repeat_kv copies of the keys and values."""
    s, terms = r.s, _attention_inputs(r, step)
    terms["eager attention: scores, with the sinks, shifted, and their maxima"] = _one_keys_scores(s, step.fed) * (
        3 * step.keys + 3
    )
    terms["repeat_kv copies of one layer"] = 2 * r.groups * s.t * step.keys if r.groups > 1 else 0
    return terms


def _one_keys_scores(s: Shape, fed: int) -> int:
    """Bytes of the attention scores against one key: a score per (row, head, query)."""
    return s.rows * s.heads * fed * s.e


def _mlp_phase(r: Run, step: Step) -> dict:
    """kvlab.theory's MLP; GPT-OSS's experts (grouped_mm) instead work on each token's top-k (token, expert) pairs,
    sorted by expert, and its eager attention leaves the layer's attention probabilities alive."""
    s, fed, terms = r.s, step.fed, PHASES["mlp"](r, step)
    if s.experts:
        pairs = s.rows * fed * s.top_k
        terms.update(
            {
                "gate, up and their product": 0,
                "experts: gate_up and its biases (2 x 2I); gate, up, glu, up + 1 and their product (5 x I)": 9
                * pairs
                * s.intermediate
                * s.e,
                "experts: the hidden states gathered per pair": pairs * s.hidden * s.e,
                "router logits and scores; pair order, expert ids and weights": s.rows
                * fed
                * (s.experts * s.e + s.top_k * (s.e + INT64))
                + pairs * (s.e + FP32 + 2 * INT64),
                "attention probabilities the layer keeps (eager)": (
                    _one_keys_scores(s, fed) * (step.keys + 1) if s.eager else 0
                ),
            }
        )
    return terms


def _beam_scoring_phase(r: Run, step: Step) -> dict | None:
    """Beam search scores the fp32 next-token logits: log_softmax, plus the beam scores (two more vocabulary-wide
    tensors); the previous step's scores died as the log-probabilities rebound their name."""
    if r.strategy != "beam" or r.keeps_outputs:
        return None
    vocab_fp32 = r.s.rows * r.s.vocab * FP32
    return {
        "cache after the update": step.held_after,
        "next-token logits (fp32)": vocab_fp32,
        "log_softmax and beam scores (fp32)": 2 * vocab_fp32,
    }


def _beam_reorder_phase(r: Run, walk: CacheWalk, step: Step) -> dict | None:
    """The beam reorder after the forward, beside the logits and the beam scores. The tuple under v4.40 copies the
    whole cache while `outputs` holds the un-reordered one; the other designs copy one tensor at a time, the old
    one freed before the next is copied: the largest tensor is the transient."""
    if r.strategy != "beam":
        return None
    s, after = r.s, step.after
    if r.tuple_cache and r.keeps_outputs:
        terms = {"un-reordered tuple (held by outputs)": s.kv(after), "reordered tuple": s.kv(after)}
    elif walk.layers is not None:
        terms = {"cache": step.held_after, "one reordered tensor": walk.layers.reorder(s.t) - step.held_after}
    else:
        largest = {"static": max(r.static_windows or [r.static_len]), "list": after - (step.chunks - 1)}.get(
            r.cache, after
        )  # list: its largest chunk
        largest = max(walk.buffers.storage) if walk.buffers else largest  # prealloc: its largest buffer
        terms = {"cache": step.held_after, "one reordered tensor": s.t * largest}
    if r.keeps_outputs:
        terms["logits kept (v4.40)"] = s.rows * step.fed * s.vocab * FP32
    else:
        terms["next-token logits (fp32)"] = s.rows * s.vocab * FP32
    terms["beam scores (fp32)"] = s.rows * s.vocab * FP32
    return terms


def _mask_phase(r: PlannedRun, step: DesignStep) -> dict | None:
    """Before the first layer (SDPA past a sliding window): masking_utils.sdpa_mask builds the mask from the window
    and causal conditions (one bool of fed x keys each, then their intersection), then intersects it with the
    padding mask, one row per sequence. On a long prompt this is the forward's peak, with nothing but the
    embeddings beside it (and the cache from before the forward)."""
    if not step.mask:
        return None
    s, fed, seen = r.s, step.fed, step.seen
    return {
        "cache before the forward": 0 if r.tuple_cache else step.held_before,
        "old tuple still referenced": step.old_tuple,
        "embeddings": s.rows * fed * s.hidden * s.e,
        "sliding-window mask being built (bool)": max(3, 1 + r.mask_rows) * fed * seen,
        "query and key positions (int64)": (fed + seen) * INT64,
    }


# kvlab.theory's phases in their order, with the planner's update and MLP, the mask built before the first layer
# (after the last layer's attention: the order ties are broken in) and beam scoring (beam reorder comes last:
# `_phases`); eager attention (GPT-OSS) has no rotary phase of its own walked (it rotates halves; its attention
# peaks later), no output projection or mask phase of SDPA's.
PLANNER_PHASES = {
    "rotary": PHASES["rotary"],
    "update": _update_phase,
    "attention": PHASES["attention"],
    "output projection": PHASES["output projection"],
    "mask": _mask_phase,
    "mlp": _mlp_phase,
    "lm_head": PHASES["lm_head"],
    "next-token logits": PHASES["next-token logits"],
    "beam scoring": _beam_scoring_phase,
}
EAGER_PHASES = {
    **PLANNER_PHASES,
    **dict.fromkeys(("rotary", "output projection", "mask"), lambda r, step: None),
    "attention": _eager_attention_phase,
}


def _phases(r: Run, walk: CacheWalk, step: Step) -> dict:
    """The step's phases that happen, each its terms."""
    phases = {name: phase(r, step) for name, phase in (EAGER_PHASES if r.s.eager else PLANNER_PHASES).items()}
    phases["beam reorder"] = _beam_reorder_phase(r, walk, step)  # last: it moves a sliding layer to its view
    return {name: terms for name, terms in phases.items() if terms is not None}


def _held_through_the_step(r: Run, step: Step) -> dict:
    """kvlab.theory's, and 5.x's beam buffers and the tuples a caller still holds."""
    s, terms = r.s, held_through_the_step(r, step)
    if r.strategy == "beam" and r.release.major == 5:
        length, count = (r.prompt + r.new, r.new) if step.call == 0 else (r.max_len, r.restart_new)
        terms["5.x beam bookkeeping (sequences, beam indices)"] = 2 * s.rows * (length * INT64 + count * 4)
    if step.call == 1 and (r.restart_from == "tuples" or (r.tuple_cache and not step.first_of_call)):
        terms["tuple the caller still holds (restart)"] = s.kv(r.held_after_first)
    if r.tuple_cache and r.keeps_outputs and r.strategy == "beam" and step.before > 0:
        terms["un-reordered tuple held by outputs (beam, v4.40)"] = s.kv(step.before)
    return terms


def _previous_locals(r: Run, step: Step, phase: str) -> dict:
    """The loop's locals from the previous step, alive until rebound: through the forward, the next-token logits
    (v4.40's are a view into the kept outputs) and the probabilities or beam scores. Beam scoring has already
    rebound the logits and the scores, and the reorder comes after the scores too."""
    if step.first_of_call or phase == "beam reorder":
        return {}
    s, terms = r.s, {}
    if not r.keeps_outputs and phase != "beam scoring":
        terms["previous step's next-token logits (fp32)"] = s.rows * s.vocab * FP32
    if r.strategy == "sample" or (r.strategy == "beam" and phase != "beam scoring"):
        terms[f"previous step's {'beam scores' if r.strategy == 'beam' else 'probabilities'} (fp32)"] = (
            s.rows * s.vocab * FP32
        )
    return terms
