"""The analytic peak: bytes above the weights for one point, term by term.

Nothing here is fitted to a measurement. Each decoding step is walked through its phases (the rotary
embedding, cache update and attention of the last layer, the MLP, the lm_head, the next-token logits) and the
bytes alive in each phase are counted from shapes: the cache each design holds, the copies its update
makes, the logits the loop keeps, and the activations of one layer. The peak is the largest phase over all
steps.

How it reads: `peak_phases` walks a `Run` (what the point fixes) step by step; `CacheWalk` gives each forward's
`Step` (what the cache holds around it); each phase is a function of the two (`_rotary_phase` ...
`_next_token_phase`), and what lives through the whole step is added to each (`held_through_the_step`,
`_previous_locals`). `breakdown` is the peak's terms for printing. This is the lesson's walk: greedy decoding in
one generate() call of transformers' own designs (tuple, dynamic, static) with full attention, eager PyTorch, on
the CPU and meta. kvlab.planner.theory extends it through a richer `Run` (`PlannedRun`: its phases, what lives
through a step, what attention sits on, the GPU's SDPA kernel) and its `CacheWalk` (`DesignWalk`) to kvlab's own
designs (list, prealloc), beams, sampling, restarts, sliding windows (their masks, 5.x's sliding layers), GPT-OSS,
a CUDA GPU and kvlab.graphs' runtimes.

Units: t = bytes of one layer's keys (or values) for one token = rows x kv_heads x head_dim x dtype;
one token of the whole cache is 2 x layers x t.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .compat import generate_drops_ones_mask
from .counts import (
    element_size,
    final_kv_bytes,
    flash_scratch_bytes,
    head_dim,
    kv_bytes_per_token,
    sliding_windows,
)
from .schema import DEFAULTS, LOOPS, POINT_KEYS

INT64 = 8
FP32 = 4
# Decoders whose attention transformers runs only in eager PyTorch (GPT-OSS: its attention sinks have no SDPA path):
# scores, masks and repeat_kv copies are real tensors at every step.
# Decoders whose layers the walk goes through (attention with grouped KV heads, gated MLP; GPT-OSS's eager
# attention with sinks and its grouped_mm experts: kvlab.planner.theory); for any other model_type no prediction.
MODELED = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gpt_oss")
EAGER_ATTENTION = ("gpt_oss",)
# The designs this walk follows: transformers' own (kvlab.caches). kvlab's own, list and prealloc (kvlab.designs):
# kvlab.planner.theory.
WALKED = ("tuple", "dynamic", "static")


class Shape:
    """The sizes of one point that the byte counts need."""

    def __init__(self, config, batch, dtype, strategy="greedy", num_beams=4):
        self.rows = batch * (num_beams if strategy == "beam" else 1)
        self.e = element_size(dtype)
        self.layers = config.num_hidden_layers
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = head_dim(config)
        self.hidden = config.hidden_size
        self.intermediate = config.intermediate_size
        self.vocab = config.vocab_size
        self.token = kv_bytes_per_token(config, self.rows, dtype)
        self.t = self.token // (2 * self.layers)
        self.eager = config.model_type in EAGER_ATTENTION
        self.experts, self.top_k = getattr(config, "num_local_experts", 0), getattr(config, "num_experts_per_tok", 0)
        # Gemma-3 computes rotary cos/sin once per layer type (its rope_parameters are keyed by layer type).
        rope = getattr(config, "rope_parameters", None) or {}
        self.rope_sets = len(rope) if rope and all(isinstance(v, dict) for v in rope.values()) else 1

    def kv(self, length: int) -> int:
        return self.token * length


class Run:
    """What a point `p` (every key given: `design_point`) fixes for all its steps: the sizes, the release's loop,
    the design and the device (restarts, runtimes, sliding windows and kvlab's own designs' options:
    kvlab.planner.theory's `PlannedRun`)."""

    def __init__(self, config, p: dict, threads: int | None):
        self.s = s = Shape(config, p["batch"], p["dtype"], p["strategy"], p["num_beams"])
        self.release = release = LOOPS[p["loop"]]
        self.device = str(p["device"]).split(":")[0]  # cuda:1 -> cuda
        self.threads = threads  # a CPU's torch threads (flash's scratch)
        # The walk's rules, which kvlab.planner.theory's `PlannedRun` replaces: a step's phases (run, walk, step) ->
        # {phase: terms}, what lives through the step (run, step), the previous step's locals (run, step, phase),
        # what the last layer's attention sits on (run, step) and what SDPA allocates inside on a GPU (run, step,
        # masked, grouped; none here).
        self.phases, self.held, self.previous, self.inputs = (
            _phases,
            held_through_the_step,
            _previous_locals,
            attention_inputs,
        )
        self.gpu_kernel = None
        self.cache, self.strategy, self.prompt, self.new = p["cache"], p["strategy"], p["prompt"], p["new"]
        self.tuple_cache, self.keeps_outputs = self.cache == "tuple", release.keeps_previous_outputs
        self.max_len = self.prompt + self.new
        self.static_len = self.max_len - 1  # as generate() sizes it: the last new token never enters the cache
        self.groups = s.heads // s.kv_heads
        # 5.18+ generate() drops the all-ones padding mask: the masks it builds then have one row for every sequence.
        self.passes_mask = not (release.major == 5 and generate_drops_ones_mask())


@dataclass
class Step:
    """One forward of the run and the state its phases read: the tokens it feeds, what the cache holds around
    its last layer's update, and the keys that layer attends to."""

    index: int
    fed: int  # tokens fed to this forward
    before: int  # cache length before it ...
    after: int  # ... and after it
    previous_fed: int  # tokens fed to the previous forward (v4.40 keeps their logits)
    held_before: int  # bytes the cache held before this forward
    held_after: int  # ... and after the last layer's update
    old_tuple: int  # bytes of the caller's old tuple, referenced while the new one grows (tuple)
    old_last: int  # tokens of the last layer's values storage before its cat
    keys: int  # keys the last layer attends to
    last_growth: int  # tokens the last layer's storage grows by in its update (after its rotary embedding)
    # The attention mask the forward builds, alive until the decoder stack returns, and whether the last layer's
    # SDPA gets it: none under full attention, where SDPA's is_causal shortcut needs none (a sliding window's:
    # kvlab.planner.theory).
    mask: dict = field(default_factory=dict)
    masked: bool = False

    def where(self, phase: str) -> str:
        """The step and phase, as `largest_phase` names the peak."""
        return f"step {self.index} ({phase})"


class CacheWalk:
    """The design's storage, forward by forward, from the cache length (kvlab.planner.theory's `DesignWalk`: kvlab's
    own designs, a restart's second call and 5.x's sliding layers)."""

    def __init__(self, run: Run):
        self.run = run
        self.held = self.fed = 0  # bytes held and tokens fed as of the last step

    def steps(self):
        """A `Step` for every forward of the run, the cache updated to it."""
        for index, (fed, before, after) in enumerate(call_steps(self.run.prompt, self.run.new)):
            yield self._advance(index, fed, before, after)

    def _advance(self, index: int, fed: int, before: int, after: int) -> Step:
        r = self.run
        held_after, old_last, last_growth = self._storage(index, fed, before, after)
        step = Step(
            index,
            fed,
            before,
            after,
            previous_fed=self.fed,
            held_before=self.held,
            held_after=held_after,
            old_tuple=r.s.kv(before) if r.tuple_cache else 0,
            old_last=old_last,
            keys=r.static_len if r.cache == "static" else after,
            last_growth=last_growth,
        )
        self.held, self.fed = held_after, fed
        return step

    def _storage(self, index: int, fed: int, before: int, after: int) -> tuple:
        """The cache updated by one forward: (bytes it holds after, tokens of the last layer's values storage before
        its cat, tokens the last layer's storage grows by in its update)."""
        r = self.run
        if r.cache == "static":  # each layer allocates its whole buffers at its first update
            return r.s.kv(r.static_len), before, r.static_len if index == 0 else 0
        return r.s.kv(after), before, fed

    def held_tokens(self) -> list:
        """Tokens each layer's storage holds at the end."""
        r = self.run
        return [r.static_len if r.cache == "static" else r.max_len - 1] * r.s.layers


def call_steps(prompt: int, new: int) -> list:
    """(tokens fed, cache length before, after) for every forward of one generate() call: the prompt, then one
    token a step."""
    return [(prompt if i == 0 else 1, 0 if i == 0 else prompt + i - 1, prompt + i) for i in range(new)]


def _hidden_states(s: Shape, fed: int) -> int:
    """The embeddings (the model keeps `inputs_embeds` referenced for its whole forward), the residual stream and
    the normed input."""
    return 3 * s.rows * fed * s.hidden * s.e


def _rotary(s: Shape, fed: int) -> int:
    """Rotary cos and sin: one row per sequence (from the position ids), one pair per rope set."""
    return 2 * s.rows * fed * s.head_dim * s.e * s.rope_sets


def _layer_activations(s: Shape, fed: int) -> int:
    """Alive in the last layer as attention runs: the hidden states, q, k, v and the rotary cos/sin."""
    return _hidden_states(s, fed) + s.rows * fed * (s.heads + 2 * s.kv_heads) * s.head_dim * s.e + _rotary(s, fed)


def _around_the_layer(step: Step) -> dict:
    """What every phase inside the forward sits on: the cache after the update and the caller's old tuple."""
    return {"cache after the update": step.held_after, "old tuple still referenced": step.old_tuple}


def _rotary_phase(r: Run, step: Step) -> dict | None:
    """The last layer's rotary embedding, before its cache update: `q * cos + rotate_half(q) * sin` holds, beside q,
    its product with cos, its rotated copy and that copy's product with sin; then the same for k, beside q's result.
    It peaks where the query is wide (heads x head_dim above the hidden size)."""
    s, fed = r.s, step.fed
    q, k = (s.rows * fed * heads * s.head_dim * s.e for heads in (s.heads, s.kv_heads))
    return {
        "cache before the last layer's update": step.held_after - 2 * s.t * step.last_growth,
        "old tuple still referenced": step.old_tuple,
        "activations of one layer": _layer_activations(s, fed),
        "rotary embedding: x * cos, rotate_half(x), its product with sin (x = q, or k beside q's result)": max(
            3 * q, q + 3 * k
        ),
        **step.mask,
    }


def _update_phase(r: Run, step: Step) -> dict:
    """The last layer's cache update: the copies the design makes as it writes the new tokens (they die before
    attention starts), beside the layer's activations (its new keys and values among them)."""
    terms = {**_around_the_layer(step), "activations of one layer": _layer_activations(r.s, step.fed), **step.mask}
    if r.cache == "dynamic" and step.before > 0:
        terms["old values tensor during its cat"] = r.s.t * step.old_last
    return terms


def attention_inputs(r: Run, step: Step) -> dict:
    """What the last layer's attention sits on. The layer's new keys and values are dead once the cache returns its
    own tensors."""
    s, fed = r.s, step.fed
    new_kv = 2 * s.t * fed
    return {**_around_the_layer(step), "activations of one layer": _layer_activations(s, fed) - new_kv, **step.mask}


def _attention_phase(r: Run, step: Step) -> dict:
    """The last layer's attention: SDPA's output beside its inputs, which are repeat_kv copies of the layer's keys
    and values where transformers does not use SDPA's grouped-query path: always in <= 4.42; in 5.x when the layer
    gets a mask (`Step.masked`: a prompt past a sliding window)."""
    s, fed, masked = r.s, step.fed, step.masked
    terms = r.inputs(r, step)
    copies = r.groups > 1 and (r.release.major == 4 or masked)
    terms["repeat_kv copies of one layer (SDPA without its grouped-query path)"] = (
        2 * r.groups * s.t * step.keys if copies else 0
    )
    terms["attention output"] = s.rows * fed * s.heads * s.head_dim * s.e
    terms.update(_inside_sdpa(r, step, masked, grouped=r.groups > 1 and not copies))
    return terms


def _output_projection_phase(r: Run, step: Step) -> dict | None:
    """<= 4.42: the last layer's output projection. Its attention forward kept the repeat_kv copies of the keys and
    values as locals until it returned: alive beside the attention output and the projection's output, as
    everything attention held but what SDPA frees as it returns (5.x makes and drops the copies inside its
    attention function, before the projection)."""
    if r.release.major != 4 or r.groups == 1:
        return None
    inside_sdpa = _inside_sdpa(r, step, masked=False, grouped=False)
    terms = {name: value for name, value in _attention_phase(r, step).items() if name not in inside_sdpa}
    return {**terms, "output projection": r.s.rows * step.fed * r.s.hidden * r.s.e}


def _inside_sdpa(r: Run, step: Step, masked: bool, grouped: bool) -> dict:
    """What the SDPA call allocates inside, beside its output, on the device the point runs on: a CPU's flash kernel
    (`_cpu_flash_attention`), the kernel a GPU picks (`Run.gpu_kernel`), nothing on meta (one op)."""
    if r.device == "cpu":
        return _cpu_flash_attention(r, step, masked)
    return r.gpu_kernel(r, step, masked, grouped) if r.gpu_kernel else {}


def _cpu_flash_attention(r: Run, step: Step, masked: bool) -> dict:
    """What SDPA allocates inside on CPU, where it runs the flash kernel (grouped-query or not): a float copy of the
    bool mask it is given, its logsumexp (fp32 per row, head and query) and the scratch the kernel frees before it
    returns (`kvlab.counts.flash_scratch_bytes`: a block of scores per thread, for the point's `threads`, by default
    this process's torch threads)."""
    s, fed = r.s, step.fed
    return {
        "SDPA: float copy of the mask": s.rows * fed * step.keys * s.e if masked else 0,
        "SDPA: logsumexp (fp32)": s.rows * s.heads * fed * FP32,
        "SDPA: flash kernel's scratch, a block per thread": flash_scratch_bytes(
            fed, step.keys, s.head_dim, s.e == 2, r.threads
        ),
    }


def _mlp_phase(r: Run, step: Step) -> dict:
    """The MLP of the last layer (it matters for the prompt only): gate, up and their product beside the hidden
    states."""
    s, fed = r.s, step.fed
    return {
        **_around_the_layer(step),
        "gate, up and their product": 3 * s.rows * fed * s.intermediate * s.e,
        "embeddings, residual stream and normed input": _hidden_states(s, fed) + s.rows * fed * s.hidden * s.e,
        "rotary cos and sin": _rotary(s, fed),
        **step.mask,
    }


def _kept_positions(r: Run, step: Step) -> int:
    """Positions whose logits the forward computes: the last only in 5.x (`logits_to_keep=1`), every fed one
    before."""
    return 1 if r.release.major == 5 else step.fed


def _lm_head_phase(r: Run, step: Step) -> dict:
    """The lm_head: the kept positions' logits beside the final hidden states; <= 4.42 also upcast every fed
    position's logits to fp32 inside the forward."""
    s, fed = r.s, step.fed
    return {
        **_around_the_layer(step),
        "logits of the kept positions": s.rows * _kept_positions(r, step) * s.vocab * s.e,
        "fp32 upcast of every position's logits (<= 4.44)": s.rows * fed * s.vocab * FP32
        if r.release.major == 4 and s.e != FP32
        else 0,
        "final hidden states": s.rows * fed * s.hidden * s.e,
    }


def _next_token_phase(r: Run, step: Step) -> dict | None:
    """After the forward, v4.42 and v5 copy the last position's logits to fp32 while the forward's logits (and the
    previous step's copy) are alive. v4.40 makes no copy: its next-token logits are a view into the outputs."""
    if r.keeps_outputs:
        return None
    s = r.s
    return {
        **_around_the_layer(step),
        "forward's logits": s.rows * _kept_positions(r, step) * s.vocab * (FP32 if r.release.major == 4 else s.e),
        "next-token logits (fp32)": s.rows * s.vocab * FP32,
    }


# The step's phases in the order they happen: the last layer's rotary embedding, its update, its attention and
# (<= 4.42) output projection, the MLP, the lm_head, then the loop's own work after the forward (a sliding window's
# mask, built before the first layer: kvlab.planner.theory). Each is a function of the run and the step; None where
# the step has no such phase.
PHASES = {
    "rotary": _rotary_phase,
    "update": _update_phase,
    "attention": _attention_phase,
    "output projection": _output_projection_phase,
    "mlp": _mlp_phase,
    "lm_head": _lm_head_phase,
    "next-token logits": _next_token_phase,
}


def _phases(r: Run, walk: CacheWalk, step: Step) -> dict:
    """The step's phases (`PHASES`) that happen, each its terms."""
    phases = {name: phase(r, step) for name, phase in PHASES.items()}
    return {name: terms for name, terms in phases.items() if terms is not None}


def held_through_the_step(r: Run, step: Step) -> dict:
    """What lives through every phase of the step: the loop's token ids, mask and positions (the prompt's ids exist
    before the first forward: only its mask and positions are new; 5.18+ generate(), and kvlab's v5 loop with it,
    passes no mask of ones) and v4.40's previous outputs (the fp32 logits of every fed position)."""
    s = r.s
    int64s = 2 + r.passes_mask - (step.index == 0)
    return {
        "tokens, attention mask and position ids (int64)": int64s * s.rows * step.after * INT64,
        "previous step's logits (v4.40)": (s.rows * step.previous_fed * s.vocab * FP32 if r.keeps_outputs else 0),
    }


def _previous_locals(r: Run, step: Step, phase: str) -> dict:
    """The loop's locals from the previous step, alive through the forward until rebound: the next-token logits
    (v4.40's are a view into the kept outputs)."""
    if step.index == 0 or r.keeps_outputs:
        return {}
    return {"previous step's next-token logits (fp32)": r.s.rows * r.s.vocab * FP32}


def peak_phases(config, threads: int | None = None, **point):
    """Every phase's bytes above the weights; returns (peak, the phase that makes it, its terms, final KV, tokens
    each layer's storage holds at the end).

    `device`: where the point runs, the CPU or meta (a CUDA GPU: kvlab.planner.theory); on CPU the attention phase
    holds what SDPA's flash kernel allocates inside (a block per thread: `threads`, by default this process's torch
    threads).
    `point`: the keys of kvlab.schema.POINT_KEYS, each defaulting to kvlab.schema.DEFAULTS' (device: cpu).
    """
    p, r = lesson_run(config, point, threads)
    walk = CacheWalk(r)
    kv_final = final_kv_bytes(config, r.s.rows, r.max_len, p["dtype"])
    return (*largest_phase(walk_phases(r, walk)), kv_final, walk.held_tokens())


def lesson_run(config, point: dict, threads: int | None) -> tuple[dict, Run]:
    """The point (`design_point`) and its `Run`, refusing what this walk leaves to kvlab.planner.theory."""
    p = design_point(point)
    r = Run(config, p, threads)
    beyond = {
        f"kvlab's own cache design {r.cache} (kvlab.designs)": r.cache not in WALKED,
        "a CUDA GPU": r.device == "cuda",
        f"the {p['runtime']} runtime (kvlab.graphs)": p["runtime"] != "eager",
        f"{r.strategy} decoding": r.strategy != "greedy",
        "a restart (restart_new)": p["restart_new"] > 0,
        "sliding-window attention": any(sliding_windows(config)),
        f"{config.model_type}'s eager attention and experts": r.s.eager or r.s.experts,
    }
    if what := next((what for what, applies in beyond.items() if applies), None):
        raise ValueError(
            f"kvlab.theory walks the lesson's points (greedy, one call, full attention, CPU, meta); {what}: "
            "kvlab.planner.theory"
        )
    return p, r


def largest_phase(phases) -> tuple:
    """(peak, where, terms) of the largest of `phases`: (step, phase, terms) as `walk_phases` yields them."""
    best = (-1, None, None)
    for step, name, terms in phases:
        total = sum(terms.values())
        if total > best[0]:
            best = (total, step.where(name), terms)
    return best


def walk_phases(r: Run, walk: CacheWalk):
    """(step, phase, its terms with what lives through the step) for every phase of every step, in order."""
    for step in walk.steps():
        held = r.held(r, step)
        for name, terms in r.phases(r, walk, step).items():
            yield step, name, {**held, **r.previous(r, step, name), **terms}


def design_point(point: dict) -> dict:
    """Every key of a design point (kvlab.schema.POINT_KEYS): the given ones, the others DEFAULTS'; the device, where
    not given, a CPU (the theory predicts for a named device, not for "auto"). An unknown key is refused."""
    if unknown := set(point) - set(POINT_KEYS):
        raise TypeError(f"unknown point keys {sorted(unknown)}; a point has: {', '.join(POINT_KEYS)}")
    return {**{key: DEFAULTS[key] for key in POINT_KEYS}, "device": "cpu", **point}


def predict_overhead(config, threads: int | None = None, **point) -> int:
    """The predicted peak bytes above the weights for one point (see `peak_phases`)."""
    return int(peak_phases(config, threads, **point)[0])


def tokens_per_layer(held: list) -> str:
    """`[4096] * 32` → "4096 x 32"; a hybrid layout lists each length with its count."""
    return " + ".join(f"{length} x {held.count(length)}" for length in sorted(set(held)))


def breakdown(config, threads: int | None = None, **point) -> dict:
    """The peak, where it happens and the terms that make it, for printing."""
    return explained(*peak_phases(config, threads, **point))


def explained(total: int, where: str, terms: dict, kv_final: int, held: list, reserved: int | None = None) -> dict:
    """`peak_phases`' answer as `breakdown` prints it (`reserved`: what a GPU's allocator reserves, if known)."""
    return {
        "predicted_overhead_bytes": int(total),
        **({"reserved_estimate_bytes": reserved} if reserved is not None else {}),
        "kv_final_bytes": kv_final,
        "cache_tokens_per_layer": tokens_per_layer(held),
        "overhead_over_kv": round(total / kv_final, 4),
        "peak_at": where,
        "terms_bytes": {k: int(v) for k, v in terms.items() if v},
    }


def improvement_factors(config, batch=1, prompt=300, new=None, dtype="bfloat16", predict=predict_overhead):
    """The PR's bounds on the v4.40 / v4.42 peak (tuple cache before, one dynamic cache after).

    Minimal: two new tokens, where v4.40's peak is at step 2 (2 x prompt cache + the leaked first-iteration logits)
    and v4.42's is bounded by the prompt's own forward. Maximal: at `new` tokens, or, not given, where the cache
    dominates (16 x the prompt's tokens), v4.40's peak holding two caches and v4.42's one. `predict`: this walk's
    `predict_overhead`, or kvlab.planner.theory's for a config beyond it (a sliding window: Mistral-7B v0.1).
    """
    point = dict(batch=batch, prompt=prompt, dtype=dtype)

    def ratio(n):
        return predict(config, cache="tuple", loop="v4.40", new=n, **point) / predict(
            config, cache="dynamic", loop="v4.42", new=n, **point
        )

    return ratio(2), ratio(16 * prompt if new is None else new)
