"""predict's fast dry run (kvlab.planner.fast) against the whole model's dry run (`exact=True`, itself held against
CPU runs in tests/test_dry_run.py): within 1 % for every design, on small configs of each layout with more layers
than the cut keeps (dense, sliding, MoE, latent attention, linear-attention and Mamba hybrids), and of a prompt
of several of the gated delta rule's chunks; the steps the bulk skipping keeps hold the peak of a CPU run that
decodes every step; and a short scan (kvlab.planner.scans) counts what the whole one does."""

import importlib
from pathlib import Path

import pytest
import torch
import transformers
from test_architectures import RUN, SIZES
from test_dry_run import DESIGNS, runnable
from transformers import AutoConfig

from kvlab.caches import forward
from kvlab.decoding import decoding
from kvlab.loops import generate
from kvlab.meter import MemoryMeter
from kvlab.models import random_prompt
from kvlab.planner.dry_run import ForwardRule, bulk_plan, cache_options
from kvlab.planner.fast import FastDryRun, peak_step
from kvlab.planner.meta import MetaAsCpu
from kvlab.planner.params import normalize
from kvlab.planner.plan import point_of, predict
from kvlab.planner.scans import ITERATIONS, SCANS, _reference, short_scans, shortened
from kvlab.planner.sources import build_model

MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16, mamba_n_groups=1)
# Each layout with more layers than the cut keeps (two of each kind, and one more), in the order its model has.
LAYOUTS = {
    "llama": dict(num_hidden_layers=6),
    "gemma3_text": dict(num_hidden_layers=8, sliding_window=12, head_dim=16),  # 5 sliding, 1 full, 2 sliding
    "qwen3_moe": dict(num_hidden_layers=5, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "deepseek_v3": dict(RUN["deepseek_v3"], num_hidden_layers=6, first_k_dense_replace=2),
    "qwen3_next": dict(
        RUN["qwen3_next"],
        num_hidden_layers=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"] * 1 + ["linear_attention"] * 3 + ["full_attention"],
    ),
    "bamba": dict(MAMBA, num_hidden_layers=7, attn_layer_indices=[2, 5]),
}
POINT = dict(batch=2, prompt=40, new=30, block_tokens=8, chunk_limit=5)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast")
    for model_type, extra in LAYOUTS.items():
        (root / model_type).mkdir()
        AutoConfig.for_model(model_type, **{**SIZES, **extra}).to_json_file(root / model_type / "config.json")
    return {model_type: str(root / model_type) for model_type in LAYOUTS}


@pytest.mark.parametrize("model_type", LAYOUTS)
@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_the_fast_dry_run_is_within_1_percent_of_the_whole_models(folders, model_type, strategy):
    point = dict(preset=folders[model_type], strategy=strategy, num_beams=3, dry_run=True, **POINT)
    fast = {(d["cache"], d["loop"]): d for d in predict(**point)["designs"]}
    exact = {(d["cache"], d["loop"]): d for d in predict(**point, exact=True)["designs"]}
    designs = [design for design in DESIGNS if runnable(model_type, design[0], strategy) and design in exact]
    assert designs and set(fast) == set(exact)
    for design in designs:
        f, e = fast[design], exact[design]
        assert (
            abs(f["predicted_overhead_bytes"] - e["predicted_overhead_bytes"]) <= 0.01 * e["predicted_overhead_bytes"]
        ), design
        assert f["cache_tokens_per_layer"] == e["cache_tokens_per_layer"], design
        assert f["kv_final_bytes"] == e["kv_final_bytes"]


@pytest.mark.parametrize("model_type", ["gemma3_text", "deepseek_v3", "qwen3_next"])
@pytest.mark.parametrize("cache, loop", [("list", "v5"), ("prealloc", "v5"), ("list", "v4.42")])
def test_the_bulk_skippings_kept_steps_hold_a_cpu_runs_peak(folders, model_type, cache, loop):
    """On CPU, every step decoded: the highest step is one the bulk dry run runs the forward at (ForwardRule, asked
    of the cache before the step), and its plan (bulk_plan) finds those steps."""
    model = build_model(folders[model_type])
    rule = ForwardRule(POINT["new"], POINT["block_tokens" if cache == "prealloc" else "chunk_limit"])
    kept = set()

    def every_step(step, model, kv, **inputs):
        if rule(step, kv):
            kept.add(step)
        return forward(model, kv, **inputs)

    prompt = random_prompt(256, POINT["batch"], POINT["prompt"], 0)
    options = dict(block_tokens=POINT["block_tokens"], chunk_limit=POINT["chunk_limit"])
    with MemoryMeter("cpu", model) as meter:
        generate(model, prompt, POINT["new"], cache=cache, loop=loop, strategy=decoding("greedy"), meter=meter,
                 cache_options=options, step_forward=every_step)  # fmt: skip
    peaks = {step.step: step.peak_bytes for step in meter.report().timeline}
    assert len(kept) < len(peaks) - 15  # the claim skips most steps
    assert max(peaks[step] for step in kept) == max(peaks.values())
    # the bulk dry run's plan, from a stand-in cache, keeps the steps the run's own cache says
    options = dict(options, max_cache_len=POINT["prompt"] + POINT["new"] - 1)
    assert bulk_plan(model, cache, POINT["prompt"], POINT["new"], options).kept == kept


def _scan_modules() -> list[str]:
    """The modeling modules of the installed transformers that define a scan kvlab.planner.scans shortens."""
    models = Path(transformers.__file__).parent / "models"
    return sorted(
        f"transformers.models.{path.parent.name}.{path.stem}"
        for path in models.glob("*/modeling_*.py")
        if any(f"def {name}(" in path.read_text() for name in SCANS)
    )


@pytest.mark.parametrize("module", _scan_modules())
def test_a_short_scan_counts_what_the_whole_one_does(module):
    """On meta, under the meter: each scan run for ITERATIONS of its chunks against the whole scan (4 chunks, the
    last padded), from no state and from a cache's: the same peak, the same bytes live after, the same outputs.
    The head sizes make the chunks' loop hold the peak, so a scan cut shorter than the argument allows fails."""
    functions = importlib.import_module(module)
    for name in SCANS:
        whole = _reference(getattr(functions, name))
        assert whole is not None

        def count(scan, state: bool):
            with MetaAsCpu(), MemoryMeter("meta") as meter:
                q, k = (torch.empty((1, 200, 1, 256), dtype=torch.bfloat16, device="meta") for _ in range(2))
                v = torch.empty((1, 200, 2, 256), dtype=torch.bfloat16, device="meta")
                g, beta = torch.empty((1, 200, 2), device="meta"), torch.empty((1, 200, 2), device="meta")
                initial = torch.empty((1, 2, 256, 256), device="meta") if state else None
                out = scan(q, k, v, g=g, beta=beta, initial_state=initial, output_final_state=True)
                outputs = [(t.shape, t.dtype) for t in out]
                live = meter.live_bytes()
            return meter.report().peak_bytes, live, outputs

        for state in (False, True):
            assert count(shortened(whole, ITERATIONS), state) == count(whole, state), (name, state)
        assert count(shortened(whole, ITERATIONS - 1), True) != count(whole, True)  # the loop holds the peak


def test_the_short_scans_are_the_fast_dry_runs_alone(folders):
    """short_scans puts each modeling module's own function back after its block; the exact dry run runs it."""
    from transformers.models.qwen3_next import modeling_qwen3_next as functions

    model = build_model(folders["qwen3_next"], device="meta")
    own = functions.torch_chunk_gated_delta_rule
    with short_scans(model):
        assert functions.torch_chunk_gated_delta_rule is not own
    assert functions.torch_chunk_gated_delta_rule is own


# A prompt of 4 chunks of the gated delta rule's 64 tokens (the last padded): the fast dry run scans two of them.
LONG = dict(POINT, prompt=200)


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_the_fast_dry_run_of_a_prompt_of_several_chunks(folders, strategy):
    point = dict(preset=folders["qwen3_next"], strategy=strategy, num_beams=3, dry_run=True, **LONG)
    fast = {(d["cache"], d["loop"]): d for d in predict(**point)["designs"]}
    exact = {(d["cache"], d["loop"]): d for d in predict(**point, exact=True)["designs"]}
    assert set(fast) == set(exact) and len(exact) > 3
    for design, e in exact.items():
        f = fast[design]
        assert (
            abs(f["predicted_overhead_bytes"] - e["predicted_overhead_bytes"]) <= 0.01 * e["predicted_overhead_bytes"]
        )
        assert f["cache_tokens_per_layer"] == e["cache_tokens_per_layer"], design


@pytest.mark.parametrize("model_type", LAYOUTS)
@pytest.mark.parametrize("strategy", ["greedy", "sample"])  # beam search's reorders: the runs answer
def test_a_layers_shares_stand_in_for_the_runs_with_a_layer_more(folders, model_type, strategy):
    """The first cut's shares (kvlab.planner.fast.Shares) give, for every design, the report the other cuts' runs
    give (each a layer more of a kind), or none where they cannot (a share taken before its layer's forward ended,
    a layer holding other than its cache)."""
    p = normalize(target=True, preset=folders[model_type], strategy=strategy, num_beams=3, device="cpu", **POINT)
    walk = FastDryRun(p)
    used = 0
    for cache, loop in DESIGNS:
        if not runnable(model_type, cache, strategy) or (cache == "tuple" and model_type in ("qwen3_next", "bamba")):
            continue
        design = point_of(p, cache=cache, loop=loop)
        plan = bulk_plan(walk.cut.models[0], cache, p["prompt"], p["new"], cache_options(design))
        left_out = walk._left_out(design, plan)
        first, _, shares = walk._run(walk.cut.models[0], design, plan, walk.cut.watched)
        runs = [first] + [walk._run(model, design, plan)[0] for model in walk.cut.models[1:]]
        extra = walk.cut.increments(first, shares)
        if extra is not None:
            used += 1
            mine, whole = (walk.cut.extrapolate(reports, left_out) for reports in ([first, *extra], runs))
            assert (mine.timeline, mine.peak_bytes) == (whole.timeline, whole.peak_bytes), design
            if len({peak_step(report) for report in [mine, *runs]}) == 1:  # else the runs' split mixes steps
                assert mine.at_peak == whole.at_peak, design
    assert used or len(walk.cut.models) == 1
