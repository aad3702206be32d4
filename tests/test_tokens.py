"""Every cache design, under every release's loop, decodes exactly what transformers' own generate() does."""

import pytest
import torch

import kvlab.designs  # noqa: F401 (registers kvlab's own designs, list and prealloc, with make_cache)
from kvlab.caches import CACHES, make_cache
from kvlab.compat import cache_argument
from kvlab.decoding import Beams, Sampling
from kvlab.loops import LOOPS, generate
from kvlab.models import assert_varied, build_model


def reference(model, prompt, new, **kwargs):
    """transformers' own generate(), its generated tokens checked for variety first (assert_varied)."""
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        **kwargs,
    )
    assert_varied(out[:, prompt.shape[1] :])
    return out


def test_the_variety_check_fails_on_a_degenerate_model(prompt):
    # transformers' default init (std 0.02) decodes a token or two over and over, greedy and beam alike.
    degenerate = build_model("toy", "initializer_range=0.02")
    for options in (dict(), dict(num_beams=4)):
        with pytest.raises(AssertionError, match="degenerate output"):
            reference(degenerate, prompt, 24, **options)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("cache", CACHES)
def test_greedy_matches_generate(toy, prompt, cache, loop):
    expected = reference(toy, prompt, 40)
    assert torch.equal(generate(toy, prompt, 40, cache=cache, loop=loop).tokens, expected)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("cache", CACHES)
def test_greedy_matches_generate_with_grouped_query_attention(toy_gqa, prompt, cache, loop):
    expected = reference(toy_gqa, prompt, 12)
    assert torch.equal(generate(toy_gqa, prompt, 12, cache=cache, loop=loop).tokens, expected)


@pytest.mark.parametrize("cache", CACHES)
def test_greedy_matches_generate_in_bfloat16(toy_bf16, prompt, cache):
    # bf16 logits: v5 never upcasts them in the forward, v4.42 does; the argmax must not change. A static cache
    # attends over its whole padded length, which rounds differently in bf16: transformers' own static generate()
    # departs from its dynamic one here, and the static design is held to the former.
    expected = reference(toy_bf16, prompt, 16, **({"cache_implementation": "static"} if cache == "static" else {}))
    for loop in LOOPS:
        assert torch.equal(generate(toy_bf16, prompt, 16, cache=cache, loop=loop).tokens, expected), loop


def test_list_cache_consolidates_without_changing_tokens(toy, prompt):
    expected = reference(toy, prompt, 30)
    out = generate(toy, prompt, 30, cache="list", cache_options={"chunk_limit": 4})
    assert torch.equal(out.tokens, expected)
    assert all(len(layer.key_chunks) < 4 for layer in out.cache.layers)


def test_prealloc_grows_in_blocks(toy, prompt):
    out = generate(toy, prompt, 30, cache="prealloc", cache_options={"block_tokens": 16})
    layer = out.cache.layers[0]
    assert layer.length == 12 + 30 - 1
    assert layer.key_buffer.shape[-2] == 48  # rounded up to a block of 16
    assert layer.keys.data_ptr() == layer.key_buffer.data_ptr()  # attention gets a view, not a copy


@pytest.mark.parametrize("cache", CACHES)
def test_best_beam_matches_generate(toy, prompt, cache):
    expected = reference(toy, prompt, 10, num_beams=4, num_return_sequences=1)
    for loop in LOOPS:
        out = generate(toy, prompt, 10, cache=cache, loop=loop, strategy=Beams(4))
        assert torch.equal(out.tokens[::4], expected), loop


@pytest.mark.parametrize("cache", CACHES)
def test_restart_from_a_held_cache_continues_the_same_sequence(toy, prompt, cache):
    whole = generate(toy, prompt, 20, cache=cache, cache_options={"max_cache_len": 32})
    first = generate(toy, prompt, 12, cache=cache, cache_options={"max_cache_len": 32})
    second = generate(toy, first.tokens, 8, cache=first.cache)
    assert_varied(whole.tokens[:, prompt.shape[1] :])
    assert torch.equal(second.tokens, whole.tokens)


def test_seeded_sampling_is_reproducible_and_cache_independent(toy, prompt):
    runs = [
        generate(
            toy,
            prompt,
            16,
            cache=cache,
            strategy=Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=7),
        ).tokens
        for cache in ("tuple", "dynamic", "prealloc")
    ]
    assert_varied(runs[0][:, prompt.shape[1] :])
    assert all(torch.equal(run, runs[0]) for run in runs)
    other_seed = generate(toy, prompt, 16, strategy=Sampling(temperature=0.8, top_k=20, seed=8)).tokens
    assert not torch.equal(other_seed, runs[0])


@pytest.mark.parametrize("cache", ["list", "prealloc"])
def test_our_layers_are_accepted_by_transformers_own_generate(toy, prompt, cache):
    expected = reference(toy, prompt, 12)
    cache_object = {cache_argument(toy): make_cache(cache, toy)}  # the keyword this transformers uses
    assert torch.equal(reference(toy, prompt, 12, **cache_object), expected)


# -- sliding-window layers: prealloc's window buffer against transformers' DynamicSlidingWindowLayer -----------

SLIDING_PROMPT = 40  # longer than the window of 16
SLIDING_BLOCKS = [4, 32]  # 4: the window moves to the buffer's front every 4 steps; 32: the default


def sliding_prompt(model):
    return torch.randint(0, model.config.vocab_size, (2, SLIDING_PROMPT), generator=torch.Generator().manual_seed(3))


def test_make_cache_picks_the_sliding_layers_of_a_sliding_config(sliding_toy, toy):
    from kvlab.caches import CatLayer, SlidingCatLayer
    from kvlab.designs import PreallocLayer, WindowLayer

    assert {type(layer) for layer in make_cache("prealloc", sliding_toy).layers} == {WindowLayer}
    assert {type(layer) for layer in make_cache("dynamic", sliding_toy).layers} == {SlidingCatLayer}
    assert {type(layer) for layer in make_cache("prealloc", toy).layers} == {PreallocLayer}
    assert {type(layer) for layer in make_cache("dynamic", toy).layers} == {CatLayer}


@pytest.mark.parametrize("block_tokens", SLIDING_BLOCKS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sliding_prealloc_greedy_matches_generate(sliding_toy, sliding_toy_bf16, dtype, block_tokens):
    model = sliding_toy if dtype == "float32" else sliding_toy_bf16
    prompt, new = sliding_prompt(model), 80  # 80 new tokens: the window of 16 slides 5 times over
    expected = reference(model, prompt, new)  # transformers' default cache: DynamicSlidingWindowLayer
    out = generate(model, prompt, new, cache="prealloc", cache_options={"block_tokens": block_tokens})
    assert torch.equal(out.tokens, expected)
    layer = out.cache.layers[0]
    assert layer.key_buffer.shape[-2] == 16 - 1 + block_tokens  # never more than the window and a block
    assert layer.keys.shape[-2] == 15 and layer.get_seq_length() == SLIDING_PROMPT + new - 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sliding_prealloc_best_beam_matches_generate(sliding_toy, sliding_toy_bf16, dtype):
    model = sliding_toy if dtype == "float32" else sliding_toy_bf16
    prompt = sliding_prompt(model)
    expected = reference(model, prompt, 40, num_beams=4, num_return_sequences=1)
    out = generate(model, prompt, 40, cache="prealloc", strategy=Beams(4), cache_options={"block_tokens": 4})
    assert torch.equal(out.tokens[::4], expected)
