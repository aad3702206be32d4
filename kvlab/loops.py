"""One decoding loop, as three transformers releases ran it: greedy here; seeded sampling and beam search are
strategies of kvlab.decoding, which the loop runs through `Greedy`'s three methods.

A loop is what `generate()` kept alive between and inside steps; a cache design (kvlab.caches) is
where the keys and values live. Any loop runs with any design; the releases are:

- v4.40 (transformers <= 4.41): the previous step's `outputs` was only dropped when the next forward
  returned, and the next-token logits were a view into it, so the prompt's full-vocabulary logits lived
  into step 2 (and, in beam search, the un-reordered cache the forward returned);
- v4.42 (PR #30536 as released): `outputs` deleted and the last token's logits cloned every step, so a
  beam reorder frees each old tensor as its copy replaces it;
- v5 (transformers 5.x `generate()`): the same loop on today's forward.

The forward differs by major version. 4.x upcast the logits of every position to fp32 (the prompt's logits
exist twice, briefly, in step 1 in bf16) and ran SDPA on `repeat_kv` copies of a layer's keys and values
for grouped-query models. 5.x computes the last position's logits only (`logits_to_keep=1`), does not
upcast them, and passes `enable_gqa` instead; its beam search preallocates its sequences. The loop never
stops early (there is no EOS), so every run decodes exactly `new_tokens` steps.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .caches import CACHES, cache_length, cache_tensors, forward, make_cache
from .compat import cache_from_outputs, generate_drops_ones_mask
from .schema import LOOPS, Release, check_choice
from .schema import STRATEGIES as STRATEGIES  # lessons 04 and A6 import it from here


@dataclass
class Generation:
    tokens: torch.Tensor  # (batch * beams, prompt + new)
    cache: object  # what to continue from: the cache object (for `tuple`, the TupleCache of the last tuple)
    seconds: float  # wall time of the decoding loop


REPEAT_KV_ATTENTION = "kvlab_repeat_kv_sdpa"


REPEATS = "_kvlab_repeats"  # an attention module's repeat_kv copies, held until the module returns


def _repeat_kv_sdpa(module, query, key, value, attention_mask, **kwargs):
    groups = getattr(module, "num_key_value_groups", 1)
    # The copies are made here, so today's SDPA must not repeat (or pack) a second time. 4.x's attention forward
    # kept them as locals until it returned, through its output projection (whose matmul allocates scratch of
    # its own in bf16): held on the module until then (`_release_repeats`).
    repeats = repeat_kv(key, groups), repeat_kv(value, groups)
    setattr(module, REPEATS, repeats)
    module.num_key_value_groups = 1
    try:
        return sdpa_attention_forward(module, query, *repeats, attention_mask, **kwargs)
    finally:
        module.num_key_value_groups = groups


def _release_repeats(module, args, output):
    module.__dict__.pop(REPEATS, None)


AttentionInterface.register(REPEAT_KV_ATTENTION, _repeat_kv_sdpa)
AttentionMaskInterface.register(REPEAT_KV_ATTENTION, sdpa_mask)


@contextlib.contextmanager
def _forward_of(model, release: Release, meter=None):
    """Make the model's forward behave as in `release`; yields the forward's extra keyword arguments. `meter`:
    labels the 4.x forward's logits, so a peak inside the forward shows them."""
    if release.major == 5:
        yield {"logits_to_keep": 1}  # v5: the last position's logits only, not upcast
        return
    # 4.x: SDPA on repeat_kv copies, and every position's logits upcast to fp32 inside the forward, while the
    # final hidden states are alive (as `logits = self.lm_head(hidden_states).float()` was written then).
    config, before = model.config, model.config._attn_implementation
    if before == "sdpa":
        config._attn_implementation = REPEAT_KV_ATTENTION

    def upcast(module, args, logits):
        full = logits.float()
        if meter is not None:
            meter.label((logits, full), "logits")
        return full

    hooks = [model.get_output_embeddings().register_forward_hook(upcast)]
    hooks += [m.register_forward_hook(_release_repeats) for m in model.modules() if hasattr(m, "num_key_value_groups")]
    try:
        yield {}
    finally:
        config._attn_implementation = before
        for hook in hooks:
            hook.remove()


def generate(
    model,
    input_ids: torch.Tensor,
    new_tokens: int,
    *,
    cache="dynamic",
    loop: str = "v5",
    strategy="greedy",
    meter=None,
    cache_options: dict | None = None,
    prefill_chunk: int | None = None,
    step_forward=None,
) -> Generation:
    """Decode `new_tokens` tokens after `input_ids` as release `loop` did.

    model: a decoder in eval mode (`kvlab.models.build_model`).
    input_ids: (batch, prompt) token ids; in a restart, the `tokens` of the first call's Generation (for beam
        search, its batch x beams rows).
    new_tokens: how many tokens to decode, at least 1; no EOS stops the loop early.
    cache: the design of the cache the loop starts (`kvlab.caches.CACHES`), or a cache to continue from (the
        `cache` of an earlier Generation, or any transformers `Cache`).
    loop: the release whose `generate()` loop this is (`LOOPS`: v4.40, v4.42, v5).
    strategy: "greedy", or a strategy of kvlab.decoding (`Sampling`, `Beams`; `decoding` makes one from a
        strategy's name).
    meter: a `kvlab.meter.MemoryMeter` already entered, or None: it is told where each step ends and which
        tensors are cache and logits, so it can draw the timeline and split the peak.
    cache_options: keywords for `make_cache` (chunk_limit, block_tokens, max_cache_len) when the loop starts a cache.
    prefill_chunk: the prompt's forward in chunks of this many tokens, as generate()'s `prefill_chunk_size` (v5).
    step_forward: called instead of `kvlab.caches.forward` at each decoding step, as `step_forward(step, model,
        cache, **inputs)`, returning what it returns: (outputs, the cache to continue from). The planner's dry run
        (kvlab.planner.dry_run) uses it to grow the cache without a forward at the steps that cannot hold the peak.
    """
    strategy = GREEDY if strategy == "greedy" else strategy
    past = None if isinstance(cache, str) else cache
    cache = "dynamic" if past is not None else cache
    _check(cache, loop, strategy, new_tokens)
    if prefill_chunk is not None and (loop != "v5" or prefill_chunk < 1):
        raise ValueError("prefill_chunk: a positive number of tokens, under the v5 loop (prefill_chunk_size is 5.x's)")
    release, device = LOOPS[loop], input_ids.device
    tokens = strategy.rows(input_ids, past)
    kv = _start_cache(model, release, cache, tokens, new_tokens, past, cache_options)
    choose = strategy.choice(release, tokens, new_tokens)
    outputs = None
    # The loop counts the tokens fed so far: a cache of recurrent layers only has no length to ask.
    cached = 0 if past is None else cache_length(past)
    # 5.18 and later: the position ids made once from a mask of ones, which is then dropped; grown a token a step.
    positions = _generate_positions(tokens) if release.major == 5 and generate_drops_ones_mask() else None
    step_forward = step_forward or _every_step
    start = time.perf_counter()
    # no_grad, as generate() runs, so that a dispatch mode sees SDPA's own operators (the float copy of a bool mask,
    # the CPU flash kernel's outputs: the meter adds the kernel's scratch from their shapes); under an outer
    # inference_mode SDPA is one operator again.
    with torch.no_grad(), _forward_of(model, release, meter) as forward_options:
        kv, earlier, cached = _prefill_chunks(model, kv, tokens, cached, prefill_chunk, forward_options, positions)
        for step in range(new_tokens):
            # 4.x and 5.17, as generate() made them: a mask of ones, and position ids per row from its cumsum.
            # The forward gets a view of the new positions (so rotary cos/sin have a row per sequence too).
            mask = torch.ones(tokens.shape, dtype=torch.long, device=device) if positions is None else None
            step_positions = mask.cumsum(-1) - 1 if positions is None else positions
            new_outputs, handed_back = step_forward(
                step,
                model,
                kv,
                input_ids=tokens[:, cached:],
                position_ids=step_positions[:, cached:],
                use_cache=True,
                attention_mask=mask,  # on meta too: the planner's MetaAsCpu answers what transformers asks of it
                **forward_options,
            )
            if release.keeps_previous_outputs:
                # v4.40: the previous step's outputs die only now. Kept for their bytes: every fed position's
                # logits (the next-token logits are a view into them) and the cache object the forward returned.
                outputs = new_outputs
                next_logits = outputs.logits[:, -1, :]
            else:  # v4.42: outputs deleted, the last position's logits cloned
                next_logits = new_outputs.logits[:, -1, :].to(copy=True, dtype=torch.float32)
            kv = handed_back  # tuple: the caller's old tuple dies here, not before (other designs: the same object)
            del new_outputs, handed_back
            if step == 0:  # the chunked prefill's last outputs: generate() rebinds them after this forward
                del earlier
            if meter is not None:  # before a beam reorder replaces them within this step
                meter.label(cache_tensors(kv), "kv")
            # `next_logits` stays alive into the next step as a local of generate()'s loop does: it is rebound
            # only after the next forward has returned (and so do the choice's own, see `_Greedy`).
            tokens = choose(tokens, next_logits)
            strategy.reorder(kv, choose)
            del mask, step_positions
            cached = tokens.shape[1]
            tokens = torch.cat([tokens, choose.next_tokens[:, None]], dim=-1)
            positions = _grow_positions(positions, 1)
            if meter is not None:
                _end_step(meter, kv, outputs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return Generation(tokens, kv, time.perf_counter() - start)


def _every_step(step: int, model, cache, **inputs):
    """generate()'s own `step_forward`: the model's forward at every step."""
    return forward(model, cache, **inputs)


def _generate_positions(tokens) -> torch.Tensor:
    """The position ids generate() makes before the prompt (5.x): the cumsum of a mask of ones, less one, with the
    padded positions (none here) set to 0."""
    mask = torch.ones(tokens.shape, dtype=torch.long, device=tokens.device)
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def _grow_positions(positions, tokens: int):
    """generate()'s update of its kept position ids after `tokens` new tokens (5.x: a cat, the old ones freed)."""
    if positions is None:
        return None
    following = torch.arange(tokens, dtype=positions.dtype, device=positions.device)[None, :] + positions[:, -1:] + 1
    return torch.cat([positions, following], dim=-1)


def _prefill_chunks(model, kv, tokens, cached: int, chunk: int | None, forward_options: dict, positions=None):
    """generate()'s chunked prefill: every chunk of the prompt but the last through the model, each with the mask
    and positions up to its end (`positions`: the kept ones, without a mask, from 5.18); the last chunk is step
    0's forward. Returns the cache to continue from (`tuple` hands back a new one), the outputs of the chunk before
    the last (alive, as generate()'s `outputs`, until step 0's forward returns) and where step 0 starts."""
    starts = list(range(cached, tokens.shape[1], chunk or tokens.shape[1]))
    outputs = mask = None
    if len(starts) > 1 and positions is None:
        mask = torch.ones(tokens.shape, dtype=torch.long, device=tokens.device)
        positions = mask.cumsum(-1) - 1
    for start in starts[:-1]:
        end = start + chunk
        outputs, kv = forward(
            model,
            kv,
            input_ids=tokens[:, start:end],
            position_ids=positions[:, start:end],
            use_cache=True,
            attention_mask=None if mask is None else mask[:, :end],
            **forward_options,
        )
    return kv, outputs, starts[-1] if starts else cached


def _check(cache: str, loop: str, strategy, new_tokens: int) -> None:
    check_choice("cache", cache, CACHES)
    check_choice("loop", loop, LOOPS)
    if isinstance(strategy, str):
        raise ValueError(f"strategy {strategy!r}: kvlab.decoding.decoding({strategy!r}) makes its object")
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be positive, got {new_tokens}")


def _start_cache(model, release: Release, cache: str, tokens, new_tokens: int, past, cache_options: dict | None):
    """The cache the loop decodes into: `past` if given, else a new one of `cache`."""
    if past is not None:
        return past
    if cache == "dynamic" and release.major == 4:
        # 4.40.1's SDPA and eager attention masked a sliding window but grew the cache in full (only its
        # FlashAttention-2 path sliced it): a CatLayer on every attention layer. v5 gives sliding layers their form.
        return make_cache("dynamic", model, windowed=False)
    # As generate() sizes it: the last new token is never fed back, so it never enters the cache.
    return make_cache(cache, model, **{"max_cache_len": tokens.shape[1] + new_tokens - 1, **(cache_options or {})})


class Greedy:
    """generate()'s strategy: the rows it decodes (`rows`), the callable that picks each step's next tokens
    (`choice`) and what the cache does after the choice (`reorder`). kvlab.decoding's strategies are its
    subclasses."""

    name = "greedy"

    def rows(self, input_ids, past):
        """The token rows the loop decodes, from the prompt (or a restart's tokens and its cache `past`)."""
        return input_ids

    def choice(self, release: Release, tokens, new_tokens: int):
        return Choose()

    def reorder(self, kv, choose) -> None:
        pass


GREEDY = Greedy()


class Choose:
    """`choose(tokens, next_logits)` → the tokens (reordered in beam search); the next tokens are `.next_tokens`.

    A choice keeps what it computes as attributes, rebound at the next step's choice, because generate()'s loop
    kept them as locals: alive from one step's choice through the next step's forward, where they add to the
    peak."""

    def __call__(self, tokens, next_logits):
        self.next_tokens = next_logits.argmax(dim=-1)
        return tokens


def _end_step(meter, kv, outputs) -> None:
    """Label the cache (and v4.40's kept outputs: their cache and logits) and close the meter's step."""
    meter.label(cache_tensors(kv), "kv")
    if outputs is not None:
        meter.label(cache_tensors(cache_from_outputs(outputs)), "kv")
        meter.label(outputs.logits, "logits")
    meter.step()


def cache_batch(kv) -> int:
    tensors = cache_tensors(kv)
    return tensors[0].shape[0] if tensors else 0
