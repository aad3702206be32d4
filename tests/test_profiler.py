"""The live-storage counter against an independent witness: PyTorch's profiler (c10's CPU allocator events).

First the profiler meter on known allocations, then the two meters on decodes of every cache design,
then each blind spot of the counter: what it sees against what the profiler sees.
"""

import io
import threading

import numpy as np
import pytest
import torch
from transformers import AutoConfig

import kvlab.designs  # noqa: F401 (registers kvlab's own designs, list and prealloc, with make_cache)
from kvlab.caches import CACHES
from kvlab.explain import explain, generate_call
from kvlab.loops import LOOPS, generate
from kvlab.meter import LiveStorageCounter, MemoryMeter
from kvlab.models import random_prompt
from kvlab.planner import theory
from kvlab.planner.sources import build_model
from kvlab.profiler import ProfiledAllocations, profiler_peak

F32 = 4

ENDS = (list(LOOPS)[0], list(LOOPS)[-1])  # the oldest loop and the newest (LOOPS: in release order)


def both(fn):
    """(peak, live at the end) as the counter and as the profiler see two separate runs of `fn`."""
    with LiveStorageCounter() as counter:
        kept = fn()
        counted = counter.peak_bytes, counter.live_bytes
    del kept
    with ProfiledAllocations() as profiled:
        kept = fn()
    del kept
    return counted, (profiled.peak_bytes, profiled.live_bytes)


# -- the profiler meter on known allocations ------------------------------------------------------


def test_profiler_meter_on_known_allocations():
    older = torch.ones(5000)  # from before the region: its free inside is not an allocation of the region

    def run():
        a, b, c = torch.ones(1000), torch.ones(2000), torch.ones(3000)
        del b
        d = torch.cat([a, c])  # 4000 new while a and c live
        del a, c, d

    with ProfiledAllocations() as profiled:
        run()
        del older
    assert profiled.peak_bytes == (1000 + 3000 + 4000) * F32
    assert profiled.live_bytes == 0
    assert [nbytes for _, nbytes in profiled.events] == [4000, 8000, 12000, -8000, 16000, -4000, -12000, -16000]
    assert profiler_peak(run) == (1000 + 3000 + 4000) * F32


def test_a_block_from_an_earlier_profile_is_not_freed_twice():
    with ProfiledAllocations():
        survivor = torch.ones(1000)
    with ProfiledAllocations() as profiled:
        del survivor  # c10 remembers its size from the first profile and reports the free
        newer = torch.ones(500)
    assert (profiled.peak_bytes, profiled.live_bytes) == (500 * F32, 500 * F32)
    del newer


# -- the two meters on decodes ---------------------------------------------------------------------


@pytest.mark.parametrize("loop", ENDS)
@pytest.mark.parametrize("cache", CACHES)
def test_the_meter_reads_the_allocator_the_profiler_exports_on_a_decode(toy, cache, loop, one_thread):
    """The meter reads c10's events from the profiler's event tree; kvlab.profiler from its exported trace, in a
    separate run of the same decode (the counter beside the meter adds its own few bytes: 1 %). The tensors the
    counter sees are a part of what the allocator holds, on any CPU."""
    prompt = torch.randint(0, toy.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with MemoryMeter("cpu", toy) as meter:
        generate(toy, prompt, 24, meter=meter, cache=cache, loop=loop)
    with ProfiledAllocations() as profiled:
        generate(toy, prompt, 24, cache=cache, loop=loop)
    report = meter.report()
    assert report.method == "cpu-allocator" and report.overhead_bytes > 0
    assert abs(profiled.peak_bytes - report.overhead_bytes) <= 0.01 * profiled.peak_bytes, profiled.peak_bytes
    assert 0 < report.storages_peak_bytes <= report.overhead_bytes


# -- blind spots of the counter ---------------------------------------------------------------------


def test_python_scalars_and_casts_inside_a_kernel():
    x = torch.ones(1000)
    counted, profiled = both(lambda: x * 2.0)
    # The argument parser wraps 2.0 in a 0-dim float64 tensor (8 bytes) and mul casts it to float32
    # (4 bytes) inside its kernel; both die before the op returns, and no op outputs them.
    assert counted == (1000 * F32, 1000 * F32)
    assert profiled == (1000 * F32 + 8 + 4, 1000 * F32)


def test_attention_under_inference_mode_is_one_op(one_thread):
    q = torch.randn(2, 4, 64, 32)
    with torch.inference_mode():
        counted, profiled = both(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q))
    # The mode sees scaled_dot_product_attention's output only; the flash kernel's logsumexp and scratch are
    # allocated below it. Under no_grad (below) the kernel is dispatched itself.
    assert counted == (q.numel() * F32, q.numel() * F32)
    assert profiled[0] > counted[0] + 2 * 4 * 64 * F32


# -- the one kernel whose scratch is counted: CPU flash attention, under no_grad -------------------------

# (batch, heads, kv heads, queries, keys, head size, dtype, bool mask, threads): each query-block size (32, 64,
# 256 rows), a key block shorter than the keys, one query against a cache, grouped heads, a mask, two threads.
FLASH_SHAPES = [
    (2, 4, 4, 64, 64, 32, torch.float32, False, 1),
    (2, 8, 2, 64, 64, 16, torch.float32, True, 2),
    (2, 8, 8, 300, 300, 64, torch.float32, False, 1),
    (2, 8, 8, 1, 300, 64, torch.float32, True, 1),
    (1, 4, 4, 800, 800, 64, torch.float32, False, 1),
    (2, 8, 8, 300, 600, 64, torch.float32, True, 1),
]
# bf16 adds a scratch copy of the scores; a CPU with AVX-512 or AMX may also pack the keys, which is not modelled.
if torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2"):
    FLASH_SHAPES += [(2, 8, 8, 300, 300, 64, torch.bfloat16, True, 1), (2, 8, 8, 1, 300, 64, torch.bfloat16, False, 1)]


@pytest.mark.parametrize("shape", FLASH_SHAPES, ids=str)
def test_the_flash_kernels_scratch_is_counted(shape):
    batch, heads, kv_heads, queries, keys, head_size, dtype, masked, threads = shape
    q = torch.randn(batch, heads, queries, head_size, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, keys, head_size, dtype=dtype) for _ in range(2))
    mask = torch.ones(batch, 1, queries, keys, dtype=torch.bool).tril(keys - queries) if masked else None
    causal = not masked and queries == keys
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            counted, profiled = both(
                lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=kv_heads != heads
                )
            )
    finally:
        torch.set_num_threads(before)
    assert counted == profiled


def test_the_math_paths_softmax_scratch_is_counted():
    scores = torch.randn(2, 4, 64, 64)
    scores[0, 0, 3] = -torch.inf  # a fully masked row: the case _safe_softmax exists for
    with torch.no_grad():
        counted, profiled = both(lambda: torch.ops.aten._safe_softmax(scores, -1))
    assert counted == profiled


# -- where SDPA holds the peak of generate(): the two meters, then the theory --------------------------------

# Tiny configs whose peak is inside SDPA (batch 2, prompt 64, 32 new): Mistral with a 16-token window (SDPA gets a
# bool mask and grouped heads: the CPU flash kernel on a float copy of the mask) and DeepSeek-V3 (MLA: query-key
# and value head sizes differ, so SDPA takes its math path: the whole scores and their softmax).
SDPA_PEAKS = {
    "mistral": (
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, intermediate_size=128, sliding_window=16),
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
    ),
    "deepseek_v3": (
        dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
             kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
             n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1),
        "aten._safe_softmax.default",
    ),
}  # fmt: skip
SDPA_POINT = dict(batch=2, prompt=64, new=32)


def sdpa_model(tmp_path, model_type):
    sizes, _ = SDPA_PEAKS[model_type]
    config = dict(num_hidden_layers=2, hidden_size=64, vocab_size=1000, max_position_embeddings=256, pad_token_id=0)
    AutoConfig.for_model(model_type, **config, **sizes).to_json_file(tmp_path / "config.json")
    return build_model(str(tmp_path / "config.json"))


@pytest.mark.parametrize("model_type", SDPA_PEAKS)
def test_counter_and_profiler_agree_where_sdpa_holds_the_peak(model_type, tmp_path, one_thread):
    model = sdpa_model(tmp_path, model_type)
    ids = random_prompt(model.config.vocab_size, SDPA_POINT["batch"], SDPA_POINT["prompt"], 0)
    run = generate_call(model, ids, SDPA_POINT["new"])  # transformers' own generate()
    with torch.no_grad(), MemoryMeter("cpu", model) as meter:
        run()
    with torch.no_grad(), ProfiledAllocations() as profiled:
        run()
    with torch.no_grad():
        assert explain(run, model=model).op == SDPA_PEAKS[model_type][1]  # the peak is where this test means it
    # The counter, with the flash kernel's and the softmax's scratch counted from their shapes, to the byte of the
    # allocator in a separate run: their scratch is all these kernels allocate that no output keeps (fp32).
    report = meter.report()
    assert report.storages_peak_bytes == profiled.peak_bytes
    assert abs(report.overhead_bytes / profiled.peak_bytes - 1) <= 0.01  # the meter, with the counter's own bytes


def test_theory_follows_the_allocator_inside_sdpa(tmp_path, one_thread):
    """kvlab's dynamic/v5 loop and transformers' own generate() on the windowed Mistral config, under the profiler,
    against the theory: its attention phase holds SDPA's float mask, logsumexp and flash scratch."""
    model = sdpa_model(tmp_path, "mistral")
    ids = random_prompt(model.config.vocab_size, SDPA_POINT["batch"], SDPA_POINT["prompt"], 0)
    point = dict(SDPA_POINT, cache="dynamic", loop="v5", dtype="float32")
    predicted = theory.breakdown(model.config, **point)
    assert predicted["peak_at"] == "step 0 (attention)"
    with torch.no_grad():
        peaks = {
            "kvlab": profiler_peak(lambda: generate(model, ids, point["new"], cache="dynamic", loop="v5")),
            "generate()": profiler_peak(generate_call(model, ids, point["new"])),
        }
    for whose, peak in peaks.items():
        assert abs(predicted["predicted_overhead_bytes"] / peak - 1) <= 0.01, (whose, peak, predicted)


def test_storages_built_without_an_op():
    buffer = io.BytesIO()
    torch.save(torch.ones(1000), buffer)

    def load():
        buffer.seek(0)
        return torch.load(buffer)

    assert both(load) == ((0, 0), (1000 * F32, 1000 * F32))
    made = both(lambda: torch.empty(0).set_(torch.UntypedStorage(1000 * F32)))
    assert made == ((0, 0), (1000 * F32, 1000 * F32))


def test_memory_torch_did_not_allocate():
    array = np.ones(1000, dtype=np.float32)
    for wrap in (lambda: torch.from_numpy(array), lambda: torch.frombuffer(bytearray(4000), dtype=torch.float32)):
        assert both(wrap) == ((0, 0), (0, 0))  # numpy's and Python's buffers


def test_tensors_made_in_another_thread():
    made = []

    def in_a_thread():
        worker = threading.Thread(target=lambda: made.append(torch.ones(1000)))
        worker.start()
        worker.join()

    # Both meters are per thread: the dispatch mode's stack and the profiler's memory reporting.
    assert both(in_a_thread) == ((0, 0), (0, 0))
    assert sum(t.nbytes for t in made) == 2 * 1000 * F32


def test_frees_of_older_tensors_are_not_subtracted():
    older = torch.ones(1000)
    with LiveStorageCounter() as counter:
        del older  # frees 4000 bytes allocated before the region
        newer = torch.ones(1000)
    older = torch.ones(1000)
    with ProfiledAllocations() as profiled:
        del older
        newer = torch.ones(1000)
    # The process holds no more than at the start, yet both report the bytes the region allocated.
    assert counter.peak_bytes == profiled.peak_bytes == 1000 * F32
    del newer
