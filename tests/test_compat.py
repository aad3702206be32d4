"""kvlab.compat on whichever transformers is imported: the pinned one (5.24+, `cache`) in the main run,
5.17 (`past_key_values`) in scripts/oldest-transformers.sh's run, which sets KVLAB_EXPECT_TRANSFORMERS."""

import os
import warnings

import pytest
import torch
import transformers
from packaging.version import Version
from transformers.cache_utils import DynamicCache

from kvlab.caches import CACHES, cache_length
from kvlab.compat import cache_argument, cache_from_outputs
from kvlab.loops import LOOPS, generate

OLD = "past_key_values"


def _renamed() -> bool:
    return Version(transformers.__version__).release >= (5, 24)


@pytest.fixture
def ids():
    return torch.randint(0, 1000, (2, 5), generator=torch.Generator().manual_seed(0))


def forward(model, ids, **cache_keyword):
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, **cache_keyword)


def test_the_expected_transformers_is_the_one_imported():
    """The 5.17 run must not silently test the pinned release (a folder missing from PYTHONPATH)."""
    expected = os.environ.get("KVLAB_EXPECT_TRANSFORMERS")
    if not expected:
        pytest.skip("KVLAB_EXPECT_TRANSFORMERS not set (the main run takes whatever the environment has)")
    assert transformers.__version__ == expected, transformers.__file__


def test_cache_argument_is_the_installed_name(toy):
    assert cache_argument(toy) == ("cache" if _renamed() else "past_key_values")


def test_forward_fills_the_cache_passed_under_that_name_and_hands_it_back(toy, ids):
    kv = DynamicCache(config=toy.config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = forward(toy, ids, **{cache_argument(toy): kv})
        assert kv.get_seq_length() == 5
        assert cache_from_outputs(outputs) is kv
        outputs = forward(toy, ids[:, :1], **{cache_argument(toy): kv})
        assert kv.get_seq_length() == 6
        assert cache_from_outputs(outputs) is kv
    assert not [w for w in caught if OLD in str(w.message)]


@pytest.mark.skipif(not _renamed(), reason="transformers < 5.24 has only `past_key_values`")
def test_old_name_still_works_with_a_future_warning(toy, ids):
    kv = DynamicCache(config=toy.config)
    with pytest.warns(FutureWarning, match="`past_key_values` is deprecated"):
        outputs = forward(toy, ids, past_key_values=kv)
    assert kv.get_seq_length() == 5
    assert "cache" in outputs and cache_from_outputs(outputs) is kv


@pytest.mark.skipif(_renamed(), reason="transformers >= 5.24 accepts `cache`")
def test_new_name_is_silently_ignored_before_the_rename(toy, ids):
    """Why the name is looked up, not guessed: 5.17 swallows `cache=` into **kwargs and runs without it."""
    kv = DynamicCache(config=toy.config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = forward(toy, ids, cache=kv)
    assert kv.get_seq_length() == 0
    assert "cache" not in outputs and cache_from_outputs(outputs) is not kv
    assert cache_from_outputs(outputs).get_seq_length() == 5  # the forward made and used its own
    assert not caught


def test_cache_from_outputs_reads_either_field():
    marker = object()
    assert cache_from_outputs({"logits": None, "cache": marker}) is marker
    assert cache_from_outputs({"logits": None, "past_key_values": marker}) is marker
    assert cache_from_outputs({"logits": None}) is None


def test_a_forward_naming_neither_gets_the_installed_name():
    class Wrapper(torch.nn.Module):  # e.g. an adapter wrapper that passes **kwargs through
        def forward(self, input_ids, **kwargs):
            return kwargs

    assert cache_argument(Wrapper()) == ("cache" if _renamed() else "past_key_values")


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_kvlab_decode_fills_its_cache_without_the_deprecated_name(toy, prompt, strategy):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(toy, prompt, 3, strategy=strategy, num_beams=2)  # the defaults
        for cache in CACHES:
            for loop in LOOPS:
                out = generate(toy, prompt, 3, cache=cache, loop=loop, strategy=strategy, num_beams=2)
                assert cache_length(out.cache) == prompt.shape[1] + 2  # the forward filled kvlab's cache
    assert not [str(w.message) for w in caught if OLD in str(w.message)]
