"""Decoding through a graph (kvlab.graphs): tokens as transformers' generate(), the graph meter against an
independent witness, theory against measurement, conversion costs, and bad input refused in one line."""

import json
import subprocess
import sys

import pytest
import torch

from kvlab.graphs import VARIANTS, build_graphs, check_runtime, decode_variant, generate_graph, time_variants
from kvlab.graphs.conversion import conversion_cost, random_tuples, to_cache, to_tuples
from kvlab.graphs.meter import ProfilerMeter
from kvlab.lab.point import run_point
from kvlab.meter import LiveStorageCounter, MemoryMeter
from kvlab.models import assert_varied
from kvlab.planner.params import normalize
from kvlab.profiler import ProfiledAllocations

GRAPHS = ("jit-trace", "convert", "export")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def reference(model, prompt, new):
    out = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new, do_sample=False
    )
    assert_varied(out[:, prompt.shape[1] :])  # equal tokens mean something only if they vary
    return out


@pytest.mark.parametrize("runtime", GRAPHS)
def test_every_runtime_decodes_what_generate_does(toy, toy_gqa, prompt, runtime):
    # The decode graph is traced at one cache length and run at every later one; export has one program.
    for model in (toy, toy_gqa):
        expected = reference(model, prompt, 24)
        tokens = generate_graph(model, prompt, 24, runtime).tokens
        assert torch.equal(tokens, expected), model.config.num_key_value_heads


@pytest.mark.slow  # beyond the lesson's guarantees: make test-all
def test_graphs_built_for_one_prompt_length_decode_another(toy, prompt):
    # A graph is built from shapes; the tokens it runs on are new values (here: another prompt of the same shape).
    other = torch.randint(0, 1000, prompt.shape, generator=torch.Generator().manual_seed(9))
    for runtime in ("jit-trace", "export"):
        graphs = build_graphs(toy, prompt, 10, runtime)
        assert torch.equal(generate_graph(toy, other, 10, runtime, graphs).tokens, reference(toy, other, 10))


def test_bfloat16_graphs_decode_what_generate_does(toy_bf16, prompt):
    expected = reference(toy_bf16, prompt, 8)
    for runtime in ("jit-trace", "convert"):
        assert torch.equal(generate_graph(toy_bf16, prompt, 8, runtime).tokens, expected), runtime


@pytest.mark.slow  # beyond the lesson's guarantees: make test-all
def test_bfloat16_exported_logits_within_one_bf16_step_of_the_eager_forward(toy_bf16, prompt):
    # The exported program rounds differently from the eager forward (not from kvlab: transformers' own
    # exportable module run eagerly differs the same way): a logit may move by one bf16 step (2**-7 near 1),
    # which flips exact near-ties of random weights. Token equality is claimed in float32 (tests above).
    graphs = build_graphs(toy_bf16, prompt, 4, "export")
    generate_graph(toy_bf16, prompt, 1, "export", graphs)  # fresh buffers, then the prompt once more:
    from kvlab.graphs import _fresh_cache_buffers

    _fresh_cache_buffers(graphs.prefill)
    with torch.no_grad():
        exported = graphs.prefill(input_ids=prompt, cache_position=torch.arange(prompt.shape[1]))[:, -1].float()
        eager = toy_bf16(prompt, attention_mask=torch.ones_like(prompt)).logits[:, -1].float()
    step = 2.0**-7 * 2 ** torch.ceil(torch.log2(eager.abs().clamp_min(2**-6)))  # one bf16 step at each value
    assert bool(((exported - eager).abs() <= step).all())


def test_the_traced_step_passes_tuples_and_the_conversion_copies_in_and_not_out(toy, prompt):
    graphs = build_graphs(toy, prompt, 4, "jit-trace")
    assert isinstance(graphs.decode, torch.jit.ScriptModule)
    out = generate_graph(toy, prompt, 4, "jit-trace", graphs)
    assert isinstance(out.cache, tuple) and all(isinstance(t, torch.Tensor) for t in out.cache)
    tuples = random_tuples(2, 2, 2, 5, 4)
    cache = to_cache(tuples)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(tuples[0], (cache.layers[0].keys, cache.layers[0].values)))
    assert all(
        a.data_ptr() == b.data_ptr()
        for a, b in zip(to_tuples(cache)[1], (cache.layers[1].keys, cache.layers[1].values))
    )


# -- the meter ------------------------------------------------------------------------------------


def test_the_live_storage_counter_cannot_run_inside_a_traced_graph(toy, prompt):
    graphs = build_graphs(toy, prompt, 3, "jit-trace")
    with pytest.raises(RuntimeError):
        with MemoryMeter("cpu", toy) as meter:
            generate_graph(toy, prompt, 3, "jit-trace", graphs, meter=meter)


@pytest.mark.parametrize("runtime", ["convert", "export"])
def test_profiler_meter_agrees_with_the_counter(toy, prompt, runtime):
    # Python-visible runtimes: the same decode under both meters, peak and every step's live bytes.
    graphs = build_graphs(toy, prompt, 12, runtime)
    with ProfilerMeter(toy) as profiled:
        generate_graph(toy, prompt, 12, runtime, graphs, meter=profiled)
    with MemoryMeter("cpu", toy) as counted:
        generate_graph(toy, prompt, 12, runtime, graphs, meter=counted)
    p, c = profiled.report(), counted.report()
    assert p.method == "profiler" and c.method == "cpu-allocator"
    assert abs(p.overhead_bytes / c.overhead_bytes - 1) < 0.01
    assert len(p.timeline) == len(c.timeline) == 12
    for a, b in zip(p.timeline, c.timeline):
        assert abs(a.live_bytes - b.live_bytes) <= 0.01 * b.live_bytes
        assert abs(a.peak_bytes - b.peak_bytes) <= 0.01 * b.peak_bytes
    assert max(step.peak_bytes for step in p.timeline) == p.overhead_bytes


def test_traced_graph_measured_by_the_profiler_as_its_eager_source_by_the_counter(toy, prompt):
    # The counter cannot enter TorchScript; the untraced TupleStep runs the same ops eagerly, where it can.
    traced = build_graphs(toy, prompt, 12, "jit-trace")
    eager = build_graphs(toy, prompt, 12, "jit-trace", trace=False)
    with ProfilerMeter(toy) as profiled:
        generate_graph(toy, prompt, 12, "jit-trace", traced, meter=profiled)
    with MemoryMeter("cpu", toy) as counted:
        generate_graph(toy, prompt, 12, "jit-trace", eager, meter=counted)
    assert abs(profiled.report().overhead_bytes / counted.report().overhead_bytes - 1) < 0.01


def test_profiler_meter_on_known_allocations():
    with ProfilerMeter() as meter:
        a = torch.ones(1000)
        meter.step()
        b = torch.ones(3000)
        del a
        meter.step()
        del b
    report = meter.report()
    assert report.method == "profiler" and report.peak_bytes == 4000 * 4
    assert [(s.live_bytes, s.peak_bytes) for s in report.timeline] == [(4000, 4000), (12000, 16000)]


# -- theory and the claims of appendix A9 --------------------------------------------------------

TWIN = dict(preset="llama2-7b-twin", batch=2, prompt=24, new=24, timing=False)


@pytest.fixture(scope="session")
def twin_records():
    return {variant: run_point(runtime=variant[0], cache=variant[1], **TWIN) for variant in VARIANTS}


def test_theory_within_3_percent_of_every_variant_on_the_toy():
    for runtime, cache in VARIANTS:
        record = run_point(runtime=runtime, cache=cache, preset="toy", batch=2, prompt=16, new=8, timing=False)
        assert abs(record["prediction_error"]) < 0.03, (runtime, record["prediction_error"])


@pytest.mark.slow
def test_theory_within_3_percent_of_every_variant(twin_records):
    for variant, record in twin_records.items():
        assert abs(record["prediction_error"]) < 0.03, (variant, record["prediction_error"])


@pytest.mark.slow
def test_the_claims_of_notebook_05(twin_records):
    ratio = {variant: record["overhead_over_kv"] for variant, record in twin_records.items()}
    assert ratio[("jit-trace", "tuple")] >= 1.9  # tuples in and out: the <= 4.41 pattern again
    assert ratio[("convert", "dynamic")] >= ratio[("jit-trace", "tuple")]
    assert ratio[("eager", "dynamic")] < 1.1
    exported = twin_records[("export", "static")]
    assert exported["meter"] == "profiler" and twin_records[("jit-trace", "tuple")]["meter"] == "profiler"
    assert twin_records[("convert", "dynamic")]["meter"] == "cpu-allocator"


def test_exported_static_cache_is_its_preallocation_plus_one_step(toy, prompt):
    # The program's buffers are written in place: after the run they hold every token, and the peak
    # is the buffers plus the largest step's transients (the prompt's), never a second cache.
    graphs = build_graphs(toy, prompt, 10, "export")
    with ProfilerMeter(toy) as meter:
        out = generate_graph(toy, prompt, 10, "export", graphs, meter=meter)
    buffers = sum(t.untyped_storage().nbytes() for t in out.cache)
    timeline = meter.report().timeline
    prompt_step = timeline[0].peak_bytes - buffers
    # K,V x layers x batch x heads x length x dim x fp32, and each layer's int64 length counter
    assert buffers == 2 * 4 * 3 * 4 * (12 + 10 - 1) * 64 * 4 + 4 * 8
    assert meter.report().overhead_bytes == timeline[0].peak_bytes  # the prompt's step is the peak
    # Every later step writes its token in place: it allocates less than one layer's keys beyond the buffers.
    assert max(step.peak_bytes for step in timeline[1:]) - buffers < buffers / (2 * 4)
    assert 0 < prompt_step < buffers  # one step's transients, not a second cache


# -- conversion ----------------------------------------------------------------------------------


def test_conversion_cost_counted_and_checked_by_the_profiler():
    tuples = random_tuples(4, 2, 2, 64, 8)
    cost = conversion_cost(tuples, repeats=1)
    assert cost["cache_bytes"] == 2 * 4 * 2 * 2 * 64 * 8 * 4
    assert cost["to_cache_copies"] and cost["to_tuples_views"]
    assert cost["to_cache_peak_bytes"] == cost["cache_bytes"] and cost["to_tuples_peak_bytes"] == 0
    with ProfiledAllocations() as profiled:
        kept = to_cache(tuples)
    assert profiled.peak_bytes == cost["cache_bytes"]
    with LiveStorageCounter() as counter:
        back = to_tuples(kept)
    assert counter.peak_bytes == 0 and back[0][0] is kept.layers[0].keys


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(runtime="export", cache="dynamic"), "cannot carry the 'dynamic' cache"),
        (dict(runtime="jit-trace", cache="prealloc"), "use cache='tuple'"),
        (dict(runtime="convert", cache="static"), "use cache='dynamic'"),
        (dict(runtime="jit"), "eager, jit-trace, convert, export"),
        (dict(runtime="export", strategy="beam"), "greedily only"),
        (dict(runtime="jit-trace", loop="v4.40"), "loop='v5'"),
        (dict(runtime="convert", restart_new=4), "without a restart"),
    ],
)
def test_bad_runtime_input_is_refused_in_one_line(params, message):
    with pytest.raises(ValueError, match=message) as error:
        normalize(**params)
    assert "\n" not in str(error.value)


def test_a_runtime_given_without_a_cache_measures_the_one_the_readme_names_for_it():
    # The table of runtimes (docs/graphs.md): what each carries when none is named, as measured on a small point.
    carried = {"eager": "dynamic", "jit-trace": "tuple", "convert": "dynamic", "export": "static"}
    for runtime, cache in carried.items():
        record = run_point(runtime=runtime, preset="toy", batch=2, prompt=8, new=4, timing=False)
        assert (record["runtime"], record["cache"]) == (runtime, cache)
        assert abs(record["prediction_error"]) < 0.03, (runtime, record["prediction_error"])
    check_runtime("eager", "list", "v4.40", "beam")  # eager carries everything


def test_decode_variant_runs_the_eager_references(toy, prompt):
    for cache in ("dynamic", "prealloc"):
        assert torch.equal(decode_variant(toy, prompt, 6, "eager", cache).tokens, reference(toy, prompt, 6))


def test_time_variants_keeps_every_repeat_and_its_median(toy, prompt):
    variants = (("eager", "dynamic"), ("convert", "dynamic"))
    every = time_variants(toy, prompt, 2, variants=variants, repeats=3, every=True)
    assert list(every) == list(variants) and all(len(times) == 3 and min(times) > 0 for times in every.values())
    median = time_variants(toy, prompt, 2, variants=variants[:1], repeats=1)
    assert set(median) == {variants[0]} and median[variants[0]] > 0


@pytest.mark.slow  # the CLI around the runtimes: machinery, for make test-all
def test_cli_measures_a_runtime_and_refuses_a_design_it_cannot_carry():
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "kvlab", "measure", *args], capture_output=True, text=True, timeout=300
        )

    refused = run("--runtime", "export", "--cache", "dynamic")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "cannot carry the 'dynamic' cache" in refused.stderr and "Traceback" not in refused.stderr
    measured = run("--runtime", "jit-trace", "--batch", "2", "--prompt", "8", "--new", "4", "--json", "--no-timing")
    assert measured.returncode == 0, measured.stderr
    record = json.loads(measured.stdout.strip().splitlines()[-1])
    assert (record["runtime"], record["cache"], record["meter"]) == ("jit-trace", "tuple", "profiler")
    assert record["kv_at_peak_bytes"] is None and record["graph_build_seconds"] > 0


def test_the_gpu_sweep_is_valid_and_its_7b_points_are_predicted_as_on_the_twins():
    from kvlab.configs import build_config
    from kvlab.lab.grid import expand, load_sweep, validate
    from kvlab.planner import theory

    points = validate(expand(*load_sweep("gpu-graphs")), devices_here=False)
    assert all(p["device"] == "cuda" for p in points)
    for preset in ("llama2-7b", "mistral-7b"):  # every variant of appendix A9 once at each 7B shape
        assert sorted((p["runtime"], p["cache"]) for p in points if p["preset"] == preset) == sorted(VARIANTS)
    for preset in ("llama2-7b", "mistral-7b"):
        config = build_config(preset)
        point = dict(batch=8, prompt=300, new=500, dtype="bfloat16")
        ratio = {
            runtime: theory.breakdown(config, runtime=runtime, cache=cache, **point)["overhead_over_kv"]
            for runtime, cache in VARIANTS
            if runtime != "eager"
        }
        assert ratio["jit-trace"] >= 1.9 and ratio["convert"] >= ratio["jit-trace"], ratio
        # export: its buffers (prompt + new - 1 tokens) plus the prompt's step (Mistral's MLP is 3.5x wider)
        exported = theory.breakdown(config, runtime="export", cache="static", **point)
        buffers = exported["terms_bytes"]["static cache buffers"]
        assert buffers == exported["kv_final_bytes"] * 799 // 800 and exported["peak_at"] == "step 0 (mlp)"
        assert ratio["export"] < ratio["jit-trace"] - 0.7, ratio


@pytest.mark.slow  # beyond the lesson's guarantees: make test-all
def test_graphs_refuse_a_batch_or_length_they_were_not_built_for(toy, prompt):
    # An exported static cache holds prompt + new - 1 tokens; a longer decode would write past its end.
    for runtime in ("jit-trace", "export"):
        graphs = build_graphs(toy, prompt, 4, runtime)
        assert torch.equal(
            generate_graph(toy, prompt[:, :-1], 5, runtime, graphs).tokens, reference(toy, prompt[:, :-1], 5)
        )  # as many cached tokens: fine
        for ids, new in ((prompt, 5), (prompt[:, :-1], 6), (prompt[:2], 4), (torch.cat([prompt, prompt]), 4)):
            with pytest.raises(ValueError, match="^graphs built for runtime .* cannot decode") as error:
                generate_graph(toy, ids, new, runtime, graphs)
            assert len(str(error.value).splitlines()) == 1
