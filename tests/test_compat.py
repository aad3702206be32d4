"""kvlab.compat on whichever transformers is imported: the pinned one (5.24, `cache`) in the main run, 5.17
(`past_key_values`) and 5.25 in scripts/transformers-release.sh's runs, which set KVLAB_EXPECT_TRANSFORMERS.
Each test calls the model: what the installed forward accepts, not a restatement of compat's version rule."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from transformers.cache_utils import DynamicCache

import kvlab.designs  # noqa: F401 (registers kvlab's own designs, list and prealloc, with make_cache)
from kvlab.caches import CACHES, cache_length
from kvlab.compat import cache_argument, cache_from_outputs
from kvlab.decoding import decoding
from kvlab.loops import LOOPS, generate

OLD = "past_key_values"


@pytest.fixture
def ids():
    return torch.randint(0, 1000, (2, 5), generator=torch.Generator().manual_seed(0))


def forward(model, ids, **cache_keyword):
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, **cache_keyword)


def test_the_expected_transformers_is_the_one_imported():
    """The 5.17 and 5.25 runs must not silently test the pinned release (a folder missing from PYTHONPATH)."""
    expected = os.environ.get("KVLAB_EXPECT_TRANSFORMERS")
    if not expected:
        pytest.skip("KVLAB_EXPECT_TRANSFORMERS not set (the main run takes whatever the environment has)")
    assert transformers.__version__ == expected, transformers.__file__


def filled_and_warned(model, ids, name: str) -> tuple[bool, list[str]]:
    """Whether a forward given a fresh cache under `name` fills it, and the warnings it gives about cache names."""
    kv = DynamicCache(config=model.config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forward(model, ids, **{name: kv})
    return kv.get_seq_length() == ids.shape[1], [str(w.message) for w in caught if OLD in str(w.message)]


def test_the_name_kvlab_passes_is_the_one_the_installed_forward_fills_without_a_warning(toy, ids):
    """Called, not looked up by version: kvlab's name fills the cache and warns of nothing; the other name either
    is swallowed into **kwargs and ignored (before 5.24's rename: the forward makes and fills a cache of its own)
    or still works with a deprecation warning (from 5.24)."""
    name = cache_argument(toy)
    assert name in ("cache", OLD)
    assert filled_and_warned(toy, ids, name) == (True, [])
    other = {"cache": OLD, OLD: "cache"}[name]
    filled, warned = filled_and_warned(toy, ids, other)
    assert not filled or (warned and "deprecated" in warned[0]), (other, filled, warned)


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


LOAD = """
import sys, torch
from safetensors.torch import load_file
from kvlab.planner.sources import build_model
loaded = build_model("kvlab-test/toy").state_dict()
print(all(torch.equal(tensor, loaded[name]) for name, tensor in load_file(sys.argv[1]).items()))
"""


def test_a_hub_checkpoint_loads_into_transformers_own_layers(toy, tmp_path):
    """build_model's from_pretrained, offline from a local hub cache, hub kernels left to the release's default:
    5.25 turns them on unless told not to, and without the `kernels` package then refuses to load."""
    repo = tmp_path / "hub" / "models--kvlab-test--toy"
    commit = "0" * 40
    toy.save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {key: value for key, value in os.environ.items() if key != "USE_HUB_KERNELS"}
    env.update(HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    root = Path(__file__).resolve().parent.parent  # kvlab from this checkout
    run = subprocess.run(
        [sys.executable, "-c", LOAD, str(repo / "snapshots" / commit / "model.safetensors")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[-1] == "True"  # the weights saved, not a fresh random model


def test_cache_from_outputs_reads_either_field():
    marker = object()
    assert cache_from_outputs({"logits": None, "cache": marker}) is marker
    assert cache_from_outputs({"logits": None, "past_key_values": marker}) is marker
    assert cache_from_outputs({"logits": None}) is None


def test_a_forward_naming_neither_gets_the_name_the_model_below_fills(toy, ids):
    class Wrapper(torch.nn.Module):  # e.g. an adapter wrapper that passes **kwargs through
        def __init__(self, model):
            super().__init__()
            self.model, self.config = model, model.config

        def forward(self, input_ids, **kwargs):
            return self.model(input_ids=input_ids, **kwargs)

    assert filled_and_warned(Wrapper(toy), ids, cache_argument(Wrapper(toy))) == (True, [])


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_kvlab_decode_fills_its_cache_without_the_deprecated_name(toy, prompt, strategy):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(toy, prompt, 3, strategy=decoding(strategy, 2))  # the defaults
        for cache in CACHES:
            for loop in LOOPS:
                out = generate(toy, prompt, 3, cache=cache, loop=loop, strategy=decoding(strategy, 2))
                assert cache_length(out.cache) == prompt.shape[1] + 2  # the forward filled kvlab's cache
    assert not [str(w.message) for w in caught if OLD in str(w.message)]
