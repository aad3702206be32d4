"""A plan for a CUDA GPU made on a machine without one: held against GPU measurements (data/design/h200.csv,
data/design/h100.json) and against byte counts worked out by hand from the shapes and PyTorch's sources."""

import csv
import json
from pathlib import Path

import pytest
import torch

import kvlab
from kvlab.configs import build_config
from kvlab.planner import theory

DESIGN = Path(__file__).resolve().parents[1] / "data" / "design"
GIB, MIB = 2**30, 2**20
HOPPER_WORKSPACE = 4096 * 8 * 1024  # CublasHandlePool.cpp's default on compute capability 9.0: 32 MiB


@pytest.fixture
def no_gpu_read(monkeypatch):
    """A prediction asks no CUDA question of this machine (on a machine with a GPU too)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a prediction read this machine's GPU")

    for name in ("is_available", "mem_get_info", "get_device_properties", "device_count"):
        monkeypatch.setattr(torch.cuda, name, refuse)


def h200_rows():
    return list(csv.DictReader((DESIGN / "h200.csv").open()))


@pytest.mark.parametrize("row", h200_rows(), ids=lambda r: f"{r['preset']}-{r['cache']}-{r['loop']}")
def test_a_cuda_plan_is_within_1_percent_of_the_h200_rows(row, no_gpu_read):
    """Each H200 row (transformers' own generate(), bf16, batch 8, prompt 300, 500 new) predicted for cuda here.

    The rows were measured by a harness outside this repository (data/design/provenance.json) in which cuBLAS's
    workspace already existed at the post-load baseline: a fresh process counts its 32 MiB in the overhead
    (data/design/h100.json, the long-prompt point: exactly 32 MiB above the tensors), these rows do not (with it
    the Mistral rows would be 1.7 % and 3.8 % above). So the tensors are held against the rows: the plan less the
    workspace. The rows ran transformers 5.17 and this test the installed release: 5.18+ passes no all-ones mask,
    at most batch x (prompt + new) int64s = 51,200 bytes, under 0.01 % of the smallest row; no row has a sliding
    layer, the one other thing that release changes."""
    result = kvlab.predict(
        row["preset"],
        device="cuda",
        cache=row["cache"],
        loop=row["loop"],
        batch=int(row["batch"]),
        prompt=int(row["prompt"]),
        new=int(row["new"]),
        dtype=row["dtype"],
    )
    [design] = result["designs"]
    assert result["device"] == "cuda" and result["arch"] == "hopper"
    assert design["terms_bytes"][theory.CUBLAS_TERM] == HOPPER_WORKSPACE
    tensors = design["predicted_overhead_bytes"] - HOPPER_WORKSPACE
    measured = float(row["overhead_gib"]) * GIB
    assert abs(tensors / measured - 1) <= 0.01, (tensors / GIB, row["overhead_gib"])


def test_a_cuda_plan_is_within_1_percent_of_an_h100_run_in_a_fresh_process(no_gpu_read):
    """Llama-3-8B, bf16, batch 1, prompt 32768, 16 new, dynamic/v5, measured by kvlab measure on one H100 (kvlab's
    loop and transformers 5.17's own generate() alike): the overhead includes cuBLAS's workspace. The installed
    release passes no all-ones mask (5.18+): 32784 int64s fewer, under 0.01 %."""
    point = json.loads((DESIGN / "h100.json").read_text())["point"]
    keys = ("batch", "prompt", "new", "cache", "loop", "dtype", "strategy")
    result = kvlab.predict(point["preset"], device="cuda", **{key: point[key] for key in keys})
    predicted = result["designs"][0]["predicted_overhead_bytes"]
    for measured in (point["kvlab_overhead_bytes"], point["reference_overhead_bytes"]):
        assert abs(predicted / measured - 1) <= 0.01, (predicted, measured)


LONG_PROMPT = dict(cache="dynamic", loop="v5", batch=1, prompt=32768, new=16, dtype="bfloat16")


def test_a_cuda_plan_and_a_cpu_plan_differ_by_the_terms_each_device_allocates():
    """Llama-3-8B's attention over a 32768-token prompt: the CPU (16 threads) runs its flash kernel, a Hopper GPU
    cuDNN's (no mask, bf16). Every other term is the same tensor on both, a multiple of 512 bytes here."""
    config = build_config("llama3-8b")
    cpu = theory.phase_terms(config, 0, "attention", threads=16, device="cpu", **LONG_PROMPT)
    cuda = theory.phase_terms(config, 0, "attention", device="cuda", **LONG_PROMPT)
    # CPU flash: per thread a 256-query block's fp32 scores against a 512-key block, its row maxima and sums and an
    # output block, and the scores in bf16 (ATen's cpu_flash_attention); its logsumexp: fp32 per head and query.
    scratch = 16 * ((256 * 512 + 2 * 256 + 256 * 128) * 4 + 256 * 512 * 2)
    dropped = {"SDPA: flash kernel's scratch, a block per thread": scratch, "SDPA: logsumexp (fp32)": 32 * 32768 * 4}
    # cuDNN: no mask to copy, three small tensors (data/design/h100.json); cuBLAS's workspace.
    added = {"SDPA (cuDNN): the mask as a float, and three small tensors": 3 * 512, theory.CUBLAS_TERM: 32 * MIB}
    changed = {name for name in {*cpu, *cuda} if cpu.get(name) != cuda.get(name)}
    assert changed == {*dropped, *added, "SDPA: float copy of the mask"} and cpu["SDPA: float copy of the mask"] == 0
    assert {name: cpu[name] for name in dropped} == dropped and {name: cuda[name] for name in added} == added
    assert sum(cuda.values()) - sum(cpu.values()) == sum(added.values()) - sum(dropped.values())


def test_a_gpu_other_than_hopper_runs_flash_with_its_logsumexp_and_a_smaller_workspace():
    config = build_config("llama3-8b")
    terms = theory.phase_terms(config, 0, "attention", device="cuda", arch="other", **LONG_PROMPT)
    assert terms["SDPA (flash): logsumexp (fp32)"] == 32 * 32768 * 4  # mha_fwd's softmax_lse
    assert terms[theory.CUBLAS_TERM] == 2 * 4 * MIB + 8 * 16 * 1024  # ":4096:2:16:8"


def test_fits_counts_the_cuda_context_and_names_the_device(capsys, no_gpu_read):
    from kvlab.cli import main
    from kvlab.cuda_memory import CUDA_CONTEXT

    point = dict(cache="dynamic", loop="v5", batch=8, prompt=300, new=500, dtype="bfloat16")
    row = kvlab.predict("llama2-7b", **point)["designs"][0]  # no device named: cuda
    # A memory between the peak and the peak + the context: the peak alone would fit, with the context it does not.
    for memory, fits in ((row["peak_bytes"] + CUDA_CONTEXT - 1, False), (row["peak_bytes"] + CUDA_CONTEXT, True)):
        assert kvlab.predict("llama2-7b", memory=memory, **point)["designs"][0]["fits"] is fits
    args = ["--preset", "llama2-7b", "--batch", "8", "--prompt", "300", "--new", "500", "--dtype", "bfloat16"]
    main(["predict", *args, "--cache", "dynamic", "--loop", "v5", "--memory", "80GiB", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["device"] == "cuda" and result["device_is_default"] and result["cuda_context_bytes"] == CUDA_CONTEXT
    assert result["designs"][0]["reserved_estimate_bytes"] >= result["designs"][0]["predicted_overhead_bytes"]
    main(["predict", *args, "--device", "cuda", "--memory", "80GiB"])
    out = capsys.readouterr().out
    assert "planned for: cuda, a Hopper GPU" in out and "CUDA context: 0.669 GiB" in out
    assert "reserved by the caching allocator at the peak" in out


def test_a_cpu_plan_takes_its_threads_as_an_input():
    """A CPU of 4096 threads (a block of flash scratch each), not this machine's: at batch 8 and a 4096-token prompt
    their scratch makes the attention Llama-3-8B's peak."""
    point = dict(device="cpu", cache="dynamic", loop="v5", dtype="bfloat16", prompt=4096, new=2)
    result = kvlab.predict("llama3-8b", threads=4096, **point)
    row = result["designs"][0]
    per_thread = (256 * 512 + 2 * 256 + 256 * 128) * 4 + 256 * 512 * 2  # as above, one block per thread
    assert row["peak_at"] == "step 0 (attention)"
    assert row["terms_bytes"]["SDPA: flash kernel's scratch, a block per thread"] == 4096 * per_thread
    assert result["threads"] == 4096 and "planned for: cpu, a CPU of 4096 torch threads" in str(result)
    assert kvlab.predict("llama3-8b", **point)["threads"] == torch.get_num_threads()  # the default: this machine's


@pytest.mark.parametrize(
    "options, why",
    [
        (dict(device="tpu"), "unknown device 'tpu' to plan for"),
        (dict(device="cpu", threads=0), "threads must be a positive integer"),
        (dict(device="cuda", threads=4), "threads are a CPU's"),
        (dict(arch="ampere"), "unknown GPU architecture 'ampere'"),
        (dict(device="meta", arch="hopper"), "a GPU architecture is a CUDA target's"),
    ],
)
def test_a_target_is_checked_where_it_enters(options, why):
    with pytest.raises(ValueError, match=why):
        kvlab.predict("toy", **options)


def test_the_dry_run_for_a_cuda_target_allocates_as_cuda_not_as_a_cpu(tmp_path):
    """GPT-2 (no theory), bf16, a 512-token prompt on meta, as a 64-thread CPU and as a GPU other than Hopper: both run
    a flash kernel without a mask (transformers passes none without padding) and keep its fp32 logsumexp; the
    CPU's scratch is gone on the GPU, whose peak carries cuBLAS's workspace instead."""
    from transformers import GPT2Config

    GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=64, n_positions=1024).to_json_file(tmp_path / "config.json")
    point = dict(batch=1, prompt=512, new=2, cache="dynamic", loop="v5", dtype="bfloat16", dry_run=True)
    cpu = kvlab.predict(str(tmp_path), device="cpu", threads=64, **point)["designs"][0]
    cuda = kvlab.predict(str(tmp_path), device="cuda", arch="other", **point)["designs"][0]
    # ATen's cpu_flash_attention, per thread: 512 queries take blocks of 64 rows; fp32 scores against 512 keys, row
    # maxima and sums, an output block, and the scores in bf16.
    scratch = 64 * ((64 * 512 + 2 * 64 + 64 * 16) * 4 + 64 * 512 * 2)
    workspace = 2 * 4 * MIB + 8 * 16 * 1024
    assert cuda["terms_bytes"][theory.CUBLAS_TERM] == workspace
    # The CPU's peak is its attention with the scratch on top; without it the GPU's peak is another op's, or the
    # same attention less the scratch: never below that, and below the CPU's.
    tensors = cuda["predicted_overhead_bytes"] - workspace
    assert cpu["predicted_overhead_bytes"] - scratch <= tensors < cpu["predicted_overhead_bytes"]
