"""The analytic peak for the device planned for: kvlab.theory's walk, extended to a CUDA GPU and to transformers'
exported program. The walk (kvlab.theory) counts tensors on the CPU and meta; on CUDA the kernel SDPA picks adds
what it allocates inside (kvlab.cuda_memory.sdpa_terms), every term becomes a block of the caching allocator, and
cuBLAS's workspace joins once the first matrix product has run. The exported static-cache program (kvlab.graphs,
runtime export) has phases of its own (`_exported_peak`).

The same signatures as kvlab.theory's, with the GPU's architecture (`arch`, kvlab.cuda_memory.ARCHES) beside the
CPU's threads: `peak_phases`, `phase_terms`, `predict_overhead`, `breakdown`.
"""

from __future__ import annotations

from functools import partial

from ..counts import final_kv_bytes
from ..cuda_memory import block, cublas_workspace, reserved_estimate, sdpa_backend, sdpa_terms
from ..theory import (
    FP32,
    INT64,
    CacheWalk,
    Run,
    Shape,
    Step,
    design_point,
    explained,
    largest_phase,
    run_of,
    terms_at,
    walk_phases,
)

CUBLAS_TERM = "cuBLAS workspace (the process's first matrix product allocates it)"


def peak_phases(config, threads: int | None = None, arch: str = "hopper", **point):
    """kvlab.theory.peak_phases on any device and runtime: (peak, the phase that makes it, its terms, final KV,
    tokens each layer's storage holds at the end). On CUDA what the kernel SDPA picks on a GPU of `arch` allocates,
    every term a block of the caching allocator and cuBLAS's workspace (`_on_cuda`)."""
    p = design_point(point)
    cuda = _on_a_gpu(p)
    if p["runtime"] == "export":
        s = Shape(config, p["batch"], p["dtype"], p["strategy"], p["num_beams"])
        peak, where, terms, held = _exported_peak(s, p["prompt"], p["new"])
        if cuda:
            terms = _on_cuda(terms, arch, matrix_products_ran=True)
        kv_final = final_kv_bytes(config, s.rows, p["prompt"] + p["new"], p["dtype"])
        return sum(terms.values()), where, terms, kv_final, held
    r = run_of(config, p, threads)
    walk = CacheWalk(r)
    kv_final = final_kv_bytes(config, r.s.rows, r.max_len, p["dtype"])
    return (*largest_phase(_device_phases(r, walk, arch)), kv_final, walk.held_tokens())


def phase_terms(config, step: int, phase: str, threads: int | None = None, arch: str = "hopper", **point) -> dict:
    """The terms of one phase of one step (`peak_phases` keeps the largest), e.g. a long prompt's attention."""
    r = run_of(config, design_point(point), threads)
    return terms_at(_device_phases(r, CacheWalk(r), arch), step, phase)


def predict_overhead(config, threads: int | None = None, arch: str = "hopper", **point) -> int:
    """The predicted peak bytes above the weights for one point (see `peak_phases`)."""
    return int(peak_phases(config, threads, arch, **point)[0])


def breakdown(config, threads: int | None = None, arch: str = "hopper", **point) -> dict:
    """kvlab.theory.breakdown on any device; on CUDA also the bytes the allocator reserves for the peak's blocks
    (kvlab.cuda_memory.reserved_estimate: an estimate, a floor)."""
    total, where, terms, kv_final, held = peak_phases(config, threads, arch, **point)
    reserved = reserved_estimate([v for v in terms.values() if v]) if _on_a_gpu(design_point(point)) else None
    return explained(total, where, terms, kv_final, held, reserved)


def _on_a_gpu(p: dict) -> bool:
    return str(p["device"]).startswith("cuda")


def _device_phases(r: Run, walk: CacheWalk, arch: str):
    """kvlab.theory.walk_phases; on CUDA with SDPA's kernel terms and each phase as the allocator counts it."""
    if r.device != "cuda":
        yield from walk_phases(r, walk)
        return
    r.gpu_kernel = partial(_cuda_sdpa, arch)
    for step, name, terms in walk_phases(r, walk):
        # the first forward's mask is built before its first matrix product
        yield step, name, _on_cuda(terms, arch, matrix_products_ran=step.index > 0 or name != "mask")


def _cuda_sdpa(arch: str, r: Run, step: Step, masked: bool, grouped: bool) -> dict:
    """What the SDPA call allocates inside on a GPU of `arch`: the kernel it picks (kvlab.cuda_memory.sdpa_terms)."""
    s = r.s
    backend = sdpa_backend(arch, s.e, s.head_dim, masked, grouped)
    mask = r.mask_rows * step.fed * step.keys if masked else 0  # the bool mask's elements: (rows, 1, fed, keys)
    return sdpa_terms(backend, s.rows, s.heads, step.fed, step.keys, s.head_dim, s.e, mask)


def _on_cuda(terms: dict, arch: str, matrix_products_ran: bool) -> dict:
    """A phase's terms as the CUDA caching allocator counts them: each a block rounded up to 512 bytes (a term that
    sums several tensors is rounded once: at most 511 bytes per tensor under the allocator's count), and cuBLAS's
    workspace once the first matrix product has run (kvlab.cuda_memory)."""
    terms = {name: block(int(value)) for name, value in terms.items()}
    if matrix_products_ran:
        terms[CUBLAS_TERM] = cublas_workspace(arch)
    return terms


def _exported_peak(s: Shape, prompt: int, new: int):
    """transformers' exported static-cache program (kvlab.graphs, runtime export), greedy, one program for
    the prompt and every step. Its buffers (prompt + new - 1 tokens) are written in place. The program is
    an FX graph that frees each intermediate after its last use (the embeddings too, unlike the eager
    forward); it returns every fed position's logits, and with a static cache the attention gets a mask,
    so grouped-query models run SDPA on repeat_kv copies of the whole buffer."""
    held, static_len = s.kv(prompt + new - 1), prompt + new - 1
    groups = s.heads // s.kv_heads
    copies = 2 * groups * s.t * static_len if groups > 1 else 0
    best = (-1, None, None)
    last = prompt + new - 1
    for index, fed, length in ((0, prompt, prompt), (new - 1, 1, last)):
        base = {"static cache buffers": held, "tokens (int64)": s.rows * length * INT64}
        if index:
            base["previous step's next-token logits (fp32)"] = s.rows * s.vocab * FP32
        residual = s.rows * fed * s.hidden * s.e
        phases = {
            "attention": {
                "repeat_kv copies of one layer (masked SDPA)": copies,
                "residual stream, q, k and v": residual + s.rows * fed * (s.heads + 2 * s.kv_heads) * s.head_dim * s.e,
            },
            "mlp": {"gate, up and their product": 3 * s.rows * fed * s.intermediate * s.e, "residual stream": residual},
            "lm_head": {"logits of every fed position": s.rows * fed * s.vocab * s.e, "final hidden states": residual},
        }
        for name, terms in phases.items():
            terms = {**base, **terms}
            total = sum(terms.values())
            if total > best[0]:
                best = (total, f"step {index} ({name})", terms)
    return best[0], best[1], best[2], [last] * s.layers
