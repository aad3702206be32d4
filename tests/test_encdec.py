"""Encoder–decoder decoding and the reused static cache, against transformers' own generate().

Every model here is a preset's architecture (T5, Whisper, BART) at small widths, so the whole file runs in
seconds on CPU; the shipped presets themselves are checked for their public sizes.
"""

import pytest
import torch

from kvlab import encdec, models
from kvlab.configs import build_config
from kvlab.encdec.reusable_cache import ReusableStaticCache, longer_cross_attention_cache, static_cache_at_smaller_batch
from kvlab.encdec.serve import MODES, count_graphs, serve
from kvlab.meter import MemoryMeter
from kvlab.models import assert_varied
from kvlab.profiler import ProfiledAllocations

SMALL = {
    "t5-small": "num_layers=2,num_decoder_layers=2,d_model=64,d_ff=128,num_heads=4,d_kv=16,vocab_size=500",
    "whisper-tiny": (
        "d_model=64,encoder_layers=2,decoder_layers=2,encoder_attention_heads=4,decoder_attention_heads=4,"
        "encoder_ffn_dim=128,decoder_ffn_dim=128,vocab_size=500,max_source_positions=48,num_mel_bins=16"
    ),
    # At width 64 BART's default init_std (0.02) decodes a varied row that ignores the encoder; 0.1 does not.
    "bart-base": (
        "d_model=64,encoder_layers=2,decoder_layers=2,encoder_attention_heads=4,decoder_attention_heads=4,"
        "encoder_ffn_dim=128,decoder_ffn_dim=128,vocab_size=500,init_std=0.1"
    ),
}
NEW = 8
# (batch, encoder length): 3 batch sizes and 3 encoder lengths under the maxima (4, 48), the maxima first.
REQUESTS = [(4, 48), (2, 12), (1, 30), (3, 48), (4, 7), (2, 30)]


@pytest.fixture(scope="module", params=list(SMALL))
def model(request):
    return models.build_model(request.param, SMALL[request.param])


def test_presets_have_the_public_sizes():
    t5 = build_config("t5-small")
    assert (t5.d_model, t5.num_layers, t5.num_heads, t5.d_kv, t5.d_ff, t5.vocab_size) == (512, 6, 8, 64, 2048, 32128)
    whisper = build_config("whisper-tiny")
    assert (
        whisper.d_model,
        whisper.decoder_layers,
        whisper.decoder_attention_heads,
        whisper.max_source_positions,
        whisper.vocab_size,
    ) == (384, 4, 6, 1500, 51865)
    bart = build_config("bart-base")
    assert (bart.d_model, bart.decoder_layers, bart.decoder_attention_heads, bart.decoder_ffn_dim) == (768, 6, 12, 3072)
    with pytest.raises(ValueError, match=r"t5-small, whisper-tiny, bart-base \(encoder-decoders\)"):
        build_config("t5-large")
    with pytest.raises(ValueError, match="not in the t5-small config"):
        build_config("t5-small", "hidden_size=8")


def reference(model, request, **options):
    """generate()'s tokens, checked first to vary along each row (equal tokens mean little if one repeats)."""
    tokens = encdec.generate_reference(model, request, NEW, **options)
    assert_varied(tokens)
    return tokens


def test_tokens_vary_and_depend_on_the_encoder_input(model):
    """Different encoder inputs give different rows: the cross-attention cache decides the tokens."""
    first, second = (reference(model, encdec.make_request(model, 3, 20, seed=seed)) for seed in (0, 1))
    assert all(not torch.equal(a, b) for a, b in zip(first, second)), (first, second)
    assert len({tuple(row) for row in first.tolist()}) == 3  # and the rows of one request differ


def test_a_degenerate_model_fails_the_variety_check():
    model = models.build_model("t5-small", SMALL["t5-small"])
    with torch.no_grad():
        model.shared.weight.mul_(1000)  # the residual stream is the fed token: the tied head repeats it
    with pytest.raises(AssertionError, match="degenerate output"):
        reference(model, encdec.make_request(model, 2, 12))


def test_loop_equals_generate_with_a_dynamic_cache(model):
    request = encdec.make_request(model, 3, 20, ragged=True)
    assert torch.equal(encdec.generate(model, request, NEW).new_tokens, reference(model, request))


@pytest.mark.parametrize("shapes", ["exact", "max"])
def test_reused_cache_gives_the_tokens_of_a_freshly_sized_one(model, shapes):
    if shapes == "max" and encdec.is_whisper(model):  # its decoder applies no encoder mask: padding is refused
        with pytest.raises(ValueError, match="Whisper's decoder passes no encoder mask"):
            ReusableStaticCache(model.config, 4, NEW, 48, shapes=shapes)
        return
    reused = ReusableStaticCache(model.config, 4, NEW, 48, shapes=shapes)
    buffers = [t.data_ptr() for t in reused.buffers()]
    for index, (batch, length) in enumerate(REQUESTS):
        request = encdec.make_request(model, batch, length, seed=index, ragged=True)
        fresh = reference(model, request, cache_implementation="static")
        assert torch.equal(encdec.generate(model, request, NEW, reused).new_tokens, fresh), (batch, length)
    assert [t.data_ptr() for t in reused.buffers()] == buffers  # the same memory served every request


@pytest.mark.parametrize("shapes", ["exact", "max"])
def test_reused_cache_serves_transformers_generate(model, shapes):
    """for_request's (cache, encoder output, mask) handed to transformers' own generate(): the same tokens."""
    from transformers import GenerationMixin
    from transformers.modeling_outputs import BaseModelOutput

    from kvlab.compat import cache_argument

    if shapes == "max" and encdec.is_whisper(model):
        with pytest.raises(ValueError, match="Whisper's decoder passes no encoder mask"):
            ReusableStaticCache(model.config, 4, NEW, 48, shapes=shapes)
        return
    reused = ReusableStaticCache(model.config, 4, NEW, 48, shapes=shapes)
    for index, (batch, length) in enumerate(REQUESTS[:3]):
        request = encdec.make_request(model, batch, length, seed=index, ragged=not encdec.is_whisper(model))
        cache, hidden, mask = reused.for_request(batch, *encdec.encode(model, request), NEW)
        options = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **{cache_argument(model): cache})
        start = torch.full((hidden.shape[0], 1), model.config.decoder_start_token_id)
        # Whisper's own generate() adds language / timestamp logic; the shared loop is what it calls.
        out = (GenerationMixin.generate if encdec.is_whisper(model) else type(model).generate)(
            model,
            encoder_outputs=BaseModelOutput(last_hidden_state=hidden),
            attention_mask=mask,
            decoder_input_ids=start,
            **options,
        )
        assert torch.equal(out[:batch, 1:], reference(model, request)), (batch, length)


def test_masked_padding_is_equivalent_and_an_unmasked_longer_cache_is_not():
    model = models.build_model("t5-small", SMALL["t5-small"])
    found = longer_cross_attention_cache(model, batch=2, encoder_length=12, cache_length=20, new_tokens=NEW)
    assert found["masked_max_abs_score_diff"] < 1e-4  # float rounding: the padding is invisible
    assert found["masked_tokens_agree"] == 1.0
    assert found["unmasked_max_abs_score_diff"] > 1e-2  # the 8 unused positions are attended to


def test_transformers_static_cache_refuses_a_smaller_batch():
    model = models.build_model("t5-small", SMALL["t5-small"])
    message = static_cache_at_smaller_batch(model, max_batch=4, batch=2, encoder_length=12, new_tokens=4)
    assert "index_copy_(): Source/destination tensor must have same slice shapes" in message


def test_reused_cache_refuses_what_would_be_wrong():
    model = models.build_model("t5-small", SMALL["t5-small"])
    reused = ReusableStaticCache(model.config, 4, NEW, 20)
    request = encdec.make_request(model, 2, 12)
    hidden, mask = encdec.encode(model, request)
    # The silent case of transformers: a 12-position encoder output into a 20-position cross-attention cache.
    reused.for_request(2, torch.zeros(2, 20, hidden.shape[2]), None, NEW)
    with pytest.raises(ValueError, match="encoder output of 12 positions for a cross-attention cache of 20"):
        encdec.generate(model, request, NEW, reused.cache, encoder_output=(hidden, mask))
    reused.for_request(4, torch.zeros(4, 12, hidden.shape[2]), None, NEW)
    with pytest.raises(ValueError, match="bound to batch 4 but the model sent batch 2"):
        encdec.generate(model, request, NEW, reused.cache, encoder_output=(hidden, mask))
    for batch, length, new, limit in (
        (5, 12, NEW, "batch 5 exceeds this cache's maximum of 4"),
        (2, 21, NEW, "encoder length 21 exceeds this cache's maximum of 20"),
        (2, 12, NEW + 1, f"new tokens {NEW + 1} exceeds this cache's maximum of {NEW}"),
    ):
        with pytest.raises(ValueError, match=limit):
            reused.for_request(batch, torch.zeros(batch, length, hidden.shape[2]), None, new)
    whisper = build_config("whisper-tiny", SMALL["whisper-tiny"])
    with pytest.raises(ValueError, match="Whisper's decoder passes no encoder mask"):
        ReusableStaticCache(whisper, 4, NEW, 48, shapes="max")


@pytest.mark.slow  # dynamo traces the decoder 7 times: about 30 s alone, a minute on a busy 2-core machine
def test_compiled_decoder_step_compiles_once_with_max_shapes():
    """dynamo's graph count over a stream of 3 batch sizes and 3 encoder lengths: one graph when every request
    is padded to the maxima; views at each request's own shapes recompile until dynamo marks the sizes dynamic."""
    model = models.build_model("t5-small", SMALL["t5-small"])
    requests = [encdec.make_request(model, batch, length, seed=index) for index, (batch, length) in enumerate(REQUESTS)]
    graphs = {mode: count_graphs(model, requests, mode, NEW) for mode in ("reused-max", "reused")}
    assert graphs["reused-max"] == [1, 0, 0, 0, 0, 0]
    assert graphs["reused"][0] == 1 and 1 <= sum(graphs["reused"][1:]) <= 3 and graphs["reused"][-2:] == [0, 0]


# -- a stream of requests served under the meter (appendix A10, section 4) ---------------------------------------
# The toy T5's decoder: 2 layers x 4 heads x 16 dims, keys and values, fp32: 1 KiB per position of one row.
POSITION_BYTES = 2 * 2 * 4 * 16 * 4


@pytest.fixture(scope="module")
def served():
    model = models.build_model("t5-small", SMALL["t5-small"])
    requests = [
        encdec.make_request(model, batch, length, seed=index, ragged=True)
        for index, (batch, length) in enumerate(REQUESTS[:4])
    ]
    return model, requests, {mode: serve(model, requests, mode, NEW) for mode in MODES}


def test_served_tokens_are_transformers_generate(served):
    model, requests, rows = served
    for index, request in enumerate(requests):
        expected = model.generate(**request.inputs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[:, 1:]
        for mode in MODES:
            assert rows[mode][index]["tokens"] == expected.tolist(), (mode, index)


def test_reused_cache_is_allocated_once_at_the_maxima_and_per_call_caches_every_request(served):
    _, requests, rows = served
    buffers = 4 * (NEW + 48) * POSITION_BYTES  # batch 4, 48 encoder positions: the largest of REQUESTS
    for mode in ("reused", "reused-max"):
        assert [r["new_cache_bytes"] for r in rows[mode]] == [buffers, 0, 0, 0]
        assert [r["held_bytes"] for r in rows[mode]] == [0, buffers, buffers, buffers]
    for mode in ("hf-static", "dynamic"):  # self-attention: the start token and every new token but the last
        own = [request.batch * (NEW + request.encoder_length) * POSITION_BYTES for request in requests]
        assert [r["new_cache_bytes"] for r in rows[mode]] == [r["cache_bytes"] for r in rows[mode]] == own
        assert all(r["held_bytes"] == 0 for r in rows[mode])
    for mode in MODES:
        assert all(r["cache_bytes"] == r["predicted_cache_bytes"] for r in rows[mode])


def test_reused_footprint_exceeds_a_per_call_one_by_at_most_the_buffers(served):
    """Per call, a request holds its own cache at the decoding peak; reused, the buffers all the time. So the
    reused footprint is above the per-call one by between (buffers - the request's cache) and the buffers, and
    the request's own peak (the held buffers left out) is never the higher one. Slack: one 8-byte position counter
    per layer of the reused cache (StaticLayer.cumulative_length), beside the buffers."""
    _, requests, rows = served
    buffers, slack = 4 * (NEW + 48) * POSITION_BYTES, 4 * 8
    for mode in ("hf-static", "dynamic"):
        for request, reused, per_call in zip(requests, rows["reused"], rows[mode]):
            own = request.batch * (NEW + request.encoder_length) * POSITION_BYTES
            assert buffers - own <= reused["footprint_bytes"] - per_call["footprint_bytes"] <= buffers + slack
            if reused["request"]:
                assert reused["peak_bytes"] <= per_call["peak_bytes"]  # equal where the encoder is the peak


def test_meter_on_the_decoding_loop_matches_the_profiler():
    """The meter serve() reads on a CPU, against PyTorch's profiler: the same peak, to the byte."""
    model = models.build_model("t5-small", SMALL["t5-small"])
    request = encdec.make_request(model, 3, 20, ragged=True)
    encoded = encdec.encode(model, request)
    encdec.generate(model, request, 6, encoder_output=encoded)  # warm-up: first-call allocations of the kernels
    with MemoryMeter("cpu") as meter:
        encdec.generate(model, request, 6, encoder_output=encoded)
    with ProfiledAllocations() as profiled:
        encdec.generate(model, request, 6, encoder_output=encoded)
    assert meter.report().peak_bytes == profiled.peak_bytes > 0


def test_serve_refuses_what_does_not_apply():
    whisper = models.build_model("whisper-tiny", SMALL["whisper-tiny"])
    request = encdec.make_request(whisper, 2, 12)
    with pytest.raises(ValueError, match="unknown mode 'fast'; choose one of: hf-static"):
        serve(whisper, [request], "fast", NEW)
    with pytest.raises(ValueError, match="Whisper's decoder passes no encoder mask"):
        serve(whisper, [request], "reused-max", NEW)
