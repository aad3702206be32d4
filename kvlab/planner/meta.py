"""The CPU on the meta device: a forward with shapes and no data that allocates what the same forward allocates on a
CPU (`MetaAsCpu`) or on a CUDA GPU (`MetaAsCuda`), and the CPU's kernel library, whose workspace a prediction names
when it cannot count it.
The planner's dry run (kvlab.planner.dry_run) runs kvlab's loop under it; tests/test_dry_run.py holds it against
CPU runs.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from ..cuda_memory import sdpa_backend, sdpa_terms
from ..meter import CPU_FLASH, CpuAllocator


class MetaAsCpu(TorchFunctionMode):
    """A forward on the meta device (shapes, no data) that allocates what the same forward allocates on a CPU:
    - SDPA as the CPU runs it: its flash kernel's op (which has a meta form) on the float copy of a bool mask, or,
      where the CPU takes the math path (head sizes that differ), that path's own ops (PyTorch decomposes SDPA
      into them on meta, whatever the shapes);
    - a yes-or-no question asked of a meta tensor's values (`bool(...)` of a bool: is the attention mask all ones,
      are the positions one packed sequence?) gets the answer for what kvlab's loop passes (a mask of ones,
      positions 0..n-1): yes. transformers asks them to choose the masks it builds; no other code kvlab runs on
      meta reads a value (tests/test_dry_run.py holds meta against CPU runs), but for `token in ids` (GPT-2's
      warning of padding without a mask, asked when 5.18+ generate() passes no mask): no, a warning's question;
    - the experts' grouped matrix product in fp32, which the CPU runs and whose meta form takes bf16 only: its
      output, shaped by the meta form on bf16 stand-ins that no meter sees.

    Which entries are nonzero (`nonzero`, one-argument `where`: which experts a token was routed to, which tokens an
    expert got) depends on the weights and the prompt, and sizes what follows (an expert loop's tensors). The
    answer is a bound: every entry (every expert hit, each receiving every token in every top-k slot, more than
    any routing can give it), and a yes-or-no question asked of such an answer (is this the "no expert" class?)
    is answered no, so that every expert runs. Every tensor the loop then makes is at least as large as in any
    real run, so the dry run's peak is an upper bound (tests/test_moe_bound.py holds it against measured peaks);
    `bounded` counts the answers given.
    """

    bounded = 0  # answers bounded so far, in this process (a dry run reads it before and after)

    def __init__(self, threads: int | None = None):
        super().__init__()
        self._routed: set[int] = set()  # ids of tensors made from a bounded answer, and from those, while they live
        self.threads, self._threads_before = threads, None  # the CPU's torch threads (its flash scratch is per thread)

    def __enter__(self):
        if self.threads:  # the meter counts flash's scratch for torch's threads; meta computes nothing with them
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(self.threads)
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        if self._threads_before:
            torch.set_num_threads(self._threads_before)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _UNTYPED_STORAGE:  # no data, no tensor: what the meter asks of every cache tensor every step
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        routed = bool(self._routed) and any(
            isinstance(leaf, torch.Tensor) and id(leaf) in self._routed for leaf in tree_leaves((args, kwargs))
        )
        if func in (torch.Tensor.__bool__, torch.Tensor.item) and _meta_bool(args[0]):
            return not routed
        if routed and func is torch.Tensor.item:
            raise DataDependent("a dry run on meta cannot read a routed expert's number; measure it: kvlab measure")
        if func is torch.Tensor.__contains__ and args[0].device.type == "meta":
            return False
        if _asks_nonzero(func, args, kwargs):
            return self._every_entry(func, args[0])
        if routed and func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            args = (args[0], self._first_expert(args[1]), *args[2:])
        out = self._as_cpu(func, args, kwargs)
        if routed:
            self._mark(out)
        return out

    def _mark(self, out):
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and id(leaf) not in self._routed:
                self._routed.add(id(leaf))
                weakref.finalize(leaf, self._routed.discard, id(leaf))

    def _every_entry(self, func, tensor):
        """`nonzero` (or `where`) answered as if every entry were nonzero: the routing's bound."""
        MetaAsCpu.bounded += 1
        rows, dims = tensor.numel(), tensor.dim()
        if func is torch.where:
            out = tuple(torch.empty(rows, dtype=torch.long, device="meta") for _ in range(dims))
        else:
            out = torch.empty((rows, dims), dtype=torch.long, device="meta")
        self._mark(out)
        return out

    def _first_expert(self, index):
        """An index by a routed number (`weights[expert]`, a view on the CPU, which reads the number) as the first
        expert's: in the bound every expert runs, and every expert's tensors have one shape."""
        if isinstance(index, tuple):
            return tuple(self._first_expert(part) for part in index)
        routed_number = isinstance(index, torch.Tensor) and id(index) in self._routed and index.dim() == 0
        return 0 if routed_number and not index.is_floating_point() else index

    def _as_cpu(self, func, args, kwargs):
        if func is torch._grouped_mm and args[0].device.type == "meta" and args[0].dtype != torch.bfloat16:
            with _disable_current_modes():  # the stand-ins are not the CPU's
                shape = func(*(a.to(torch.bfloat16) for a in args[:2]), *args[2:], **kwargs).shape
            return torch.empty(shape, dtype=args[0].dtype, device="meta")
        if func is not torch.nn.functional.scaled_dot_product_attention or args[0].device.type != "meta":
            return func(*args, **kwargs)
        return self._sdpa(func, args, kwargs)

    def _sdpa(self, func, args, kwargs):
        """SDPA as the CPU runs it: its flash kernel's op, or the math path's ops."""
        query, key, value = args[:3]
        if not _cpu_takes_flash(query, key, value, kwargs.get("enable_gqa", False)):  # the math path, as on CPU
            return func(*args, **kwargs)
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        if mask is not None and mask.dtype == torch.bool:  # ATen's convert_boolean_attn_mask: where(mask, 0, -inf)
            zero = torch.scalar_tensor(0.0, dtype=query.dtype, device=query.device)
            mask = torch.where(mask, zero, torch.scalar_tensor(float("-inf"), dtype=query.dtype, device=query.device))
        return CPU_FLASH(
            query,
            key,
            value,
            kwargs.get("dropout_p", 0.0),
            kwargs.get("is_causal", False),
            attn_mask=mask,
            scale=kwargs.get("scale"),
        )[0]


_UNTYPED_STORAGE = torch.Tensor.untyped_storage


class MetaAsCuda(MetaAsCpu):
    """A forward on the meta device that allocates what the same forward allocates on a CUDA GPU of `arch`
    (kvlab.cuda_memory): MetaAsCpu's answers and bounds, but SDPA as CUDA runs it, the kernel chosen as
    `sdpa_backend` chooses it, with no CPU flash scratch and no float mask where CUDA makes none: cuDNN's float copy
    of a bool mask and its three small tensors, flash's logsumexp, nothing beside memory-efficient's output, and
    the math path's ops (PyTorch's decomposition on meta). Not counted here: the allocator's 512-byte rounding and
    cuBLAS's workspace (kvlab.planner.plan adds the workspace to a dry run's count)."""

    def __init__(self, arch: str = "hopper"):
        super().__init__()
        self.arch = arch

    def _sdpa(self, func, args, kwargs):
        query, key, value = args[:3]
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        grouped = bool(kwargs.get("enable_gqa", False)) and key.shape[-3] != query.shape[-3]
        backend = sdpa_backend(self.arch, query.element_size(), query.shape[-1], mask is not None, grouped)
        if backend == "math":
            return func(*args, **kwargs)
        out = torch.empty((*query.shape[:-1], value.shape[-1]), dtype=query.dtype, device="meta")
        inside = sdpa_terms(
            backend,
            *(query.shape[0], query.shape[1], query.shape[2], key.shape[2], query.shape[3], query.element_size()),
            mask.numel() if mask is not None and mask.dtype == torch.bool else 0,  # a float mask is used as given
        )
        torch.empty(sum(inside.values()), dtype=torch.uint8, device="meta")  # alive inside SDPA only: the meter's spike
        return out


class KnownShapes(TorchDispatchMode):
    """Meta kernels answered from memory: an aten op that makes new tensors (no output aliases an input, no input is
    written) gets, for inputs of the shapes, strides, dtypes and arguments it was given before, new tensors of what
    its meta kernel answered then. A meta kernel (PyTorch's Python reference, ~0.3 ms an op: most of a dry run's
    time) computes its outputs' shapes and strides from those alone; the layers of one kind in a forward, the cut
    models and the designs of a prediction repeat them. Entered below the meter (before it), which sees the op and
    its new outputs as ever. `answers`: what this process has learned, for ops whose outputs are fresh, dense and
    of distinct storages (`_answer`); at most `LIMIT` of them."""

    LIMIT = 2**17
    answers: dict = {}  # shared by every dry run in the process: a warm prediction asks its kernels nothing

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = _key(func, args, kwargs) if _makes_new(func) else None
        answer = KnownShapes.answers.get(key) if key is not None else None
        if answer is not None:
            made = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in answer]
            return tuple(made) if answer.many else made[0]
        out = func(*args, **kwargs)
        if key is not None and (answer := _answer(out, args, kwargs)) is not None:
            if len(KnownShapes.answers) >= KnownShapes.LIMIT:
                KnownShapes.answers.clear()
            KnownShapes.answers[key] = answer
        return out


class _Answer(tuple):
    """The outputs' (shape, stride, dtype), and whether the op returned them as a tuple."""

    many = False


@functools.lru_cache(maxsize=None)
def _makes_new(func) -> bool:
    """Whether an aten op only makes new tensors: no output aliases an input and no input is written (its
    schema's alias annotations), and it returns tensors."""
    schema = func._schema
    returns = schema.returns
    return (
        bool(returns)
        and all(r.alias_info is None and str(r.type) == "Tensor" for r in returns)
        and all(a.alias_info is None for a in schema.arguments)
    )


def _key(func, args, kwargs):
    """What a meta kernel's answer depends on: the op, the default dtype, each (meta) tensor's shape, stride and
    dtype, each other argument's type and value; None where an argument is of a kind not told apart here."""
    try:  # factories given no dtype make the default one
        return (func, torch.get_default_dtype(), *map(_described, args), *map(_described, kwargs.items()))
    except _Unknown:
        return None


class _Unknown(Exception):
    """An argument `_key` does not tell apart (a tensor off meta, an object): the kernel answers."""


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


def _described(value):
    if isinstance(value, torch.Tensor):
        if not value.is_meta:
            raise _Unknown
        return (value.shape, value.stride(), value.dtype)
    if isinstance(value, (tuple, list)):
        return (type(value), *map(_described, value))
    if isinstance(value, _PLAIN):
        return (type(value), value)
    raise _Unknown


def _answer(out, args, kwargs):
    """What to answer the same op with again: each output's (shape, stride, dtype), where each is a dense tensor
    of a new storage of its own (as `torch.empty_strided` makes it); else None (`_unsafe_view`'s schema, say,
    claims a new tensor and returns its input's storage)."""
    outputs = out if isinstance(out, tuple) else (out,)
    if not all(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in outputs):
        return None
    storages = {t.untyped_storage()._cdata for t in outputs}
    inputs = {leaf.untyped_storage()._cdata for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)}
    if len(storages) != len(outputs) or storages & inputs:
        return None
    answer = _Answer((tuple(t.shape), t.stride(), t.dtype) for t in outputs)
    for t, (shape, stride, dtype) in zip(outputs, answer):
        like = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        if t.storage_offset() or t.untyped_storage().nbytes() != like.untyped_storage().nbytes():
            return None
    answer.many = isinstance(out, tuple)
    return answer


def meta_as(device: str, threads: int | None = None, arch: str | None = None):
    """What makes a dry run's mode for a prediction for `device` (a fresh one for every run): a CUDA GPU of `arch`,
    else a CPU of `threads`."""
    if torch.device(device).type == "cuda":
        return lambda: MetaAsCuda(arch or "hopper")
    return lambda: MetaAsCpu(threads)


class DataDependent(ValueError):
    """A forward on meta asked for a number that only the data gives (a routed expert's count)."""


_NONZERO = (torch.nonzero, torch.Tensor.nonzero, torch.where, torch.argwhere, torch.Tensor.argwhere)


def _asks_nonzero(func, args, kwargs) -> bool:
    return func in _NONZERO and len(args) == 1 and not kwargs and args[0].device.type == "meta"


def _meta_bool(tensor) -> bool:
    """A yes-or-no question asked of a meta tensor (a number's value is not answered: reading it still fails)."""
    return tensor.device.type == "meta" and tensor.dtype == torch.bool and tensor.numel() == 1


def _cpu_takes_flash(query, key, value, enable_gqa: bool = False) -> bool:
    """Whether the CPU's SDPA picks its flash kernel (ATen's use_flash_attention_cpp, for what kvlab's models pass):
    one head size for queries, keys and values, a floating dtype it has, and one batch and one head count for the
    three, unless `enable_gqa` lets keys and values have a divisor of the query's heads (a multi-query layer that
    passes one key head without it, as Falcon's, takes the math path)."""
    sizes = {query.shape[-1], key.shape[-1], value.shape[-1]}
    dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    same = query.shape[:-2] == key.shape[:-2] == value.shape[:-2]
    grouped = enable_gqa and query.shape[0] == key.shape[0] == value.shape[0] and query.shape[1] % key.shape[1] == 0
    return len(sizes) == 1 and query.dtype in dtypes and (same or grouped)


def cpu_kernels() -> str:
    """This CPU's kernel library, as torch reports it: the instruction set ATen's kernels use, and what runs bf16 and
    fp16 matrix products."""
    onednn = [name for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)) if _onednn_matmul(dtype)]
    library = f"oneDNN for {' and '.join(onednn)}" if onednn else "ATen's own kernels"
    return f"{torch.backends.cpu.get_cpu_capability()}; bf16 and fp16 matrix products: {library}"


def _onednn_matmul(dtype: torch.dtype) -> bool:
    """Whether ATen hands matrix products of `dtype` to oneDNN on this CPU (ATen's use_mkldnn_matmul: bf16 on CPUs
    with AVX-512 BW/VL/DQ or AMX, fp16 on those with AVX-512 FP16 or AMX-FP16)."""
    checks = {
        torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
        torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported,
    }
    return dtype in checks and torch.backends.mkldnn.is_available() and bool(checks[dtype]())


@functools.lru_cache(maxsize=4)
def uncounted_workspace(dtype: torch.dtype) -> str | None:
    """None where kvlab counts every byte a CPU run of `dtype` allocates; else a sentence naming what it does not
    count: the workspace oneDNN allocates inside a matrix product (bf16 on AVX-512 and AMX CPUs), which depends on the
    CPU and its library version, read from the allocator on a 64 x 64 x 64 probe (under a meter already running,
    which holds the profiler, the library's own word alone)."""
    a, b = torch.ones(64, 64, dtype=dtype), torch.ones(64, 64, dtype=dtype)
    try:
        with CpuAllocator() as allocator:
            out = torch.mm(a, b.t())
        scratch = allocator.peak_bytes - out.untyped_storage().nbytes()
    except RuntimeError:  # "profiler already enabled"
        scratch = 0
    if not scratch and not _onednn_matmul(dtype):
        return None
    return (
        f"this CPU ({cpu_kernels()}) allocates a workspace inside each {dtype} matrix product ({scratch:,} B for a "
        f"64 x 64 x 64 probe) that kvlab does not count: a CPU run's peak can exceed the prediction by one such "
        f"workspace"
    )
