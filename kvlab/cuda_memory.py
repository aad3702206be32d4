"""What a CUDA GPU adds to the bytes kvlab.theory counts, read from PyTorch 2.11's and transformers' sources for a
plan made on any machine (nothing here asks the local machine): which SDPA kernel a call runs and what it allocates,
the caching allocator's block rounding and segments, cuBLAS's workspace and the CUDA context.

Checked on a GPU (data/design/h100.json, one H100, torch 2.11.0+cu130, transformers 5.17.0): the 512-byte blocks, the
2 MiB / 20 MiB segments and the 2 MiB rounding of a large one, the 32 MiB workspace of a Hopper GPU allocated by the
first matrix product (inside the overhead a fresh process measures), the context's size, and a long-prompt point
(flash's path); data/design/h200.csv checks the walk on flash's path. Not checked on a GPU: the memory-efficient and
math paths' terms, the workspace of other architectures, the reserved estimate.
"""

from __future__ import annotations

import math

MIB = 2**20
FP32 = 4
TORCH = "https://github.com/pytorch/pytorch/blob/v2.11.0"
TRANSFORMERS = "https://github.com/huggingface/transformers/blob/v5.17.0"

# c10/cuda/CUDACachingAllocator.cpp (`kMinBlockSize`, `kSmallSize`, `kSmallBuffer`, `kMinLargeAlloc`, `kLargeBuffer`,
# `kRoundLarge`, `round_size`, `get_allocation_size`): every block is rounded up to 512 bytes, and the peak of
# max_memory_allocated counts the rounded sizes; a block of at most 1 MiB is cut from a 2 MiB segment, one under
# 10 MiB from a 20 MiB segment, a larger one gets a segment of its size rounded up to 2 MiB.
ALLOCATOR = f"{TORCH}/c10/cuda/CUDACachingAllocator.cpp"
BLOCK = 512
SMALL, SMALL_SEGMENT = MIB, 2 * MIB
LARGE, LARGE_SEGMENT, ROUND_LARGE = 10 * MIB, 20 * MIB, 2 * MIB

# aten/src/ATen/cuda/CublasHandlePool.cpp (`parseChosenWorkspaceSize`, `getNewWorkspace`, `setWorkspaceForHandle`):
# the first cuBLAS call of a (handle, stream) allocates the workspace through the caching allocator and keeps it for
# the process: 4096 x 8 KiB on compute capability 9.0 (Hopper), ":4096:2:16:8" (2 x 4 MiB + 8 x 16 KiB) elsewhere.
# No forward runs between the model's load and the meter's baseline (kvlab.lab.point.measure, kvlab.lab.reference),
# so a fresh process counts it in its overhead (data/design/h100.json: exactly 32 MiB above the tensors).
CUBLAS = f"{TORCH}/aten/src/ATen/cuda/CublasHandlePool.cpp"
CUBLAS_WORKSPACE = {"hopper": 4096 * 8 * 1024, "other": 4096 * 1024 * 2 + 16 * 1024 * 8}
ARCHES = tuple(CUBLAS_WORKSPACE)

# The CUDA context (driver state, kernels' modules, cuBLAS's handle): device memory the caching allocator never
# sees, so no allocator statistic shows it. Measured as total - free - reserved after one matrix product on one
# H100 (CUDA 13.0, torch 2.11: data/design/h100.json); it depends on the driver, the CUDA version, the
# architecture and the libraries loaded: a few hundred MiB, approximate.
CUDA_CONTEXT = 718_077_952

# aten/src/ATen/native/transformers/cuda/sdp_utils.cpp: the order flash, memory-efficient, math, unless
# `check_prefer_cudnn_attention` puts cuDNN first: compute capability 9.x or 10.x (Hopper, Blackwell) with the
# cuDNN that the CUDA 13 wheels ship (> 9.15), no TORCH_CUDNN_SDPA_DEPRIORITIZED (data/design/h100.json: cuDNN ran
# every bf16 call on an H100, masked or grouped too). cuDNN and flash take fp16/bf16 only; flash takes no attn_mask
# and a head size up to 256; memory-efficient takes a mask and fp32 but not grouped-query heads; math the rest.
# transformers' sdpa_attention.py (`use_gqa_in_sdpa`, `repeat_kv`) passes enable_gqa only without a mask and repeats
# the keys and values otherwise, so a masked call has one head count for the three.
SDP_UTILS = f"{TORCH}/aten/src/ATen/native/transformers/cuda/sdp_utils.cpp"
SDPA_ATTENTION = f"{TRANSFORMERS}/src/transformers/integrations/sdpa_attention.py"
FLASH_API = f"{TORCH}/aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp"
ATTENTION = f"{TORCH}/aten/src/ATen/native/transformers/attention.cpp"
CUDNN_SMALL = 3 * BLOCK  # three small tensors a cuDNN call allocates beside its output (data/design/h100.json)


def sdpa_backend(arch: str, element_size: int, head_dim: int, masked: bool, grouped: bool) -> str:
    """The kernel CUDA's SDPA runs for transformers' call: "cudnn", "flash", "efficient" or "math" (SDP_UTILS).
    `grouped`: the call passes fewer key heads than query heads (enable_gqa)."""
    if element_size == 2 and arch == "hopper":
        return "cudnn"
    if not masked and element_size == 2 and head_dim <= 256:
        return "flash"
    return "math" if grouped else "efficient"


def sdpa_terms(backend: str, rows: int, heads: int, fed: int, keys: int, head_dim: int, e: int, mask: int) -> dict:
    """What the SDPA call allocates on CUDA beside its output, in inference (no logsumexp is asked for): `mask`, the
    elements of the bool mask it is given (0: none).
    - cuDNN: the mask as a float of the input dtype (ATTENTION, `convert_boolean_attn_mask_cudnn`) and three small
      tensors (data/design/h100.json: mask elements x 2 + 1,536 bytes at every masked shape measured);
    - flash: the logsumexp, fp32 per (row, head, query), which `mha_fwd` always allocates (FLASH_API, softmax_lse);
    - memory-efficient: the bool mask goes to the kernel as given (ATTENTION): nothing counted (0 bytes measured
      beside the output of an fp32 call without a mask);
    - math (ATTENTION, `_scaled_dot_product_attention_math`): the keys and values repeated for enable_gqa, the
      scaled query and keys, the float causal mask, the scores and their softmax (within 0.01 % of an H100's fp32
      grouped call, data/design/h100.json)."""
    if backend == "cudnn":
        return {"SDPA (cuDNN): the mask as a float, and three small tensors": mask * e + CUDNN_SMALL}
    if backend == "flash":
        return {"SDPA (flash): logsumexp (fp32)": rows * heads * fed * FP32}
    if backend == "efficient":
        return {}
    causal = fed * keys * e if fed > 1 and not mask else mask * e
    return {
        "SDPA (math): keys and values repeated, query and keys scaled, the float mask": (
            rows * heads * (2 * keys + fed + keys) * head_dim * e + causal
        ),
        "SDPA (math): scores and their softmax": 2 * rows * heads * fed * keys * e,
    }


def block(nbytes: int) -> int:
    """A block as the caching allocator sizes it: rounded up to 512 bytes (`round_size`)."""
    return math.ceil(nbytes / BLOCK) * BLOCK if nbytes > 0 else 0


def reserved_estimate(blocks: list[int]) -> int:
    """The segments the allocator reserves for `blocks` (each a block's size), packed: the small ones into 2 MiB
    segments, those under 10 MiB into 20 MiB ones, each larger one its own segment rounded up to 2 MiB. An estimate
    and a floor: the allocator also keeps the segments of blocks freed earlier (a cache grown by cat leaves old
    ones behind) and cannot always pack blocks this tightly."""
    small = sum(b for b in blocks if b <= SMALL)
    medium = sum(b for b in blocks if SMALL < b < LARGE)
    large = sum(math.ceil(b / ROUND_LARGE) * ROUND_LARGE for b in blocks if b >= LARGE)
    return math.ceil(small / SMALL_SEGMENT) * SMALL_SEGMENT + math.ceil(medium / LARGE_SEGMENT) * LARGE_SEGMENT + large


def cublas_workspace(arch: str) -> int:
    """Bytes of cuBLAS's workspace on a GPU of `arch` ("hopper": compute capability 9.0; "other")."""
    if arch not in CUBLAS_WORKSPACE:
        raise ValueError(f"unknown GPU architecture {arch!r}; choose one of: {', '.join(ARCHES)}")
    return CUBLAS_WORKSPACE[arch]
