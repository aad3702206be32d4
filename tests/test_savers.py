"""Today's memory savers (kvlab.savers), each on a small point: the KV predicted from the shapes is, to the byte, what
the cache transformers' own generate() makes holds at the end; the dry run on meta (kvlab's loop into the same
cache) predicts generate()'s peak above the weights within 1 %; kvlab's loop decodes generate()'s tokens into that
cache, and with a chunked prefill in every design; the stored table (data/today/savers.csv) keeps the same claims."""

import functools
from pathlib import Path

import pandas as pd
import pytest
import torch

from kvlab import savers
from kvlab.caches import CACHES, cache_bytes
from kvlab.compat import cache_from_outputs
from kvlab.explain import generate_call
from kvlab.loops import generate
from kvlab.meter import weight_bytes
from kvlab.models import assert_varied, build_model, random_prompt

TABLE = Path(__file__).resolve().parents[1] / "data" / "today" / "savers.csv"
# In `make test`: FP8, the chunked prefill, a window, the latent; the rest in `make test-all` (optimum-quanto builds
# its C++ kernels on first use).
FAST = ("fp8", "prefill-chunks", "sliding", "mla")
RUN = [name for name in savers.SAVERS if name not in savers.SAVER_NOT_RUN]


def small(name: str) -> dict:
    """SAVERS[name] at a size a test affords, crossing what the saver does: a quantized residual flushed several
    times (every 4 tokens), a window and a chunk of 8 passed, a prompt in 3 chunks."""
    point = dict(savers.SAVERS[name], batch=2, prompt=20, new=16, dtype="float32")
    options = dict(point["generate"])
    if point["preset"] == "llama2-7b-twin":
        point["preset"] = "toy"
    if "cache_config" in options and options["cache_config"]["backend"] != "fp8":
        options["cache_config"] = dict(options["cache_config"], residual_length=4)
    if "prefill_chunk_size" in options:
        options["prefill_chunk_size"] = 8
    overrides = {"sliding": {"sliding_window": 8, "num_hidden_layers": 4}, "chunked": {"attention_chunk_size": 8}}
    point["overrides"] = overrides.get(name, point["overrides"])
    return dict(point, generate=options)


def _param(name: str):
    marks = [pytest.mark.xdist_group(f"saver-{name}")] + [pytest.mark.slow] * (name not in FAST)
    return pytest.param(name, marks=marks)


@functools.cache
def measured(name: str, baseline: bool = False) -> dict:
    """transformers' own generate() at small(name): with the saver, or without it (baseline)."""
    point = small(name)
    model = savers._model(point, baseline=baseline)
    ids = random_prompt(model.config.vocab_size, point["batch"], point["prompt"], 0)
    run = savers.measure_generate(model, ids, point["new"], {} if baseline else point["generate"])
    return dict(run, ids=ids, weights=weight_bytes(model))


@pytest.mark.parametrize("name", [_param(name) for name in RUN])
def test_the_kv_from_the_shapes_is_what_generates_cache_holds(name):
    point = small(name)
    config = savers._model(point, "meta").config
    tokens = point["prompt"] + point["new"] - 1
    predicted = savers.kv_bytes(config, point["generate"], point["batch"], tokens, point["dtype"], point["new"])
    assert predicted == measured(name)["kv"]


@pytest.mark.parametrize("name", [_param(name) for name in RUN])
def test_the_dry_run_predicts_generates_peak_within_1_percent(name):
    point = small(name)
    meta = savers._model(point, "meta")
    predicted = savers.dry_run_peak(meta, point["new"], point["batch"], point["prompt"], point["generate"])
    weights = measured(name)["weights"]  # the tensors: quanto's and HQQ's kernels allocate scratch of their own
    assert predicted - weights == pytest.approx(measured(name)["tensors_peak"] - weights, rel=0.01)


@pytest.mark.parametrize("name", [_param(name) for name in RUN])
def test_kvlabs_loop_decodes_generates_tokens_into_the_savers_cache(name):
    point = small(name)
    model = savers._model(point)
    want = measured(name)
    got = generate(
        model,
        want["ids"],
        point["new"],
        cache=savers.generate_cache(model, point["generate"]),
        prefill_chunk=point["generate"].get("prefill_chunk_size"),
    )
    assert_varied(want["tokens"])
    assert torch.equal(got.tokens[:, point["prompt"] :], want["tokens"])


@pytest.mark.parametrize("name", [_param("sliding"), _param("shared-kv")])
def test_a_layout_saver_holds_less_kv_than_the_same_model_without_it(name):
    point = small(name)
    config = savers._model(point, "meta", baseline=True).config
    tokens, new = point["prompt"] + point["new"] - 1, point["new"]
    predicted = savers.kv_bytes(config, {}, point["batch"], tokens, point["dtype"], new)
    assert measured(name, baseline=True)["kv"] == predicted
    assert measured(name)["kv"] < measured(name, baseline=True)["kv"]


def test_cache_bytes_counts_a_quantized_caches_packed_tensors():
    """kvlab.caches.cache_bytes, whose tensors kvlab's loops label as KV, holds an FP8 cache at what its shapes say:
    the quantized keys and values and their scales beside the residual (it once counted the residual alone)."""
    point = small("fp8")
    model = savers._model(point)
    ids = random_prompt(model.config.vocab_size, point["batch"], point["prompt"], 0)
    with torch.no_grad():
        out = generate_call(model, ids, point["new"], return_dict_in_generate=True, **point["generate"])()
    tokens = point["prompt"] + point["new"] - 1
    expected = savers.kv_bytes(model.config, point["generate"], point["batch"], tokens, point["dtype"], point["new"])
    assert cache_bytes(cache_from_outputs(out)) == expected


def test_explain_names_fp8s_dequantized_layer_at_its_peak():
    # a short prompt, a long generation: the peak at the last step, not in the prompt's forward
    point = dict(small("fp8"), batch=1, prompt=8, new=40)
    model = savers._model(point)
    ids = random_prompt(model.config.vocab_size, point["batch"], point["prompt"], 0)
    forward, op, named = savers.transient(model, ids, point["new"], point["generate"])
    assert forward == point["new"] - 1  # the last step: the longest layer dequantized to float32
    assert "Fp8QuantizedLayer._dequantize" in op and "float32[1, 4, 47, 64]" in named


def test_every_design_decodes_generates_tokens_with_a_chunked_prefill():
    model = build_model("toy")
    ids = random_prompt(model.config.vocab_size, 2, 20, 0)
    with torch.no_grad():
        want = generate_call(model, ids, 8, prefill_chunk_size=8)()
    assert_varied(want[:, 20:])
    for cache in CACHES:
        assert torch.equal(generate(model, ids, 8, cache=cache, prefill_chunk=8).tokens, want), cache


@pytest.mark.slow  # two dry runs of the 32-layer twin each
@pytest.mark.parametrize("name", ["fp8", "prefill-chunks"])  # transformers' own savers: no extra backend
def test_todays_prediction_is_the_stored_measurement(name):
    """The stored measurement (generate() under the meter) against what kvlab predicts now, from the shapes and a dry
    run on meta: the table's measured columns are not taken on trust from its predicted ones, nor the reverse."""
    stored = pd.read_csv(TABLE).set_index("saver").loc[name]
    guess = savers.predicted(name, savers.SAVERS[name])
    assert guess["weights"] == stored["weights_bytes"] and guess["kv"] == stored["kv_bytes"]
    assert guess["peak"] - stored["peak_bytes"] == pytest.approx(
        0, abs=0.01 * (stored["peak_bytes"] - guess["weights"])
    )


def test_the_stored_table_keeps_the_claims():
    table = pd.read_csv(TABLE)
    assert list(table["saver"]) == list(savers.SAVERS)
    run = table.dropna(subset=["peak_bytes"])
    assert set(run["saver"]) == set(RUN)
    above = run["peak_bytes"] - run["weights_bytes"]  # the peak above the weights, the meter's own count
    assert (abs(run["peak_predicted_bytes"] - run["peak_bytes"]) <= 0.01 * above).all()
    both = table.dropna(subset=["kv_saved_bytes", "peak_saved_bytes"])
    assert (both["kv_saved_predicted_bytes"] == both["kv_saved_bytes"]).all()
    off = abs(both["peak_saved_predicted_bytes"] - both["peak_saved_bytes"])
    assert (off <= 0.01 * (both["peak_baseline_bytes"] - both["weights_bytes"])).all()


@pytest.mark.slow
def test_the_running_examples_answers_are_the_stored_ones():
    """The stored answers (data/today/savers_text.csv) are what SmolLM2 decodes with each lossy saver: the text
    appendix A11 quotes, where each first leaves the default cache's answer."""
    from kvlab.lab.savers_table import saver_answers

    stored = pd.read_csv(TABLE.with_name("savers_text.csv"), keep_default_na=False)
    now = [(row["saver"], "" if row["first_difference"] is None else str(row["first_difference"]), row["text"])
           for row in saver_answers()]  # fmt: skip
    assert now == [(row.saver, str(row.first_difference), row.text) for row in stored.itertuples()]
