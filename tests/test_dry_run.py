"""The dry run: kvlab's loop on the meta device with CPU's SDPA and masks (kvlab.planner.meta.MetaAsCpu), the
forward run only at the steps that can hold the peak (kvlab.planner.dry_run.peak_steps). Two claims, each against
full CPU runs: the skipped steps never hold the peak (their timelines), and the meta count is the CPU's (within 8
bytes: a 0-dim scalar or two)."""

import contextlib
import itertools

import pytest
import torch
from test_architectures import RUN, SIZES
from transformers import AutoConfig

from kvlab.caches import CatLayer, KVCache, SlidingCatLayer
from kvlab.decoding import decoding
from kvlab.designs import ListLayer, PreallocLayer, WindowLayer
from kvlab.lab.point import run_point
from kvlab.loops import generate
from kvlab.meter import MemoryMeter
from kvlab.models import random_prompt
from kvlab.planner.dry_run import advance, advance_bulk, peak_steps
from kvlab.planner.meta import KnownShapes, MetaAsCpu
from kvlab.planner.plan import predict
from kvlab.planner.sources import build_model

# A window shorter than the run, latent attention, linear attention beside full, KV sharing: the tiny configs of
# tests/test_architectures.py, the windows shortened to 12.
CONFIGS = {
    "mistral": dict(sliding_window=12),
    "deepseek_v3": RUN["deepseek_v3"],
    "qwen3_next": RUN["qwen3_next"],
    "gemma3n_text": dict(RUN["gemma3n_text"], sliding_window=12),
}
# Short reallocation periods, so that a run of 30 steps has several of each (prealloc's blocks and window moves,
# list's consolidations).
POINT = dict(batch=2, prompt=20, new=30, block_tokens=8, chunk_limit=5)
DESIGNS = [("tuple", "v4.40"), ("dynamic", "v4.40"), ("dynamic", "v5"), ("list", "v5"), ("static", "v5")]
DESIGNS += [("prealloc", "v5"), ("tuple", "v4.42"), ("list", "v4.42")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dry_run")
    for model_type, extra in CONFIGS.items():
        (root / model_type).mkdir()
        AutoConfig.for_model(model_type, **{**SIZES, **extra}).to_json_file(root / model_type / "config.json")
    return {model_type: str(root / model_type) for model_type in CONFIGS}


def runnable(model_type, cache, strategy):
    """tuple holds no layer of another kind; on meta, static decodes greedy only (kvlab.planner.params)."""
    return not (cache == "tuple" and model_type in ("qwen3_next", "gemma3n_text")) and not (
        cache == "static" and strategy == "beam"
    )


# make test: one design per layout; the rest under make test-all.
QUICK = {("mistral", "prealloc"), ("deepseek_v3", "list"), ("qwen3_next", "dynamic")}
CASES = [
    pytest.param(
        model_type,
        cache,
        loop,
        strategy,
        marks=() if (model_type, cache) in QUICK and loop != "v4.42" else pytest.mark.slow,
    )
    for model_type, (cache, loop), strategy in itertools.product(CONFIGS, DESIGNS, ("greedy", "beam"))
    if runnable(model_type, cache, strategy)
]


@pytest.mark.parametrize("model_type, cache, loop, strategy", CASES)
def test_the_skipped_steps_never_hold_the_peak(folders, model_type, cache, loop, strategy):
    """On CPU, every step decoded: the highest step is one peak_steps keeps."""
    model = build_model(folders[model_type])
    prompt = random_prompt(256, POINT["batch"], POINT["prompt"], 0)
    options = dict(block_tokens=POINT["block_tokens"], chunk_limit=POINT["chunk_limit"])
    with MemoryMeter("cpu", model) as meter:
        generate(model, prompt, POINT["new"], cache=cache, loop=loop, strategy=decoding(strategy, 3), meter=meter,
                 cache_options=dict(options, max_cache_len=POINT["prompt"] + POINT["new"] - 1))  # fmt: skip
    peaks = {step.step: step.peak_bytes for step in meter.report().timeline}
    kept = peak_steps(cache, POINT["new"], **options)
    assert len(kept) < len(peaks) - 10  # the claim skips most steps
    assert max(peaks[step] for step in kept) == max(peaks.values())


@pytest.mark.parametrize("model_type, cache, loop, strategy", CASES)
def test_a_dry_run_counts_what_a_cpu_run_allocates(folders, model_type, cache, loop, strategy):
    point = dict(preset=folders[model_type], cache=cache, loop=loop, strategy=strategy, num_beams=3, **POINT)
    cpu = run_point(**point, timing=False)
    (row,) = predict(**point, dry_run=True, exact=True, device="cpu")["designs"]  # the CPU it runs on; the whole
    # model's dry run (tests/test_fast.py holds the fast one against it)
    assert row["peak_at"].endswith("(dry run on meta)")
    assert abs(row["predicted_overhead_bytes"] - cpu["overhead_bytes"]) <= 8
    meta = run_point(**point, device="meta", timing=False)  # measure on meta: the same dry run
    assert meta["overhead_bytes"] == row["predicted_overhead_bytes"]
    # what the peak holds, as the CPU run labels it: the skipped steps' cache is the cache too
    assert abs(meta["kv_at_peak_bytes"] - cpu["kv_at_peak_bytes"]) <= 8


def test_meta_answers_yes_or_no_only(folders):
    """A number read off a meta tensor still fails: the dry run never guesses a length or an index."""
    from kvlab.planner.meta import MetaAsCpu

    with MetaAsCpu(), pytest.raises(RuntimeError, match="meta"):
        torch.ones(3, dtype=torch.long, device="meta").sum().item()
    with MetaAsCpu():
        assert bool(torch.ones(3, device="meta").eq(1).all())


LAYERS = {  # each design's layer, windows and periods short: a window of 12 in 12 - 1 + 8 slots
    "window": lambda: WindowLayer(12, block_tokens=8),
    "list": lambda: ListLayer(chunk_limit=5),
    "prealloc": lambda: PreallocLayer(block_tokens=8),
    "sliding cat": lambda: SlidingCatLayer(12),
    "cat": CatLayer,
}


def _state(layer) -> dict:
    """What a layer holds and where it stands: each tensor's shape and storage size, and its plain counters."""

    def described(value):
        if isinstance(value, torch.Tensor):
            return value.shape, value.dtype, value.untyped_storage().nbytes()
        if isinstance(value, list):
            return [described(item) for item in value]
        return value if isinstance(value, (int, bool, type(None))) else type(value)

    return {key: described(value) for key, value in vars(layer).items()}


@pytest.mark.parametrize("grow", [advance, advance_bulk])
@pytest.mark.parametrize("prompt", [5, 20])
@pytest.mark.parametrize("design", LAYERS)
def test_the_skipped_steps_growth_leaves_each_layer_as_its_updates_do(design, prompt, grow):
    """advance (a list layer appended without the join its update returns) and advance_bulk (a window layer
    looped only until its phase repeats, too) against the layer's own update, a token at a time: the same
    tensors, positions and counts."""
    token = lambda n: torch.empty((2, 3, n, 4), device="meta")  # noqa: E731
    for tokens in (1, 7, 8, 9, 13, 40):
        grown, each = KVCache([LAYERS[design]()]), KVCache([LAYERS[design]()])
        for cache in (grown, each):
            cache.layers[0].update(token(prompt), token(prompt))
        grow(grown, tokens)
        for _ in range(tokens):
            each.layers[0].update(token(1), token(1))
        assert _state(grown.layers[0]) == _state(each.layers[0]), tokens


def test_known_shapes_answer_as_the_meta_kernels_do(folders):
    """A dry run answered from KnownShapes' memory (a second run, every op seen before) counts what one run by the
    meta kernels alone counts, step by step: the new tensors' shapes and storages, and the storages an op shares
    with its input (`_unsafe_view`'s schema claims a new tensor) counted once."""
    model = build_model(folders["deepseek_v3"], device="meta")
    ids = torch.empty((POINT["batch"], POINT["prompt"]), dtype=torch.long, device="meta")

    def timeline(*modes):
        with contextlib.ExitStack() as stack:
            for mode in (MetaAsCpu(), *modes):
                stack.enter_context(mode)
            meter = stack.enter_context(MemoryMeter("meta", model))
            generate(model, ids, 6, cache="list", loop="v5", strategy=decoding("beam", 3), meter=meter,
                     cache_options=dict(chunk_limit=3))  # fmt: skip
        return meter.report().timeline

    KnownShapes.answers.clear()
    kernels = timeline()
    assert timeline(KnownShapes()) == kernels  # learning
    assert KnownShapes.answers
    assert timeline(KnownShapes()) == kernels  # answering
    with KnownShapes():
        x = torch.empty((4, 6), device="meta")
        for _ in range(2):
            assert torch.ops.aten._unsafe_view(x, (24,)).untyped_storage()._cdata == x.untyped_storage()._cdata
