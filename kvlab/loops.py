"""One decoding loop for greedy, seeded sampling and beam search, as three transformers releases ran it.

A loop is what `generate()` kept alive between and inside steps; a cache design (kvlab.caches) is
where the keys and values live. Any loop runs with any design; the releases are:

- v4.40 (transformers <= 4.41): the forward upcast the logits of every position to fp32 and the
  next-token logits were a view into them; the previous step's `outputs` was only dropped when the
  next forward returned, so the prompt's full-vocabulary logits lived into step 2; beam search built
  a reordered tuple while `outputs` still held the old one.
- v4.42 (PR #30536 as released): `outputs` deleted and the last token's logits cloned every step;
  beams reordered layer by layer, each old layer freed before the next is copied. The forward still
  upcast every position's logits to fp32 (the prompt's logits exist twice, briefly, in step 1).
- v5 (transformers 5.x `generate()`): the forward computes the last position's logits only
  (`logits_to_keep=1`) and does not upcast them; `generate()` clones them to fp32.

v4.40 and v4.42 also ran SDPA on `repeat_kv` copies of a layer's keys and values for grouped-query
models (today's SDPA passes `enable_gqa` instead). The loop never stops early (there is no EOS), so
every run decodes exactly `new_tokens` steps.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .caches import TupleRoundTripCache, cache_length, cache_tensors, make_cache, num_layers
from .compat import cache_argument, cache_from_outputs



@dataclass(frozen=True)
class Loop:
    """What one release's `generate()` kept alive; see the module docstring."""

    name: str
    keeps_previous_outputs: bool  # the previous step's `outputs` (its logits, the old tuple) lives on
    upcasts_every_position: bool  # the forward returns fp32 logits for every fed position
    last_position_logits_only: bool  # `logits_to_keep=1`: no prompt logits at all
    repeats_kv: bool  # SDPA on repeat_kv copies for grouped-query models
    preallocates_beam_buffers: bool = False  # 5.x beam search: full-length sequences and beam indices


LOOPS = {
    "v4.40": Loop("v4.40", keeps_previous_outputs=True, upcasts_every_position=True, last_position_logits_only=False,
                  repeats_kv=True),
    "v4.42": Loop("v4.42", keeps_previous_outputs=False, upcasts_every_position=True, last_position_logits_only=False,
                  repeats_kv=True),
    "v5": Loop("v5", keeps_previous_outputs=False, upcasts_every_position=False, last_position_logits_only=True,
               repeats_kv=False, preallocates_beam_buffers=True),
}
RENAMED_PATTERNS = {"legacy": "v4.40", "fixed": "v4.42 or v5"}  # `pattern` before the fidelity issue
STRATEGIES = ("greedy", "sample", "beam")


@dataclass
class Generation:
    tokens: torch.Tensor  # (batch * beams, prompt + new)
    cache: object  # what to continue from: a Cache, or a tuple for the tuple design
    seconds: float  # wall time of the decoding loop


def check_choice(kind: str, value: str, choices) -> None:
    if kind == "loop" and value in RENAMED_PATTERNS:
        raise ValueError(f"the pattern {value!r} is now the loop {RENAMED_PATTERNS[value]!r}; "
                         f"choose one of: {', '.join(choices)}")
    if value not in choices:
        raise ValueError(f"unknown {kind} {value!r}; choose one of: {', '.join(choices)}")


REPEAT_KV_ATTENTION = "kvlab_repeat_kv_sdpa"


def _repeat_kv_sdpa(module, query, key, value, attention_mask, **kwargs):
    groups = getattr(module, "num_key_value_groups", 1)
    # The copies are made here, so today's SDPA must not repeat (or pack) a second time.
    module.num_key_value_groups = 1
    try:
        return sdpa_attention_forward(module, query, repeat_kv(key, groups), repeat_kv(value, groups),
                                      attention_mask, **kwargs)
    finally:
        module.num_key_value_groups = groups


AttentionInterface.register(REPEAT_KV_ATTENTION, _repeat_kv_sdpa)
AttentionMaskInterface.register(REPEAT_KV_ATTENTION, sdpa_mask)


@contextlib.contextmanager
def _release_forward(model, loop: Loop):
    """Make the model's forward behave as in release `loop`: the <= 4.42 SDPA path (with repeat_kv),
    and the fp32 upcast of every position's logits inside the forward, while the final hidden states
    are still alive (as `logits = self.lm_head(hidden_states).float()` was written then)."""
    config = model.config
    before = config._attn_implementation
    if loop.repeats_kv and before == "sdpa":
        config._attn_implementation = REPEAT_KV_ATTENTION
    hook = None
    if loop.upcasts_every_position:
        hook = model.get_output_embeddings().register_forward_hook(lambda module, args, logits: logits.float())
    try:
        yield
    finally:
        config._attn_implementation = before
        if hook is not None:
            hook.remove()


def _reorder_tuple_copy(past, beam_idx):
    # v4.40: a whole new tuple is built while the caller (and `outputs`) still hold the old one.
    return tuple((k.index_select(0, beam_idx), v.index_select(0, beam_idx)) for k, v in past)


def _reorder_layers_in_place(layers: list, beam_idx) -> None:
    """Reorder a list of (keys, values) pairs one tensor at a time; the caller must hold no other
    reference to the pairs, so each old tensor dies as its reordered copy replaces it."""
    for i in range(len(layers)):
        keys, values = layers[i]
        layers[i] = None  # the pair dies: the old tensors are held by these two names only
        keys = keys.index_select(0, beam_idx)  # the old keys die here
        values = values.index_select(0, beam_idx)
        layers[i] = (keys, values)


def generate(model, input_ids: torch.Tensor, new_tokens: int, *, cache: str = "dynamic", loop: str = "v5",
             strategy: str = "greedy", num_beams: int = 4, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, past=None, meter=None, cache_options: dict | None = None) -> Generation:
    """Decode `new_tokens` tokens after `input_ids` as release `loop` did; continue from `past` if given.

    `meter` (a `kvlab.meter.MemoryMeter`, already entered) is told where each step ends and which
    tensors are cache and logits, so it can draw the timeline and split the peak.
    """
    check_choice("loop", loop, LOOPS)
    check_choice("strategy", strategy, STRATEGIES)
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be positive, got {new_tokens}")
    release = LOOPS[loop]
    device = input_ids.device
    tokens = input_ids
    if strategy == "beam" and past is None:
        tokens = tokens.repeat_interleave(num_beams, dim=0)  # as generate() does, before the prompt
    batch = tokens.shape[0] // (num_beams if strategy == "beam" else 1)
    kv = past
    if kv is None:
        options = dict(cache_options or {})
        # As generate() sizes it: the last new token is never fed back, so it never enters the cache.
        options.setdefault("max_cache_len", tokens.shape[1] + new_tokens - 1)
        kv = make_cache(cache, model, **options)
    elif strategy == "beam" and tokens.shape[0] != cache_batch(kv):
        raise ValueError("a beam-search restart needs the tokens of the first call (batch * beams rows)")
    tuple_cache = cache == "tuple"
    argument = cache_argument(model)
    layers = num_layers(model)
    logits_to_keep = {"logits_to_keep": 1} if release.last_position_logits_only else {}

    generator = torch.Generator(device=device if device.type != "meta" else "cpu").manual_seed(seed)
    warpers = LogitsProcessorList()
    if strategy == "sample":
        if temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(temperature))
        if top_k > 0:
            warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p))
    beam_scores = None
    if strategy == "beam":
        # Only the first beam of each row is live at the start, so the beams do not all pick the same token.
        beam_scores = torch.zeros(batch, num_beams, device=device)
        beam_scores[:, 1:] = -1e9
        beam_scores = beam_scores.view(-1)
        if release.preallocates_beam_buffers:
            # 5.x's beam search preallocates running and finished sequences and their beam indices at full
            # length; kvlab never reads these, it only holds the same bytes for the whole loop.
            length = tokens.shape[1] + new_tokens
            beam_buffers = [torch.zeros(batch, num_beams, length, dtype=torch.long, device=device) for _ in "ab"]
            beam_buffers += [torch.zeros(batch, num_beams, new_tokens, dtype=torch.int32, device=device) for _ in "ab"]

    outputs = None
    start = time.perf_counter()
    with torch.inference_mode(), _release_forward(model, release):
        for _ in range(new_tokens):
            cached = cache_length(kv)
            seq_len = tokens.shape[1]
            step_cache = TupleRoundTripCache.from_tuples(kv, layers) if tuple_cache else kv
            # As generate() makes them: a mask of ones, and position ids per row from its cumsum, of which
            # the forward gets a view of the new positions (so rotary cos/sin have a row per sequence too).
            mask = torch.ones(tokens.shape[0], seq_len, dtype=torch.long, device=device)
            positions = mask.cumsum(-1) - 1
            new_outputs = model(
                input_ids=tokens[:, cached:],
                attention_mask=None if device.type == "meta" else mask,  # meta: no values to inspect
                position_ids=positions[:, cached:],
                use_cache=True,
                **logits_to_keep,
                **{argument: step_cache},
            )
            if release.keeps_previous_outputs:
                outputs = new_outputs  # the previous step's outputs die only now
                next_logits = outputs.logits[:, -1, :]  # a view: it keeps all of them alive
            else:
                next_logits = new_outputs.logits[:, -1, :].to(copy=True, dtype=torch.float32)
            if tuple_cache:
                kv = step_cache.to_tuples()  # the old tuple dies here, not before
            del step_cache, new_outputs
            if meter is not None:  # before a beam reorder replaces them within this step
                meter.label(cache_tensors(kv), "kv")

            if strategy == "greedy":
                next_tokens = next_logits.argmax(dim=-1)
            elif strategy == "sample":
                probs = warpers(tokens, next_logits).softmax(dim=-1)
                next_tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            else:
                vocab = next_logits.shape[-1]
                scores = next_logits.log_softmax(dim=-1) + beam_scores[:, None]
                top_scores, top_ids = scores.view(batch, -1).topk(num_beams, dim=1)
                beam_scores = top_scores.view(-1)
                source_beam = top_ids // vocab + torch.arange(batch, device=device)[:, None] * num_beams
                beam_idx, next_tokens = source_beam.view(-1), (top_ids % vocab).view(-1)
                tokens = tokens.index_select(0, beam_idx)
                if tuple_cache and release.keeps_previous_outputs:
                    kv = _reorder_tuple_copy(kv, beam_idx)
                elif tuple_cache:
                    pairs, kv = list(kv), None  # the list is now the only holder of each pair
                    _reorder_layers_in_place(pairs, beam_idx)
                    kv = tuple(pairs)
                    del pairs
                else:
                    kv.reorder_cache(beam_idx)
            # `next_logits` (and beam `scores`, sampling `probs`) stay alive into the next step, as the locals
            # of generate()'s loop do: each is rebound only after the next forward has returned.
            del mask, positions
            tokens = torch.cat([tokens, next_tokens[:, None]], dim=-1)

            if meter is not None:
                meter.label(cache_tensors(kv), "kv")
                if outputs is not None:
                    meter.label(cache_tensors(cache_from_outputs(outputs)), "kv")
                    meter.label(outputs.logits, "logits")
                meter.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    return Generation(tokens, kv, seconds)


def cache_batch(kv) -> int:
    tensors = cache_tensors(kv)
    return tensors[0].shape[0] if tensors else 0
