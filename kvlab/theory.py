"""The analytic peak: bytes above the weights for one point, term by term.

Nothing here is fitted to a measurement. Each decoding step is walked through its phases (cache
update at the last layer, the MLP, the lm_head, a beam reorder) and the bytes alive in each phase
are counted from shapes: the cache each design holds, the copies its update makes, the logits the
loop keeps, and the activations of one layer. The peak is the largest phase over all steps.

Units: t = bytes of one layer's keys (or values) for one token = rows x kv_heads x head_dim x dtype;
one token of the whole cache is 2 x layers x t.
"""

from __future__ import annotations

import math

from .loops import LOOPS
from .models import element_size, head_dim, kv_bytes_per_token

POINT_KEYS = ("cache", "loop", "strategy", "batch", "prompt", "new", "restart_new", "restart_from", "num_beams", "dtype",
              "chunk_limit", "block_tokens", "runtime")
INT64 = 8
FP32 = 4


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

    def kv(self, length: int) -> int:
        return self.token * length


def _held(s: Shape, cache: str, length: int, capacity_of, max_len: int) -> int:
    """Bytes the cache design holds for `length` tokens."""
    if cache == "static":
        return s.kv(max_len)
    if cache == "prealloc":
        return s.kv(capacity_of(length))
    return s.kv(length)


def _steps(prompt, new, restart_new):
    """(call, tokens fed, cache length before, after) for every forward of the run."""
    length, steps = 0, []
    for call, count in ((0, new), (1, restart_new)):
        for i in range(count):
            fed = prompt if (call == 0 and i == 0) else 1
            steps.append((call, fed, length, length + fed))
            length += fed
    return steps


def peak_phases(config, cache="dynamic", loop="v5", strategy="greedy", batch=8, prompt=64, new=512,
                restart_new=0, restart_from="cache", num_beams=4, dtype="float32", chunk_limit=50, block_tokens=32,
                runtime="eager"):
    """Every phase's bytes above the weights; returns (peak, the phase that makes it, its terms, final KV).

    `runtime` (kvlab.graphs): jit-trace is the tuple design under v5's loop (the caller holds the old
    tuple while the graph builds the new one); convert is the dynamic design plus the old tuple the
    caller holds while the copied cache object grows; export has phases of its own (`_exported_peak`).
    `restart_from="tuples"`: the second call's cache object starts from the first call's tensors, which the
    caller's tuples keep alive for the whole call.
    """
    s = Shape(config, batch, dtype, strategy, num_beams)
    if runtime == "export":
        return _exported_peak(s, prompt, new)
    release = LOOPS[loop]
    tuple_cache, keeps_outputs = cache == "tuple", release.keeps_previous_outputs
    max_len = prompt + new + restart_new
    static_len = max_len - 1  # as generate() sizes it: the last new token never enters the cache
    capacity_of = lambda n: math.ceil(n / block_tokens) * block_tokens  # noqa: E731
    groups = s.heads // s.kv_heads
    held_after_first = prompt + new - 1  # the caller's tuple during a restart
    chunks = 0
    best = (-1, None, None)
    prev_logits = 0  # v4.40: the previous step's outputs (fp32 logits of every fed position)

    for index, (call, fed, before, after) in enumerate(_steps(prompt, new, restart_new)):
        first_of_call = index == 0 or (call == 1 and before == held_after_first)
        persistent = {
            "tokens, attention mask and position ids (int64)": 3 * s.rows * after * INT64,
            "previous step's logits (v4.40)": prev_logits,
        }
        # The loop's locals from the previous step live through the forward, until they are rebound.
        previous = {}
        if not first_of_call:
            if not keeps_outputs:  # (v4.40's next-token logits are a view into the kept outputs)
                previous["previous step's next-token logits (fp32)"] = s.rows * s.vocab * FP32
            if strategy in ("beam", "sample"):
                previous[f"previous step's {'beam scores' if strategy == 'beam' else 'probabilities'} (fp32)"] = (
                    s.rows * s.vocab * FP32)
        if strategy == "beam" and release.major == 5:
            length, count = (prompt + new, new) if call == 0 else (prompt + new + restart_new, restart_new)
            persistent["5.x beam bookkeeping (sequences, beam indices)"] = 2 * s.rows * (length * INT64 + count * 4)
        if call == 1 and (restart_from == "tuples" or (tuple_cache and not first_of_call)):
            persistent["tuple the caller still holds (restart)"] = s.kv(held_after_first)
        if tuple_cache and keeps_outputs and strategy == "beam" and before > 0:
            persistent["un-reordered tuple held by outputs (beam, v4.40)"] = s.kv(before)
        old_tuple = s.kv(before) if tuple_cache or runtime == "convert" else 0
        held_after = _held(s, cache, after, capacity_of, static_len)
        # Alive in the last layer: the embeddings, the residual stream, the normed input, q, k, v and the
        # rotary cos/sin (one row per sequence, from the position ids). The model keeps `inputs_embeds`
        # referenced for its whole forward.
        hidden_states = 3 * s.rows * fed * s.hidden * s.e
        rotary = 2 * s.rows * fed * s.head_dim * s.e
        layer_acts = hidden_states + s.rows * fed * (s.heads + 2 * s.kv_heads) * s.head_dim * s.e + rotary

        # Phase: the last layer's cache update (its copies die before attention starts) ...
        base = {"cache after the update": held_after, "old tuple still referenced": old_tuple,
                "activations of one layer": layer_acts}
        update, attention = dict(base), dict(base)
        if cache == "dynamic" and before > 0 and not (call == 1 and first_of_call and restart_from == "tuples"):
            update["old values tensor during its cat"] = s.t * before  # (else the caller's tuple holds it)
        if cache == "list":
            chunks = 1 if index == 0 else chunks + 1
            if chunks >= chunk_limit:
                chunks = 1
                update["consolidation: old chunks during the cat"] = s.t * after
            elif chunks > 1:
                attention["keys and values concatenated for attention"] = 2 * s.t * after
        if cache == "prealloc" and before > 0 and capacity_of(after) > capacity_of(before):
            update["old values buffer during growth"] = s.t * capacity_of(before)
        # ... and its attention, which <= 4.42 ran on repeat_kv copies of the layer's keys and values.
        if release.major == 4 and groups > 1:
            attention["repeat_kv copies of one layer (<= 4.42 SDPA)"] = 2 * groups * s.t * (
                static_len if cache == "static" else after)
        phases = {"update": update, "attention": attention}

        # Phase: the MLP of the last layer (matters for the prompt only).
        phases["mlp"] = {"cache after the update": held_after, "old tuple still referenced": old_tuple,
                         "gate, up and their product": 3 * s.rows * fed * s.intermediate * s.e,
                         "embeddings, residual stream and normed input": hidden_states + s.rows * fed * s.hidden * s.e,
                         "rotary cos and sin": rotary}
        # Phase: the lm_head; <= 4.42 also upcast every fed position's logits to fp32 in the forward.
        kept = 1 if release.major == 5 else fed
        phases["lm_head"] = {"cache after the update": held_after, "old tuple still referenced": old_tuple,
                             "logits of the kept positions": s.rows * kept * s.vocab * s.e,
                             "fp32 upcast of every position's logits (<= 4.42)": s.rows * fed * s.vocab * FP32
                             if release.major == 4 and s.e != FP32 else 0,
                             "final hidden states": s.rows * fed * s.hidden * s.e}
        # Phase: beam reorder after the forward.
        if strategy == "beam":
            if tuple_cache and keeps_outputs:
                reorder = {"un-reordered tuple (held by outputs)": s.kv(after), "reordered tuple": s.kv(after)}
            else:  # one tensor at a time, the old one freed before the next is copied
                largest = {"prealloc": capacity_of(after), "static": static_len,
                           "list": after - (chunks - 1)}.get(cache, after)  # list: its largest chunk
                reorder = {"cache": held_after, "one reordered tensor": s.t * largest}
            reorder["logits kept (v4.40)" if keeps_outputs else "next-token logits (fp32)"] = (
                s.rows * fed * s.vocab * FP32 if keeps_outputs else s.rows * s.vocab * FP32)
            reorder["beam scores (fp32)"] = s.rows * s.vocab * FP32
            phases["beam reorder"] = reorder

        for name, terms in phases.items():
            terms = {**persistent, **(previous if name != "beam reorder" else {}), **terms}
            total = sum(terms.values())
            if total > best[0]:
                best = (total, f"step {index} ({'restart ' if call else ''}{name})", terms)
        prev_logits = s.rows * fed * s.vocab * FP32 if keeps_outputs else 0
    return best[0], best[1], best[2], s.kv(max_len)


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
            "attention": {"repeat_kv copies of one layer (masked SDPA)": copies,
                          "residual stream, q, k and v": residual + s.rows * fed * (s.heads + 2 * s.kv_heads)
                          * s.head_dim * s.e},
            "mlp": {"gate, up and their product": 3 * s.rows * fed * s.intermediate * s.e,
                    "residual stream": residual},
            "lm_head": {"logits of every fed position": s.rows * fed * s.vocab * s.e, "final hidden states": residual},
        }
        for name, terms in phases.items():
            terms = {**base, **terms}
            total = sum(terms.values())
            if total > best[0]:
                best = (total, f"step {index} ({name})", terms)
    return best[0], best[1], best[2], s.kv(prompt + new)


def predict_overhead(config, **point) -> int:
    """The predicted peak bytes above the weights for one point (see `peak_phases`)."""
    return int(peak_phases(config, **point)[0])


def explain(config, **point) -> dict:
    """The peak, where it happens and the terms that make it, for printing."""
    total, where, terms, kv_final = peak_phases(config, **point)
    return {"predicted_overhead_bytes": int(total), "kv_final_bytes": kv_final,
            "overhead_over_kv": round(total / kv_final, 4), "peak_at": where,
            "terms_bytes": {k: int(v) for k, v in terms.items() if v}}


def improvement_factors(config, batch=1, prompt=300, new=500, dtype="bfloat16"):
    """The PR's bounds on the v4.40 / v4.42 peak (tuple cache before, one dynamic cache after).

    Maximal: the cache dominates (many new tokens): v4.40's peak holds two caches, v4.42's one.
    Minimal: two new tokens, where v4.40's peak is at step 2 (2 x prompt cache + the leaked
    first-iteration logits) and v4.42's is bounded by the prompt's own forward.
    """
    point = dict(batch=batch, prompt=prompt, dtype=dtype)

    def ratio(n):
        return (predict_overhead(config, cache="tuple", loop="v4.40", new=n, **point)
                / predict_overhead(config, cache="dynamic", loop="v4.42", new=n, **point))

    return ratio(2), ratio(max(new, 16 * prompt))
