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
# Decoders whose attention transformers runs only in eager PyTorch (GPT-OSS: its attention sinks have no SDPA path):
# scores, masks and repeat_kv copies are real tensors at every step.
EAGER_ATTENTION = ("gpt_oss",)


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

    def kv(self, length: int) -> int:
        return self.token * length


def windows(config) -> list:
    """Each layer's sliding window, None for a full-attention layer: as 5.x's `DynamicCache(config=...)` reads
    the config (`layer_types`, else `sliding_window`)."""
    from transformers.cache_utils import get_layer_types_and_kwargs
    types, options = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    if isinstance(options, dict):  # older 5.x (5.17): one kwargs dict for every layer, not a list per layer
        options = [options] * len(types)
    return [kw.get("sliding_window") if "sliding" in kind else None for kind, kw in zip(types, options)]


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
            self.kept[i] = self.storage[i] if window is None else min(self.storage[i], window - 1)

    def reorder(self, t: int) -> int:
        """The peak of a beam reorder, one tensor at a time (keys then values, layer by layer), in bytes."""
        total, peak = 2 * t * sum(self.storage), 0
        for i in range(len(self.storage)):
            for _ in "kv":
                peak = max(peak, total + t * self.kept[i])
                total += t * (self.kept[i] - self.storage[i])
            self.storage[i] = self.kept[i]
        return peak


class Buffers:
    """Token slots of each layer's buffers under kvlab's `prealloc` (kvlab.caches). A full layer (`PreallocLayer`)
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


def _held(s: Shape, cache: str, length: int, max_len: int) -> int:
    """Bytes the cache design holds for `length` tokens (prealloc's buffers: `Buffers`)."""
    return s.kv(max_len if cache == "static" else length)


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
    groups = s.heads // s.kv_heads
    # 5.x's dynamic cache on a sliding or hybrid config: each layer's storage walked step by step.
    sliding = windows(config) if cache == "dynamic" and release.major == 5 else [None] * s.layers
    layers = Layers(sliding) if any(sliding) else None
    buffers = Buffers(windows(config), block_tokens) if cache == "prealloc" else None
    static_windows = [min(w or static_len, static_len) for w in windows(config)] if cache == "static" else []
    static_windows = static_windows if any(w != static_len for w in static_windows) else []
    window = next((w for w in windows(config) if w), None)  # the sliding mask's (one for every sliding layer)
    last_window, has_full = windows(config)[-1], None in windows(config)
    # Gemma-3 computes rotary cos/sin once per layer type (its rope_parameters are keyed by layer type).
    rope = getattr(config, "rope_parameters", None) or {}
    rope_sets = len(rope) if rope and all(isinstance(v, dict) for v in rope.values()) else 1
    held_after_first = prompt + new - 1  # the caller's tuple during a restart
    chunks = held_before = 0
    best = (-1, None, None)
    prev_logits = 0  # v4.40: the previous step's outputs (fp32 logits of every fed position)

    for index, (call, fed, before, after) in enumerate(_steps(prompt, new, restart_new)):
        first_of_call = index == 0 or (call == 1 and before == held_after_first)
        persistent = {  # the prompt's ids exist before the first forward: only its mask and positions are new
            "tokens, attention mask and position ids (int64)": (3 - (index == 0)) * s.rows * after * INT64,
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
        held_after = _held(s, cache, after, static_len)
        if cache == "static" and static_windows:  # 5.x's StaticCache gives a sliding layer min(W, length) slots
            held_after = 2 * s.t * sum(static_windows)
        old_last, seen = before, after  # tokens of the last layer's values storage before its cat; keys attended
        if layers is not None:
            old_last = layers.storage[-1]
            layers.update(fed)
            held_after = 2 * s.t * sum(layers.storage)
            seen = layers.storage[sliding.index(window)] if window else after
        transient = 0  # prealloc: tokens of one layer's buffer copied aside during the update
        if buffers is not None:
            transient = buffers.update(fed, before)
            held_after = 2 * s.t * sum(buffers.storage)
            seen = min(before, window - 1) + fed if window else after  # a sliding layer reads its kept window + fed
        # SDPA's is_causal shortcut is off: a bool mask, alive until the decoder stack returns (before the lm_head).
        mask = {"sliding-window attention mask (bool)": s.rows * fed * seen} if window and seen >= window else {}
        full_seen = static_len if cache == "static" else after  # keys a full layer attends to
        keys = seen if last_window else full_seen  # ... and the last layer
        if s.eager:  # eager attention gets a mask of each layer type, in the model's dtype, at every step
            mask = {"attention masks (model dtype)": s.rows * fed * s.e * (
                full_seen * has_full + seen * (window is not None))}
        # Alive in the last layer: the embeddings, the residual stream, the normed input, q, k, v and the
        # rotary cos/sin (one row per sequence, from the position ids). The model keeps `inputs_embeds`
        # referenced for its whole forward.
        hidden_states = 3 * s.rows * fed * s.hidden * s.e
        rotary = 2 * s.rows * fed * s.head_dim * s.e * rope_sets
        layer_acts = hidden_states + s.rows * fed * (s.heads + 2 * s.kv_heads) * s.head_dim * s.e + rotary
        new_kv = 2 * s.t * fed  # the layer's new keys and values, dead once the cache returns its own tensors ...
        # ... except where prealloc's window buffer is too short for the feed: attention reads them as they came
        read_as_fed = buffers is not None and last_window and fed > last_window - 1 + block_tokens

        # Phase: the last layer's cache update (its copies die before attention starts) ...
        base = {"cache after the update": held_after, "old tuple still referenced": old_tuple,
                "activations of one layer": layer_acts, **mask}
        update, attention = dict(base), dict(base)
        attention["activations of one layer"] = layer_acts - (0 if read_as_fed else new_kv)
        if cache == "dynamic" and before > 0 and not (call == 1 and first_of_call and restart_from == "tuples"):
            update["old values tensor during its cat"] = s.t * old_last  # (else the caller's tuple holds it)
        if cache == "list":
            chunks = 1 if index == 0 else chunks + 1
            if chunks >= chunk_limit:
                chunks = 1
                update["consolidation: old chunks during the cat"] = s.t * after
            elif chunks > 1:
                attention["keys and values concatenated for attention"] = 2 * s.t * after
        if transient:
            update["old values buffer during growth, or a window's clone as it moves"] = s.t * transient
        # ... and its attention: SDPA's output beside its inputs, which are repeat_kv copies of the layer's keys and
        # values where transformers does not use SDPA's grouped-query path: always in <= 4.42; in 5.x when the layer
        # gets a mask and more than one query (a prompt past the window).
        if not s.eager:
            copies = groups > 1 and (release.major == 4 or (mask and fed > 1 and last_window))
            attention["repeat_kv copies of one layer (SDPA without its grouped-query path)"] = (
                2 * groups * s.t * keys if copies else 0)
            attention["attention output"] = s.rows * fed * s.heads * s.head_dim * s.e
        # Eager attention (GPT-OSS) peaks as it shifts the scores for the softmax: the masked scores, the scores with
        # one sink column, their shifted copy and the row maxima, beside repeat_kv copies of the keys and values.
        scores = s.rows * s.heads * fed * s.e  # one key's scores
        if s.eager:
            attention["eager attention: scores, with the sinks, shifted, and their maxima"] = scores * (3 * keys + 3)
            attention["repeat_kv copies of one layer"] = 2 * groups * s.t * keys if groups > 1 else 0
        phases = {"update": update, "attention": attention}
        # Phase: before the first layer, masking_utils.sdpa_mask builds that mask from the window and causal conditions
        # (one bool of fed x keys each, then their intersection), then intersects it with the padding mask, one row
        # per sequence: on a long prompt this is the forward's peak, with nothing but the embeddings beside it.
        if mask and not s.eager:
            phases["mask"] = {"cache before the forward": 0 if tuple_cache else held_before,
                              "old tuple still referenced": old_tuple, "embeddings": s.rows * fed * s.hidden * s.e,
                              "sliding-window mask being built (bool)": max(3, 1 + s.rows) * fed * seen,
                              "query and key positions (int64)": (fed + seen) * INT64}

        # Phase: the MLP of the last layer (matters for the prompt only).
        phases["mlp"] = {"cache after the update": held_after, "old tuple still referenced": old_tuple,
                         "gate, up and their product": 3 * s.rows * fed * s.intermediate * s.e,
                         "embeddings, residual stream and normed input": hidden_states + s.rows * fed * s.hidden * s.e,
                         "rotary cos and sin": rotary, **mask}
        if s.experts:  # GPT-OSS's experts (grouped_mm): each token's top-k (token, expert) pairs, sorted by expert
            pairs = s.rows * fed * s.top_k
            phases["mlp"].update({
                "gate, up and their product": 0,
                "experts: gate_up and its biases (2 x 2I); gate, up, glu, up + 1 and their product (5 x I)":
                    9 * pairs * s.intermediate * s.e,
                "experts: the hidden states gathered per pair": pairs * s.hidden * s.e,
                "router logits and scores; pair order, expert ids and weights": s.rows * fed * (
                    s.experts * s.e + s.top_k * (s.e + INT64)) + pairs * (s.e + FP32 + 2 * INT64),
                "attention probabilities the layer keeps (eager)": scores * (keys + 1) if s.eager else 0})
        # Phase: the lm_head; <= 4.42 also upcast every fed position's logits to fp32 in the forward.
        kept = 1 if release.major == 5 else fed
        phases["lm_head"] = {"cache after the update": held_after, "old tuple still referenced": old_tuple,
                             "logits of the kept positions": s.rows * kept * s.vocab * s.e,
                             "fp32 upcast of every position's logits (<= 4.42)": s.rows * fed * s.vocab * FP32
                             if release.major == 4 and s.e != FP32 else 0,
                             "final hidden states": s.rows * fed * s.hidden * s.e}
        # Phase: after the forward, v4.42 and v5 copy the last position's logits to fp32 while the forward's logits
        # and the previous step's copy are alive; beam search then scores them (log_softmax, plus the beam
        # scores: two more vocabulary-wide tensors) while the previous step's scores are alive.
        vocab_fp32 = s.rows * s.vocab * FP32
        if not keeps_outputs:
            phases["next-token logits"] = {
                "cache after the update": held_after, "old tuple still referenced": old_tuple,
                "forward's logits": s.rows * kept * s.vocab * (FP32 if release.major == 4 else s.e),
                "next-token logits (fp32)": vocab_fp32}
        if strategy == "beam" and not keeps_outputs:
            phases["beam scoring"] = {"cache after the update": held_after, "next-token logits (fp32)": vocab_fp32,
                                      "log_softmax and beam scores (fp32)": 2 * vocab_fp32}
        # Phase: beam reorder after the forward.
        if strategy == "beam":
            if tuple_cache and keeps_outputs:
                reorder = {"un-reordered tuple (held by outputs)": s.kv(after), "reordered tuple": s.kv(after)}
            else:  # one tensor at a time, the old one freed before the next is copied
                largest = {"static": max(static_windows or [static_len]),
                           "list": after - (chunks - 1)}.get(cache, after)  # list: its largest chunk
                largest = max(buffers.storage) if buffers else largest  # prealloc: its largest buffer
                reorder = {"cache": held_after, "one reordered tensor": s.t * largest}
                if layers is not None:
                    peak = layers.reorder(s.t)
                    reorder = {"cache": held_after, "one reordered tensor": peak - held_after}
            reorder["logits kept (v4.40)" if keeps_outputs else "next-token logits (fp32)"] = (
                s.rows * fed * s.vocab * FP32 if keeps_outputs else s.rows * s.vocab * FP32)
            reorder["beam scores (fp32)"] = s.rows * s.vocab * FP32
            phases["beam reorder"] = reorder

        for name, terms in phases.items():
            kept_previous = {"beam reorder": {}, "beam scoring": {k: v for k, v in previous.items() if "beam" in k}}
            terms = {**persistent, **kept_previous.get(name, previous), **terms}
            total = sum(terms.values())
            if total > best[0]:
                best = (total, f"step {index} ({'restart ' if call else ''}{name})", terms)
        prev_logits = s.rows * fed * s.vocab * FP32 if keeps_outputs else 0
        held_before = held_after
    # Tokens each layer's storage holds at the end (5.x sliding layers plateau at the window, the rest grow).
    held_tokens = list((layers or buffers).storage) if layers or buffers else static_windows or [
        static_len if cache == "static" else max_len - 1] * s.layers
    return best[0], best[1], best[2], s.kv(max_len), held_tokens


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
    return best[0], best[1], best[2], s.kv(prompt + new), [last] * s.layers


def predict_overhead(config, **point) -> int:
    """The predicted peak bytes above the weights for one point (see `peak_phases`)."""
    return int(peak_phases(config, **point)[0])


def tokens_per_layer(held: list) -> str:
    """`[4096] * 32` → "4096 x 32"; a hybrid layout lists each length with its count."""
    return " + ".join(f"{length} x {held.count(length)}" for length in sorted(set(held)))


def explain(config, **point) -> dict:
    """The peak, where it happens and the terms that make it, for printing."""
    total, where, terms, kv_final, held = peak_phases(config, **point)
    return {"predicted_overhead_bytes": int(total), "kv_final_bytes": kv_final,
            "cache_tokens_per_layer": tokens_per_layer(held),
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
