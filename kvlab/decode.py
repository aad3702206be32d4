"""One decoding loop: greedy, seeded sampling and beam search, in two reference patterns.

pattern="legacy" is what transformers <= 4.41 `generate()` kept alive between steps:
  - the forward upcast the logits of every position to fp32, and the next-token logits were a view
    into them; the previous step's `outputs` was only dropped when the next forward returned, so
    the prompt's full-vocabulary logits lived into step 2;
  - the cache travelled as a tuple that the loop held while the forward built the new one;
  - beam search reordered the tuple into a new tuple while `outputs` still held the old one;
  - SDPA attention materialized `repeat_kv` copies of a layer's keys and values for GQA models
    (today's SDPA path passes `enable_gqa` instead).
pattern="fixed" is what transformers PR #30536 (4.42) changed: clone the last token's logits and
delete `outputs` each step; reorder beams layer by layer so each old layer dies at once.

The loop never stops early (there is no EOS), so every run decodes exactly `new_tokens` steps.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .caches import LegacyTupleCache, cache_length, cache_tensors, make_cache, num_layers
from .compat import cache_argument, cache_from_outputs

PATTERNS = ("legacy", "fixed")
STRATEGIES = ("greedy", "sample", "beam")


@dataclass
class Generation:
    tokens: torch.Tensor  # (batch * beams, prompt + new)
    cache: object  # what to continue from: a Cache, or a tuple for the legacy cache
    seconds: float  # wall time of the decoding loop


def check_choice(kind: str, value: str, choices) -> None:
    if value not in choices:
        raise ValueError(f"unknown {kind} {value!r}; choose one of: {', '.join(choices)}")


LEGACY_ATTENTION = "kvlab_legacy_sdpa"


def _legacy_sdpa(module, query, key, value, attention_mask, **kwargs):
    groups = getattr(module, "num_key_value_groups", 1)
    # The copies are made here, so today's SDPA must not repeat (or pack) a second time.
    module.num_key_value_groups = 1
    try:
        return sdpa_attention_forward(module, query, repeat_kv(key, groups), repeat_kv(value, groups),
                                      attention_mask, **kwargs)
    finally:
        module.num_key_value_groups = groups


AttentionInterface.register(LEGACY_ATTENTION, _legacy_sdpa)
AttentionMaskInterface.register(LEGACY_ATTENTION, sdpa_mask)


@contextlib.contextmanager
def _attention(model, pattern: str):
    """Run the <= 4.41 SDPA path (with repeat_kv) for the legacy pattern, today's otherwise."""
    config = model.config
    before = config._attn_implementation
    if pattern == "legacy" and before == "sdpa":
        config._attn_implementation = LEGACY_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


def _legacy_reorder(past, beam_idx):
    # <= 4.41: a whole new tuple is built while the caller (and `outputs`) still hold the old one.
    return tuple((k.index_select(0, beam_idx), v.index_select(0, beam_idx)) for k, v in past)


def _reorder_layer_by_layer(past, beam_idx):
    # >= 4.42 for tuples: each layer is replaced, and the old layer freed, before the next is copied.
    layers = list(past)
    del past
    for i, (k, v) in enumerate(layers):
        layers[i] = None
        layers[i] = (k.index_select(0, beam_idx), v.index_select(0, beam_idx))
        del k, v
    return tuple(layers)


def generate(model, input_ids: torch.Tensor, new_tokens: int, *, cache: str = "inplace", pattern: str = "fixed",
             strategy: str = "greedy", num_beams: int = 4, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, past=None, meter=None, cache_options: dict | None = None) -> Generation:
    """Decode `new_tokens` tokens after `input_ids`; continue from `past` if given (a restart).

    `meter` (a `kvlab.memory.MemoryMeter`, already entered) is told where each step ends and which
    tensors are cache and logits, so it can draw the timeline and split the peak.
    """
    check_choice("pattern", pattern, PATTERNS)
    check_choice("strategy", strategy, STRATEGIES)
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be positive, got {new_tokens}")
    legacy = pattern == "legacy"
    device = input_ids.device
    tokens = input_ids
    if strategy == "beam" and past is None:
        tokens = tokens.repeat_interleave(num_beams, dim=0)  # as generate() does, before the prompt
    batch = tokens.shape[0] // (num_beams if strategy == "beam" else 1)
    kv = past
    if kv is None:
        options = dict(cache_options or {})
        options.setdefault("max_cache_len", tokens.shape[1] + new_tokens)
        kv = make_cache(cache, model, **options)
    elif strategy == "beam" and tokens.shape[0] != cache_batch(kv):
        raise ValueError("a beam-search restart needs the tokens of the first call (batch * beams rows)")
    tuple_cache = cache == "legacy"
    argument = cache_argument(model)
    layers = num_layers(model)

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

    outputs = None
    start = time.perf_counter()
    with torch.inference_mode(), _attention(model, pattern):
        for _ in range(new_tokens):
            cached = cache_length(kv)
            seq_len = tokens.shape[1]
            step_cache = LegacyTupleCache.from_legacy_cache(kv, layers) if tuple_cache else kv
            new_outputs = model(
                input_ids=tokens[:, cached:],
                # As generate() passes it; on meta there are no values to inspect, and no padding anyway.
                attention_mask=None if device.type == "meta" else torch.ones(
                    tokens.shape[0], seq_len, dtype=torch.long, device=device),
                position_ids=torch.arange(cached, seq_len, device=device).unsqueeze(0),
                use_cache=True,
                **{argument: step_cache},
            )
            if legacy:
                # <= 4.41: all positions upcast in the forward; last token's logits a view into them.
                new_outputs["logits"] = new_outputs.logits.float()
                outputs = new_outputs  # the previous step's outputs die only now
                next_logits = outputs.logits[:, -1, :]
            else:
                next_logits = new_outputs.logits[:, -1, :].to(copy=True, dtype=torch.float32)
            if tuple_cache:
                kv = step_cache.to_legacy_cache()  # the old tuple dies here, not before
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
                if tuple_cache:
                    kv = _legacy_reorder(kv, beam_idx) if legacy else _reorder_layer_by_layer(kv, beam_idx)
                else:
                    kv.reorder_cache(beam_idx)
            del next_logits
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
