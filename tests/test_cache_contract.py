"""kvlab's cache designs against the contract of transformers' cache layers (`CacheLayerMixin`).

Adapted from transformers' own tests (tests/utils/test_cache_utils.py: CacheTest, SyntheticCacheTest,
CacheIntegrationTest, CacheHardIntegrationTest; tests/generation/test_utils.py: assisted and prompt-lookup
decoding), with only the class under test changed. Where an upstream test compares with text from
pretrained weights, the reference here is the same call with transformers' own `DynamicCache` on kvlab's
random-weight toy model; where it calls `DynamicCache` methods, the reference is transformers' `DynamicCache`.
"""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, set_seed

from kvlab.caches import CatLayer, KVCache, TupleCache, cache_bytes, make_cache
from kvlab.compat import cache_argument, cache_from_outputs
from kvlab.designs import ListLayer, PreallocLayer, WindowLayer
from kvlab.loops import cache_batch
from kvlab.meter import MemoryMeter
from kvlab.models import assert_varied, build_model

ROOT = Path(__file__).resolve().parent.parent
DESIGNS = ("dynamic", "list", "prealloc", "tuple")
LAYER = {
    "dynamic": CatLayer,
    "list": lambda: ListLayer(chunk_limit=3),
    "prealloc": lambda: PreallocLayer(block_tokens=4),
}


def new_cache(design: str, num_layers: int):
    if design == "tuple":
        return TupleCache.from_tuples((), num_layers)
    return KVCache([LAYER[design]() for _ in range(num_layers)])


def filled(design: str, num_layers: int = 10, shape=(4, 4, 8, 16), steps: int = 1, seed: int = 0):
    """The cache of `design` and transformers' DynamicCache, fed the same updates (`steps` of them per layer)."""
    generator = torch.Generator().manual_seed(seed)
    ours, theirs = new_cache(design, num_layers), DynamicCache()
    for step in range(steps):
        for layer_idx in range(num_layers):
            size = shape if step == 0 else (*shape[:2], 1, shape[-1])
            key, value = torch.rand(size, generator=generator), torch.rand(size, generator=generator)
            ours.update(key, value, layer_idx)
            theirs.update(key, value, layer_idx)
    return ours, theirs


def assert_same(ours, theirs):
    assert ours.get_seq_length() == theirs.get_seq_length()
    for mine, reference in zip(ours.layers, theirs.layers, strict=True):
        assert torch.equal(mine.keys, reference.keys) and torch.equal(mine.values, reference.values)


# -- CacheTest ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("design", DESIGNS)
def test_dynamic_cache_retrocompatibility(design):
    """Tests that we can convert back and forth between the legacy cache format and the cache object."""
    legacy_cache = ()
    new_cache_ = new_cache(design, 10)
    for layer_idx in range(10):  # a cache with 10 layers in both formats: 7 tokens, then one more
        keys, values = torch.rand((2, 4, 8, 16)), torch.rand((2, 4, 8, 16))
        new_cache_.update(keys[:, :, :7].clone(), values[:, :, :7].clone(), layer_idx)
        new_cache_.update(keys[:, :, 7:].clone(), values[:, :, 7:].clone(), layer_idx)
        legacy_cache += ((keys, values),)  # what the two updates must hold, made apart from the cache's tensors
    layers = new_cache_.layers
    # Sanity check 1: the same shapes; 2: the sequence length in several ways; 3: the same values
    for layer_idx in range(10):
        assert legacy_cache[layer_idx][0].shape == layers[layer_idx].keys.shape
        assert legacy_cache[layer_idx][1].shape == layers[layer_idx].values.shape
    assert legacy_cache[0][0].shape[-2] == layers[0].keys.shape[-2] == new_cache_.get_seq_length() == 8
    for layer_idx in range(10):
        assert torch.allclose(layers[layer_idx].keys, legacy_cache[layer_idx][0])
        assert torch.allclose(layers[layer_idx].values, legacy_cache[layer_idx][1])
    # Test 2: from the cache object to the legacy format with no changes (5.x: `(layer.keys, layer.values)`)
    to_legacy = new_cache_.to_tuples()
    for layer_idx in range(10):
        for kv in range(2):
            assert torch.allclose(to_legacy[layer_idx][kv], legacy_cache[layer_idx][kv])
    # Test 1: from the legacy format to the cache object with no changes: <= 4.41's wrapping, the tuple design's
    if design in ("tuple", "dynamic"):
        from_legacy = type(new_cache_).from_tuples(legacy_cache, 10)
        for layer_idx in range(10):
            assert from_legacy.layers[layer_idx].keys is legacy_cache[layer_idx][0]  # wrapped, not copied
            assert from_legacy.layers[layer_idx].values is legacy_cache[layer_idx][1]


@pytest.mark.parametrize("design", DESIGNS)
def test_reorder_cache_retrocompatibility(design):
    """Tests that `reorder_cache` is retrocompatible with the legacy code path."""

    def legacy_reorder_fn(past_key_values, beam_idx):  # an example of a legacy `_reorder_cache` function (GPT-2's)
        return tuple(
            tuple(past_state.index_select(0, beam_idx.to(past_state.device)) for past_state in layer_past)
            for layer_past in past_key_values
        )

    legacy_cache = ()
    new_cache_ = new_cache(design, 10)
    for layer_idx in range(10):
        new_key, new_value = torch.rand((4, 4, 8, 16)), torch.rand((4, 4, 8, 16))
        new_cache_.update(new_key, new_value, layer_idx)
        legacy_cache += ((new_key, new_value),)
    beam_idx = torch.randint(low=0, high=4, size=(4,))  # num_beams=4 and batch_size=1
    legacy_cache_reordered = legacy_reorder_fn(legacy_cache, beam_idx)
    new_cache_.reorder_cache(beam_idx)
    for layer_idx in range(10):
        assert torch.allclose(new_cache_.layers[layer_idx].keys, legacy_cache_reordered[layer_idx][0])
        assert torch.allclose(new_cache_.layers[layer_idx].values, legacy_cache_reordered[layer_idx][1])


# -- SyntheticCacheTest -----------------------------------------------------------------------------------


@pytest.mark.parametrize("design", DESIGNS)
def test_dynamic_cache(design):
    """Scenario 1: prefill [1, 2] and updates of one layer; scenario 2: two layers updated independently."""
    prefill = torch.tensor([1.0, 2.0])[None, None, :, None]
    update3 = torch.tensor(3.0)[None, None, None, None]
    update4 = torch.tensor(4.0)[None, None, None, None]

    cache = new_cache(design, 1)
    cache.update(prefill, prefill, 0)
    cache.update(update3, update3, 0)
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0], "Scenario 1 failed"
    cache.update(update4, update4, 0)
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0, 4.0], "Scenario 1 (to 4) failed"

    prefill1 = torch.tensor([10.0, 20.0])[None, None, :, None]
    update3_1 = torch.tensor(30.0)[None, None, None, None]
    update4_1 = torch.tensor(40.0)[None, None, None, None]
    cache = new_cache(design, 2)
    cache.update(prefill, prefill, 0)
    cache.update(prefill1, prefill1, 1)
    cache.update(update3, update3, 0)
    cache.update(update3_1, update3_1, 1)
    cache.update(update4, update4, 0)
    cache.update(update4_1, update4_1, 1)
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0, 4.0], "Scenario 2 layer 0 failed"
    assert cache.layers[1].keys[0, 0, :, 0].tolist() == [10.0, 20.0, 30.0, 40.0], "Scenario 2 layer 1 failed"


# -- the rest of the layer contract, against transformers' DynamicCache ---------------------------------------


@pytest.mark.parametrize("design", DESIGNS)
def test_keys_and_values_are_filled_whenever_the_layer_holds_tokens(design):
    ours, theirs = filled(design, num_layers=3, steps=5)  # list: 5 chunks past a limit of 3, one consolidation
    assert ours.get_seq_length() == 12
    assert_same(ours, theirs)
    # transformers' own reader of a DynamicCache, run on ours
    for mine, reference in zip(DynamicCache.__iter__(ours), theirs, strict=True):
        assert torch.equal(mine[0], reference[0]) and torch.equal(mine[1], reference[1]) and mine[2] is None
    assert [layer.get_mask_sizes(1) for layer in ours.layers] == [layer.get_mask_sizes(1) for layer in theirs.layers]
    assert [layer.get_max_length() for layer in ours.layers] == [-1] * 3 and ours.is_croppable


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("tokens_to_remove", [0, -1, -5, -12, -100])
def test_crop_removes_tokens_as_dynamic_layer_crop(design, tokens_to_remove):
    ours, theirs = filled(design, num_layers=2, steps=5)
    ours.crop(tokens_to_remove)
    theirs.crop(tokens_to_remove)
    assert_same(ours, theirs)
    key = torch.rand(4, 4, 1, 16)
    for cache in (ours, theirs):  # and decoding goes on from there
        cache.update(key, key, 0)
    assert torch.equal(ours.layers[0].keys, theirs.layers[0].keys)


@pytest.mark.parametrize("design", DESIGNS)
def test_crop_refuses_a_positive_count_as_dynamic_layer_crop(design):
    ours, theirs = filled(design, num_layers=2, steps=3)
    for cache in (theirs, ours):
        with pytest.raises(ValueError, match="crop"):
            cache.crop(3)
    assert_same(ours, theirs)  # nothing removed


def repeat_then_select(ours, theirs):
    """Both caches through batch_repeat_interleave(2), then batch_select_indices: equal after each."""
    for cache in (ours, theirs):
        cache.batch_repeat_interleave(2)
    assert_same(ours, theirs)
    for cache in (ours, theirs):
        cache.batch_select_indices(torch.tensor([7, 0, 3]))
    assert_same(ours, theirs)


@pytest.mark.parametrize("design", DESIGNS)
def test_batch_methods_offload_and_reset_act_as_dynamic_cache(design):
    ours, theirs = filled(design, num_layers=2, steps=4)
    repeat_then_select(ours, theirs)
    for mine, reference in zip(ours.layers, theirs.layers):
        for layer in (mine, reference):
            layer.offload()
            layer.prefetch()
    assert_same(ours, theirs)
    assert all(layer.keys.device == layer.device for layer in ours.layers)
    ours.reset()
    assert ours.get_seq_length() == 0


# -- CacheIntegrationTest / CacheHardIntegrationTest, on the toy model -------------------------------------


@pytest.fixture(scope="module")
def model():
    return build_model("toy")


def hf_generate(model, design, input_ids, attention_mask=None, **kwargs):
    """transformers' own generate(); `design` None: its default DynamicCache; a cache object: that one."""
    if design is not None and not isinstance(design, str):
        cache = {cache_argument(model): design}
    else:
        cache = {} if design is None else {cache_argument(model): new_cache(design, model.config.num_hidden_layers)}
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    options = dict(do_sample=False, max_new_tokens=10, min_new_tokens=10, return_dict_in_generate=True)
    return model.generate(input_ids, attention_mask=mask, **{**options, **cache, **kwargs})


def left_padded(rows):
    """Prompts of different lengths, left-padded with 0 as a tokenizer with padding_side="left" does."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


PROMPTS = [[5, 17, 3, 99, 41, 8, 250], [11, 2, 600]]


@pytest.mark.parametrize("design", DESIGNS)
def test_cache_batched(model, design):
    """Sanity check: caches' `.update` function expects batched inputs."""
    ids, mask = left_padded(PROMPTS)
    ours = new_cache(design, model.config.num_hidden_layers)
    gen_out = hf_generate(model, ours, ids, mask)
    used_by_generate(ours, gen_out, rows=2, tokens=ids.shape[1] + 10 - 1)
    assert torch.equal(gen_out.sequences, hf_generate(model, None, ids, mask).sequences)


def used_by_generate(ours, gen_out, rows: int, tokens: int):
    """generate() decoded into our cache object: it returns that very object, holding every row and every token fed
    (the last new token is never fed back)."""
    assert cache_from_outputs(gen_out) is ours
    assert cache_batch(ours) == rows and ours.get_seq_length() == tokens


@pytest.mark.parametrize("design", DESIGNS)
def test_cache_beam_search(model, design):
    """Sanity check: caches' `reorder_cache` is operational (an output sequence holds several beam indices)."""
    ids = torch.tensor([PROMPTS[0]])
    ours = new_cache(design, model.config.num_hidden_layers)
    gen_out = hf_generate(model, ours, ids, num_beams=2, num_return_sequences=2)
    used_by_generate(ours, gen_out, rows=2, tokens=ids.shape[1] + 10 - 1)
    assert any(len(set(beams_in_sequence.tolist())) > 1 for beams_in_sequence in gen_out.beam_indices)
    assert torch.equal(gen_out.sequences, hf_generate(model, None, ids, num_beams=2, num_return_sequences=2).sequences)


@pytest.mark.parametrize("design", DESIGNS)
def test_cache_extra_left_padding(model, design):
    """Tests that adding extra left-padding does not affect the generation with the cache."""
    ids = torch.tensor([PROMPTS[1]])
    expected = hf_generate(model, design, ids).sequences[:, ids.shape[1] :]
    padded, mask = left_padded([PROMPTS[1], [1] * 32])  # pad_to_multiple_of=32
    gen_out = hf_generate(model, design, padded[:1], mask[:1]).sequences[:, padded.shape[1] :]
    assert torch.equal(gen_out, expected)


@pytest.mark.parametrize("design", DESIGNS)
def test_cache_copy(model, design):
    """Tests that we can manually set a cache, copy, and reuse it for generation."""
    initial_prompt = torch.tensor([PROMPTS[0]])
    with torch.no_grad():  # the common prompt, cached by a forward without grad to be able to copy it
        prompt_cache = cache_from_outputs(
            model(
                initial_prompt,
                use_cache=True,
                **{cache_argument(model): new_cache(design, model.config.num_hidden_layers)},
            )
        )
    for prompt in ([4, 44, 444], [9]):
        new_inputs = torch.tensor([PROMPTS[0] + prompt])
        cache = copy.deepcopy(prompt_cache)
        outputs = model.generate(
            new_inputs,
            attention_mask=torch.ones_like(new_inputs),
            max_new_tokens=10,
            min_new_tokens=10,
            do_sample=False,
            **{cache_argument(model): cache},
        )
        assert torch.equal(outputs, hf_generate(model, None, new_inputs).sequences)
    assert prompt_cache.get_seq_length() == len(PROMPTS[0])  # the copies grew, not the original


@pytest.mark.parametrize("design", DESIGNS)
def test_dynamic_cache_hard(model, design):
    """Sampling with a seed: the same tokens and scores as transformers' DynamicCache."""
    ids = torch.tensor([PROMPTS[0]])
    runs = []
    for cache in (design, None):
        set_seed(0)
        runs.append(hf_generate(model, cache, ids, do_sample=True, top_k=5, output_scores=True))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert all(torch.equal(a, b) for a, b in zip(runs[0].scores, runs[1].scores, strict=True))


# -- GenerationTesterMixin: decoding that crops the cache --------------------------------------------------


@pytest.mark.parametrize("design", DESIGNS)
def test_assisted_decoding_matches_greedy_search(model, design):
    """Assisted decoding (the assistant's rejected tokens are cropped from the cache) gives greedy's tokens."""
    assistant = build_model("toy", ["num_hidden_layers=1"], seed=3)  # a different model: some tokens rejected
    ids, mask = left_padded(PROMPTS[:1])
    greedy = hf_generate(model, None, ids, mask)
    assisted = hf_generate(model, design, ids, mask, assistant_model=assistant, output_scores=True)
    assert torch.equal(assisted.sequences, greedy.sequences)


@pytest.mark.parametrize("design", DESIGNS)
def test_prompt_lookup_decoding_matches_greedy_search(model, design):
    ids = torch.tensor([[5, 17, 3, 5, 17, 3, 5, 17, 3, 5]])  # repeated n-grams: candidates to look up
    greedy = hf_generate(model, None, ids)
    assert torch.equal(hf_generate(model, design, ids, prompt_lookup_num_tokens=2).sequences, greedy.sequences)


# -- sliding-window layers: WindowLayer against transformers' DynamicSlidingWindowLayer ------------------------

WINDOW = 6


def slid(block_tokens: int, prefill: int, steps: int, num_layers: int = 2, batch: int = 4, seed: int = 0):
    """A cache of WindowLayer and one of DynamicSlidingWindowLayer fed the same updates, each layer checked after
    each (keys and values returned to attention, kept tensors, counts and mask sizes)."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    generator = torch.Generator().manual_seed(seed)
    ours = KVCache([WindowLayer(WINDOW, block_tokens) for _ in range(num_layers)])
    theirs = KVCache([DynamicSlidingWindowLayer(WINDOW) for _ in range(num_layers)])
    for step in range(steps + 1):
        size = (batch, 2, prefill if step == 0 else 1, 8)
        for layer_idx in range(num_layers):
            key, value = torch.rand(size, generator=generator), torch.rand(size, generator=generator)
            assert ours.get_mask_sizes(size[2], layer_idx) == theirs.get_mask_sizes(size[2], layer_idx)
            for mine, reference in zip(ours.update(key, value, layer_idx), theirs.update(key, value, layer_idx)):
                assert torch.equal(mine, reference)  # what attention reads, in the same order
    assert_same(ours, theirs)
    return ours, theirs


@pytest.mark.parametrize("block_tokens", [1, 3, 32])
@pytest.mark.parametrize("prefill", [2, 5, 6, 7, 20, 50])
def test_window_layer_hands_attention_what_the_sliding_layer_does(block_tokens, prefill):
    ours, _ = slid(block_tokens, prefill, steps=25)  # 25 steps: the window moves to the front again and again
    layer = ours.layers[0]
    assert layer.key_buffer.shape[-2] == WINDOW - 1 + block_tokens
    assert layer.keys.shape[-2] == WINDOW - 1
    assert layer.get_max_length() == WINDOW and layer.is_sliding and ours.is_sliding == [True, True]


def test_window_layer_batch_methods_and_reset_act_as_the_sliding_layer():
    ours, theirs = slid(3, prefill=9, steps=4)
    repeat_then_select(ours, theirs)
    beam_idx = torch.tensor([2, 2, 0])
    for cache in (ours, theirs):
        cache.reorder_cache(beam_idx)
    assert_same(ours, theirs)
    key = torch.rand(3, 2, 1, 8)
    assert all(torch.equal(a, b) for a, b in zip(ours.update(key, key, 0), theirs.update(key, key, 0)))
    ours.reset()
    assert ours.get_seq_length() == 0 and ours.layers[0].keys.shape[-2] == 0


def test_window_layer_crops_inside_the_window_and_refuses_past_it():
    ours, theirs = slid(3, prefill=3, steps=1)  # 4 tokens, inside the window of 6
    for cache in (ours, theirs):
        cache.crop(-2)
    assert_same(ours, theirs)
    ours, theirs = slid(3, prefill=9, steps=1)  # past the window: the tokens before it are gone
    for cache in (ours, theirs):
        with pytest.raises(RuntimeError, match="crop"):
            cache.crop(-1)


def test_sliding_caches_in_transformers_generate_with_left_padding_inside_the_window(sliding_toy):
    # Rows of 30 and 9 tokens: the short row's 21 padding tokens stay inside the window of 16 for the first steps
    # after the buffer fills and moves, where a rotated ring of slots would mask the wrong keys.
    generator = torch.Generator().manual_seed(5)
    rows = [torch.randint(1, 1000, (n,), generator=generator).tolist() for n in (30, 9)]
    ids, mask = left_padded(rows)
    expected = hf_generate(sliding_toy, None, ids, mask, max_new_tokens=30, min_new_tokens=30).sequences
    assert_varied(expected[:, ids.shape[1] :])
    for design in ("prealloc", "dynamic"):
        cache = {cache_argument(sliding_toy): make_cache(design, sliding_toy, block_tokens=4)}
        out = hf_generate(sliding_toy, None, ids, mask, max_new_tokens=30, min_new_tokens=30, **cache)
        assert torch.equal(out.sequences, expected), design


@pytest.mark.parametrize("design", ["prealloc", "dynamic"])
def test_no_prompt_length_buffer_alive_after_the_prefill_but_dynamics_view(sliding_toy, design):
    """After a prompt of 64 tokens (window 16), the live storages are the cache's own: prealloc's buffers of
    W - 1 + block tokens; dynamic (transformers' layer) keeps a view of the prompt's whole concatenated keys
    and values, 64 tokens per layer, until the first decode step (the meter sees it: the check can fail)."""
    prompt, config = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(2)), sliding_toy.config
    per_token = 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4  # batch 2, fp32
    cache = make_cache(design, sliding_toy)
    with torch.no_grad(), MemoryMeter("cpu", sliding_toy) as meter:
        sliding_toy(prompt, use_cache=True, **{cache_argument(sliding_toy): cache})  # outputs dropped at once
        live = sorted(meter.counter.bytes_by_serial().values())
    layers = config.num_hidden_layers
    if design == "prealloc":
        assert live == [per_token * (16 - 1 + 32)] * (2 * layers)  # keys and values of every layer, nothing else
        assert sum(live) == cache_bytes(cache)
    else:
        assert live == [per_token * 64] * (2 * layers)
        # and each layer's window where 5.x keeps it as a 0-d int64, made with the cache before the meter started
        windows = [getattr(layer, "_sliding_window_tensor", None) for layer in cache.layers]
        assert sum(live) + sum(8 for window in windows if torch.is_tensor(window)) == cache_bytes(cache)


# -- the registry: kvlab's own designs join make_cache when kvlab.designs is imported ------------------------------


def test_kvlabs_own_designs_are_refused_in_one_line_until_their_module_is_imported():
    """In a fresh process that imports only the lesson's modules, make_cache refuses list and prealloc in one line
    that names the module to import; the public `kvlab.make_cache` imports it, and then both are built."""
    code = (
        "import sys\n"
        "from kvlab.caches import make_cache\n"
        "from kvlab.models import build_model\n"
        "model = build_model('toy')\n"
        "for name in ('list', 'prealloc'):\n"
        "    try:\n"
        "        make_cache(name, model)\n"
        "    except ValueError as error:\n"
        "        print(error)\n"
        "print('kvlab.designs' in sys.modules)\n"
        "import kvlab\n"
        "print(*(type(kvlab.make_cache(name, model).layers[0]).__name__ for name in ('list', 'prealloc')))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's kvlab
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "the cache 'list' is one of kvlab's own designs: import kvlab.designs to register it",
        "the cache 'prealloc' is one of kvlab's own designs: import kvlab.designs to register it",
        "False",
        "ListLayer PreallocLayer",
    ]
