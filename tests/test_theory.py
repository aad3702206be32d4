"""The peaks the issue says the measurements must show, and kvlab.theory against the meter.

Every assertion compares a measurement (the live-storage meter) with something independent of it:
the analytic model of kvlab.theory, a byte count written out by hand, or another measurement.
"""

from pathlib import Path

import pandas as pd
import pytest
import torch

from kvlab import schema, theory
from kvlab.caches import CACHES, KVCache, TupleCache, cache_tensors, make_cache, sliding_windows
from kvlab.compat import cache_argument
from kvlab.configs import build_config
from kvlab.lab.point import measure, run_point
from kvlab.meter import MemoryMeter
from kvlab.models import build_model, final_kv_bytes, kv_bytes_per_token
from kvlab.planner import theory as planned
from kvlab.schema import DESIGNS

CACHE_DOMINATED = dict(batch=4, prompt=64, new=128, timing=False)  # batch 8 gives the same ratios, to 4 digits
GREEDY_TOLERANCE = 0.001  # docs/results.md's claim: theory within 0.1 % of the meter in fp32 ...
TOLERANCE = 0.005  # ... and within 0.5 % in bf16 and with beam search


@pytest.fixture(scope="session")
def cache_dominated(toy):
    return {design: run_point(toy, cache=design[0], loop=design[1], **CACHE_DOMINATED) for design in DESIGNS}


def test_every_cache_dominated_point_is_predicted_within_the_claim(cache_dominated):
    for design, record in cache_dominated.items():
        assert abs(record["prediction_error"]) <= GREEDY_TOLERANCE, (design, record["prediction_error"])


@pytest.mark.parametrize("design", DESIGNS, ids=[f"{cache}-{loop}" for cache, loop in DESIGNS])
def test_bfloat16_points_are_predicted_within_the_claim(design):
    # bf16 is where the loops differ: v4.40/v4.42 upcast every prompt logit to fp32, v5 keeps one position.
    record = run_point(
        preset="toy",
        overrides="num_key_value_heads=2",
        dtype="bfloat16",
        cache=design[0],
        loop=design[1],
        batch=4,
        prompt=64,
        new=32,
        timing=False,
    )
    assert abs(record["prediction_error"]) <= TOLERANCE, record["prediction_error"]


@pytest.mark.parametrize("design", DESIGNS, ids=[f"{cache}-{loop}" for cache, loop in DESIGNS])
def test_a_query_wider_than_the_hidden_size_peaks_in_its_rotary_embedding(design):
    # heads x head_dim = 2 x hidden: on the prompt, q * cos, rotate_half(q) and its product with sin beside q
    # outweigh the MLP (4.2 % below the meter before the theory walked that phase).
    wide = "num_attention_heads=8,num_key_value_heads=2,head_dim=64,intermediate_size=512"
    point = dict(cache=design[0], loop=design[1], batch=2, prompt=64, new=8, dtype="float32")
    record = run_point(preset="toy", overrides=wide, timing=False, **point)
    assert abs(record["prediction_error"]) <= GREEDY_TOLERANCE, record["prediction_error"]
    if design[1] == "v5":  # v4.x's loops peak later, on the logits they keep
        assert planned.breakdown(build_config("toy", wide.split(",")), **point)["peak_at"] == "step 0 (rotary)"


def test_tuple_holds_two_caches_and_one_object_one(cache_dominated, toy):
    layers = toy.config.num_hidden_layers
    assert cache_dominated["tuple", "v4.40"]["overhead_over_kv"] >= 1.99
    # dynamic: one layer's old values alive during its cat, on top of the cache: 1 + 1/(2L), + the rest.
    assert 1 + 1 / (2 * layers) <= cache_dominated["dynamic", "v5"]["overhead_over_kv"] <= 1 + 1 / (2 * layers) + 0.01
    assert cache_dominated["prealloc", "v5"]["overhead_bytes"] <= cache_dominated["dynamic", "v5"]["overhead_bytes"]


def test_the_two_fixes_have_separate_shares_at_step_two():
    # A long prompt, a large vocabulary and few new tokens: v4.40 leaks the prompt's logits into step 2.
    overrides = "vocab_size=32000"
    model = build_model("toy", overrides)
    point = dict(overrides=overrides, batch=2, prompt=256, new=3, timing=False)
    step2 = {}
    for cache in ("tuple", "dynamic"):
        for loop in ("v4.40", "v4.42"):
            record, report = measure(model, cache=cache, loop=loop, **point)
            assert abs(record["prediction_error"]) <= GREEDY_TOLERANCE
            step2[cache, loop] = report.timeline[1].peak_bytes
    logits = 2 * 256 * 32000 * 4  # the prompt's fp32 logits, kept by v4.40
    layer_t = 2 * 4 * 64 * 4  # one layer's keys for one token: batch x heads x dim x fp32
    # v4.42 holds clones of the last position's logits instead (the previous step's, and its own once made):
    # up to two of batch x vocab x fp32, 0.8 % of the prompt's logits.
    clones = 2 * 2 * 32000 * 4
    for cache in ("tuple", "dynamic"):
        assert logits - clones <= step2[cache, "v4.40"] - step2[cache, "v4.42"] <= logits
    # The tuple keeps the whole old cache (256 tokens x 4 layers x K,V) where dynamic keeps one layer's old values.
    assert step2["tuple", "v4.42"] - step2["dynamic", "v4.42"] >= (2 * 4 - 1) * layer_t * 256


def test_v5_computes_no_prompt_logits_where_v4_42_upcasts_them_all():
    # bf16: v4.42's peak holds the prompt's bf16 logits and their fp32 copy; v5 never computes them.
    point = dict(preset="toy", overrides="vocab_size=32000", dtype="bfloat16", batch=2, prompt=256, new=2, timing=False)
    v442 = run_point(cache="dynamic", loop="v4.42", **point)
    v5 = run_point(cache="dynamic", loop="v5", **point)
    prompt_logits = 2 * 256 * 32000 * (2 + 4)  # bf16 and their fp32 copy
    assert v442["overhead_bytes"] >= prompt_logits
    assert v5["overhead_bytes"] < prompt_logits / 10  # not even the bf16 logits of the prompt
    for record in (v442, v5):
        assert abs(record["prediction_error"]) <= GREEDY_TOLERANCE


def test_beam_search_tuple_v4_40_is_about_three_caches(toy):
    point = dict(batch=2, prompt=32, new=64, strategy="beam", num_beams=4, timing=False)
    before = run_point(toy, cache="tuple", loop="v4.40", **point)
    after = run_point(toy, cache="dynamic", loop="v4.42", **point)
    for record in (before, after):
        assert abs(record["prediction_error"]) <= TOLERANCE
    assert before["overhead_over_kv"] >= 2.9 and after["overhead_over_kv"] <= 1.2


@pytest.mark.parametrize("cache", CACHES)
def test_beam_search_of_every_design_is_predicted(toy, cache):
    record = run_point(toy, cache=cache, loop="v5", batch=2, prompt=32, new=40, strategy="beam", timing=False)
    assert abs(record["prediction_error"]) <= TOLERANCE, record["prediction_error"]


def _reorder_transient(make, reorder):
    """Peak bytes above what was live when `reorder` started, for a cache built by `make` under the meter."""
    beam_idx = torch.tensor([1, 0, 3, 2])
    with MemoryMeter("cpu") as meter:
        cache = make()
        meter.reset_peak()
        reorder(cache, beam_idx)
    return meter.report().peak_bytes - meter.allocator.reset_bytes  # the allocator's live bytes at the reset


def test_tuple_reorder_layer_by_layer_needs_one_tensor_not_the_cache():
    layers, shape = 6, (4, 2, 100, 8)
    one_tensor = 4 * 2 * 100 * 8 * 4
    pairs = lambda: TupleCache.from_tuples(
        [(torch.randn(shape), torch.randn(shape)) for _ in range(layers)],  # noqa: E731
        layers,
    )
    assert _reorder_transient(pairs, lambda kv, beam_idx: kv.reorder_cache(beam_idx)) == one_tensor

    # v4.40: `outputs` still holds the step's cache object around the old tensors: the whole cache again.
    def held_by_outputs():
        kv = pairs()
        return kv, KVCache.from_tuples(kv.to_tuples(), layers)

    assert _reorder_transient(held_by_outputs, lambda held, beam_idx: held[0].reorder_cache(beam_idx)) == (
        2 * layers * one_tensor
    )


@pytest.mark.parametrize("cache", ["dynamic", "list", "prealloc", "static"])
def test_cache_reorder_needs_at_most_one_tensor(toy, cache):
    def make():
        kv = make_cache(cache, toy, max_cache_len=40)
        with torch.no_grad():
            toy(input_ids=torch.randint(0, 1000, (4, 30)), use_cache=True, **{cache_argument(toy): kv})
        return kv

    largest = max(t.untyped_storage().nbytes() for t in cache_tensors(make()))
    transient = _reorder_transient(make, lambda kv, beam_idx: kv.reorder_cache(beam_idx))
    assert 0 < transient <= largest


@pytest.mark.slow  # notebook 04 and test_tokens cover the restart in make test
def test_restart_from_a_held_cache_costs_two_to_three_times(toy):
    point = dict(batch=4, prompt=64, new=256, restart_new=64, timing=False)
    before = run_point(toy, cache="tuple", loop="v4.40", **point)
    after = run_point(toy, cache="dynamic", loop="v4.42", **point)
    for record in (before, after):
        assert abs(record["prediction_error"]) <= GREEDY_TOLERANCE
    assert 2 <= before["overhead_bytes"] / after["overhead_bytes"] <= 3


def test_improvement_factors_bracket_the_measured_ratio(cache_dominated, toy):
    minimal, maximal = theory.improvement_factors(toy.config, batch=8, prompt=64, dtype="float32")
    measured = (
        cache_dominated["tuple", "v4.40"]["overhead_bytes"] / cache_dominated["dynamic", "v4.42"]["overhead_bytes"]
    )
    assert 1 <= minimal <= measured <= maximal * 1.001 <= 2.001


def test_improvement_factors_at_the_new_tokens_asked_for(toy):
    """`new` given: the maximal factor is the ratio at that many tokens (it was ignored below 16 x the prompt)."""
    point = dict(batch=2, prompt=64, dtype="float32")
    at = lambda new, cache, loop: theory.predict_overhead(toy.config, new=new, cache=cache, loop=loop, **point)  # noqa: E731
    _, maximal = theory.improvement_factors(toy.config, new=100, **point)
    assert maximal == at(100, "tuple", "v4.40") / at(100, "dynamic", "v4.42")
    assert theory.improvement_factors(toy.config, **point)[1] > maximal  # the limit: the cache dominates


def test_the_terms_theory_names_are_what_the_meter_labels_at_the_peak(toy):
    point = dict(cache="tuple", loop="v4.40", batch=4, prompt=32, new=64)
    record, report = measure(toy, timing=False, **point)
    explained = theory.breakdown(toy.config, **point)
    terms = explained["terms_bytes"]
    assert explained["peak_at"] == "step 63 (mlp)"  # the last step, both tuples complete
    # The meter labels storages as the decode loop names them: both tuples are cache at the peak.
    assert report.at_peak["kv"] == terms["old tuple still referenced"] + terms["cache after the update"]


@pytest.mark.parametrize("cache, loop", [("tuple", "v4.40"), ("dynamic", "v4.42")])
def test_the_previous_cache_at_the_peak_is_what_theory_says_is_still_held(toy, cache, loop):
    """Lesson 02's figure: at the peak, the cache tensors made before the peak's step (the whole old tuple; with one
    cache object, the one tensor its cat is copying) are the theory's terms for them, to the byte; the split of the
    peak adds up to the allocator's peak."""
    point = dict(cache=cache, loop=loop, batch=4, prompt=32, new=64)
    _, report = measure(toy, timing=False, **point)
    terms = theory.breakdown(toy.config, **point)["terms_bytes"]
    held = terms.get("old tuple still referenced", 0) + terms.get("old values tensor during its cat", 0)
    assert report.method == "cpu-allocator" and sum(report.at_peak.values()) == report.peak_bytes
    assert held > 0 and report.previous_kv_bytes == held
    assert report.at_peak["kv"] - report.previous_kv_bytes == terms["cache after the update"]


TWIN_DESIGNS = [("tuple", "v4.40"), ("dynamic", "v4.42"), ("dynamic", "v5"), ("prealloc", "v5")]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama2-7b", "mistral-7b", "llama3-8b"])
def test_each_twin_keeps_the_full_models_ratios(model):
    # Prompt 300 and 8 new tokens: the prompt's forward (activations, logits) sets the peak, where the
    # twin's widths matter most. data/twins/ holds the same check at 500 new tokens for every design.
    point = dict(dtype="bfloat16", batch=2, prompt=300, new=8, timing=False)
    for cache, loop in TWIN_DESIGNS:
        full = run_point(preset=model, device="meta", cache=cache, loop=loop, **point)
        twin = run_point(preset=f"{model}-twin", device="cpu", cache=cache, loop=loop, **point)
        assert twin["overhead_over_kv"] == pytest.approx(full["overhead_over_kv"], rel=0.02), (cache, loop)


def test_restart_from_returned_tuples_holds_the_first_cache_beside_the_growing_one(toy):
    # 4.42's default restart: the caller's tuples keep the first call's tensors (prompt + new - 1 tokens) alive
    # while the second call's cache object grows from them.
    point = dict(batch=2, prompt=16, new=32, restart_new=16, timing=False)
    held_object = run_point(toy, cache="dynamic", loop="v4.42", **point)
    held_tuples = run_point(toy, cache="dynamic", loop="v4.42", restart_from="tuples", **point)
    assert abs(held_tuples["prediction_error"]) <= GREEDY_TOLERANCE
    kv = held_tuples["kv_final_bytes"]
    first_cache = kv * (16 + 32 - 1) // (16 + 32 + 16)
    assert held_tuples["overhead_bytes"] - held_object["overhead_bytes"] == pytest.approx(first_cache, rel=0.01)


def test_the_initialisation_changes_no_byte(toy):
    # kvlab.presets.RANDOM_INIT_STD makes tokens vary; transformers' default std must give the same peaks.
    default_init = build_model("toy", "initializer_range=0.02")
    for cache, loop, strategy in (("tuple", "v4.40", "greedy"), ("dynamic", "v4.42", "beam")):
        point = dict(cache=cache, loop=loop, strategy=strategy, batch=2, prompt=16, new=16, timing=False)
        assert run_point(toy, **point)["overhead_bytes"] == run_point(default_init, **point)["overhead_bytes"]


# data/today (kvlab.waste): transformers' own generate() measured at the 7B and long-context shapes.
TODAY = Path(__file__).resolve().parent.parent / "data" / "today"
GENERATE_OPTIONS = {
    "": {},
    "cache_implementation=static": dict(cache="static"),
    "num_beams=4": dict(strategy="beam", num_beams=4),
}
# docs/results.md's claim for these runs (the issue asks for 1 %): the theory walks kvlab's v5 loop, and 5.24's
# generate() holds a little int64 bookkeeping more (its prefill's copy of the ids; more in beam search)
TODAY_TOLERANCE = 0.002


def test_theory_predicts_every_stored_waste_point_and_its_prealloc_fix():
    table = pd.read_csv(TODAY / "waste.csv", keep_default_na=False)
    for name, rows in table.groupby("point"):
        first = rows.iloc[0]
        config = build_config(first["preset"], first["overrides"].split())  # kvlab.waste writes "key=value key=value"
        point = {
            "cache": "dynamic",
            "loop": "v5",
            "batch": int(first["batch"]),
            "prompt": int(first["prompt"]),
            "new": int(first["new"]),
            "dtype": first["dtype"],
            **GENERATE_OPTIONS[first["generate"]],
        }
        weights = rows.loc[rows["term"] == "weights", "bytes"].item()
        peaks = {point["cache"]: rows.loc[rows["kind"] == "check", "bytes"].item()}  # generate()'s own
        fixed = rows[(rows["kind"] == "fix") & (rows["term"] == "prealloc")]
        peaks.update({"prealloc": fixed["bytes"].item()} if len(fixed) else {})
        for cache, peak in peaks.items():
            predicted = planned.predict_overhead(config, **dict(point, cache=cache))
            assert (peak - weights) / predicted - 1 == pytest.approx(0, abs=TODAY_TOLERANCE), (name, cache)


def test_theory_walks_each_layer_as_the_stored_cache_growth():
    table = pd.read_csv(TODAY / "cache_growth.csv", keep_default_na=False)
    for (preset, overrides), rows in table.groupby(["preset", "overrides"]):
        config = build_config(preset, overrides.split())
        token = kv_bytes_per_token(config, 1, "bfloat16") // config.num_hidden_layers  # one layer's, keys and values
        layers, prompt = planned.Layers(sliding_windows(config)), rows["tokens"].min()
        stored = dict(zip(rows["forward"], rows["cache_storage_bytes"]))
        for forward in range(max(stored) + 1):
            layers.update(prompt if forward == 0 else 1)
            if forward in stored:
                assert token * sum(layers.storage) == stored[forward], (preset, forward)


def test_theory_predicts_every_stored_kvlab_point_within_the_readmes_claim():
    """Every kvlab point measured under data/ (CPU, meta, twins, references, graphs) against today's theory: the
    claim in docs/results.md: 0.08 % where the graph runtime is an exported program and 0.03 % elsewhere."""
    counts = ("batch", "prompt", "new", "restart_new", "num_beams", "chunk_limit", "block_tokens")
    for path in sorted(TODAY.parent.glob("*/results.csv")):
        table = pd.read_csv(path)
        if "overhead_bytes" not in table:  # data/speed: timings only
            continue
        table = table[(table.get("status", "ok") == "ok") & (table.get("kind", "kvlab") == "kvlab")]
        assert len(table), f"{path.parent.name}: no measured kvlab point"  # the claim is about every table
        for index, row in table.iterrows():
            point = {
                key: int(row[key]) if key in counts else row[key]
                for key in schema.POINT_KEYS
                if key in row and pd.notna(row[key])
            }
            overrides = row["overrides"] if pd.notna(row["overrides"]) else None  # as the record keeps them: "k=v,k=v"
            # kvlab.planner.theory: kvlab.theory's walk, and the exported program's phases (data/graphs)
            predicted = planned.predict_overhead(build_config(row["preset"], overrides), **point)
            error = row["overhead_bytes"] / predicted - 1
            claim = 0.0008 if row.get("runtime") == "export" else 0.0003
            assert abs(error) <= claim, (path.parent.name, index, error)


def test_every_stored_record_divides_by_the_final_kv_of_models():
    """The final KV that point and reference records store (and overhead_over_kv divides by) is
    models.final_kv_bytes at prompt + new + restart_new tokens, sliding layers included."""
    checked = set()
    for path in sorted(TODAY.parent.glob("*/results.csv")):
        table = pd.read_csv(path)
        if "kv_final_bytes" not in table:
            continue
        for _, row in table[table["kv_final_bytes"].notna()].iterrows():
            overrides = row["overrides"] if pd.notna(row["overrides"]) else None
            tokens = int(row["prompt"]) + int(row["new"]) + int(row.get("restart_new", 0) or 0)
            expected = final_kv_bytes(
                build_config(row["preset"], overrides), int(row["batch"] * row["num_beams"]), tokens, row["dtype"]
            )
            assert row["kv_final_bytes"] == expected, (path.parent.name, row["preset"], row["kv_final_bytes"])
            checked.add(path.parent.name)
    assert {"cpu", "meta", "twins", "reference"} <= checked  # the tables that store a final KV were read


def test_the_lessons_walk_is_the_planners_on_its_points_and_refuses_the_rest(toy):
    """kvlab.theory walks lessons 01-03's points (greedy, one call, full attention, the eager runtime, CPU or meta,
    transformers' own designs) as kvlab.planner.theory does, whose extensions add nothing there; a point beyond them
    is refused with the module that walks it."""
    point = dict(batch=2, prompt=40, new=6, dtype="float32")
    own = ("list", "prealloc")  # kvlab's own designs (kvlab.designs), which the planner walks
    for cache, loop in schema.DESIGNS:
        for device in ("cpu", "meta"):
            design = dict(point, cache=cache, loop=loop, device=device)
            if cache not in own:
                assert theory.breakdown(toy.config, **design) == planned.breakdown(toy.config, **design), design
    beyond = [dict(strategy="beam"), dict(strategy="sample"), dict(restart_new=4), dict(device="cuda")]
    runtimes = [dict(runtime="jit-trace", cache="tuple"), dict(runtime="convert"), dict(runtime="export")]
    for other in beyond + runtimes + [dict(cache=cache, loop="v5") for cache in own]:
        with pytest.raises(ValueError, match="kvlab.planner.theory"):
            theory.breakdown(toy.config, **point, **other)
    # a sliding window (Mistral-7B v0.1's), under every design the lesson's walk follows
    sliding = build_config("mistral-7b", ["sliding_window=4096"])
    for cache in theory.WALKED:
        with pytest.raises(ValueError, match="sliding-window attention: kvlab.planner.theory"):
            theory.breakdown(sliding, **point, cache=cache, loop="v4.42")
