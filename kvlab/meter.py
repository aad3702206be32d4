"""One memory meter for every device; on each, the allocator is the truth.

CUDA: the caching allocator's own counters. CPU: c10's CPU allocator's own events, every allocation and free,
read from PyTorch's profiler (`profile_memory=True`), so what a kernel allocates inside itself (a cast, a matmul
workspace, attention scratch) counts on every CPU, whatever its kernel library does. Meta has no allocator: there
we count the bytes of live tensor storages at operator granularity (`LiveStorageCounter`: a TorchDispatchMode sees
every aten op's outputs, registers each new storage and notices through a weakref finalizer when it dies), adding
the scratch of the kernels where a peak falls (SDPA) from their shapes.

On CPU the counter runs beside the allocator for attribution: it knows which tensor a block is. The report gives
the peak, a per-step timeline and what was live at the peak, split into weights / kv / logits / other by the
caller's labels (`meter.label(tensors, "kv")`) and `kernels`: the blocks only the allocator saw, allocated inside
a kernel (on CPU; never silently missing); and of the kv, what was made before the peak's step began
(`previous_kv_bytes`: the cache that step started from, still held; `meter.step()` marks where steps begin).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import itertools
import os
import sys
import time
import weakref
from dataclasses import dataclass, field

import torch
from torch.autograd.profiler import profile
from torch.profiler import record_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .counts import flash_scratch_bytes

CATEGORIES = ("weights", "kv", "logits", "other")
KERNELS = "kernels"  # at the peak, blocks the allocator made that no op output shows: allocated inside a kernel
STEP_MARK = "kvlab.step"  # a region the meter records in the profile where each step ends
RESET_MARK = "kvlab.reset_peak"  # and where the peak is counted from (MemoryMeter.reset_peak)


def _storages(tree):
    """The storages of the tensors in an op's arguments or outputs: tensors, in tuples, lists and dicts (what aten
    ops take and return; written out, as torch's pytree walk was a third of the meter's time)."""
    if isinstance(tree, torch.Tensor):
        yield tree.untyped_storage()
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            yield from _storages(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _storages(item)


LIFT_FRESH = torch.ops.aten.lift_fresh.default
CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
SAFE_SOFTMAX = torch.ops.aten._safe_softmax.default  # SDPA's math path (unequal head sizes, the meta device)


WHERE = torch.ops.aten.where.self
MASKED_FILL = (torch.ops.aten.masked_fill.Scalar, torch.ops.aten.masked_fill.Tensor)


def promotion_scratch_bytes(func, args) -> int:
    """What an elementwise op on the CPU allocates inside itself when its tensors' dtypes differ: TensorIterator casts
    each input that is not of the op's common dtype into a temporary of it (and, for an in-place op whose tensor is
    not, an output temporary that it then copies back), freed before the op returns (ATen's
    TensorIteratorBase::compute_types, CPU only; `where` casts its two values likewise). A bf16 mask added to fp32
    scores is a float copy of the mask for the length of the add (tests/test_memory.py holds it against the
    profiler)."""
    if not _promotes(func):
        return 0
    operands = [a for a in (args[1:] if func is WHERE else args) if isinstance(a, (torch.Tensor, bool, int, float))]
    tensors = [a for a in operands if isinstance(a, torch.Tensor)]
    if len(operands) < 2 or not tensors or tensors[0].device.type not in ("cpu", "meta"):
        return 0
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) == 1 and tensors[0].is_floating_point():  # a number never outranks a floating tensor: no cast
        return 0
    common = _common_dtype(operands)
    size = torch.empty((), dtype=common, device="meta").element_size()
    scratch = sum(t.numel() * size for t in tensors if t.dtype != common)
    inplace = func._schema.name.endswith("_") and tensors[0] is args[0] and tensors[0].dtype != common
    return scratch + inplace * tensors[0].numel() * size


@functools.cache
def _promotes(func) -> bool:
    """Whether an op's operands are cast to a common dtype: a pointwise op's (masked_fill's mask is no operand)."""
    return torch.Tag.pointwise in func.tags and func not in MASKED_FILL


def _common_dtype(operands) -> torch.dtype:
    """torch.result_type over any number of tensors and numbers (a dimensioned tensor outranks a 0-dim one, which
    outranks a number, within a category)."""
    first, *rest = operands
    for operand in rest:
        dtype = torch.result_type(first, operand)
        dimensioned = any(isinstance(a, torch.Tensor) and a.dim() for a in (first, operand))
        first = torch.empty((1,) * dimensioned, dtype=dtype, device="meta")
    return first.dtype if isinstance(first, torch.Tensor) else torch.result_type(first, first)


def safe_softmax_scratch_bytes(scores: torch.Tensor, dim: int) -> int:
    """What `aten._safe_softmax` (the softmax of SDPA's math path) allocates beside its output and frees before it
    returns: a bool per score (`scores == -inf`), a bool per row (all of them), and a 0-dim tensor of the scores'
    dtype (ATen's attention.cpp; checked against PyTorch's profiler)."""
    return scores.numel() + scores.numel() // scores.shape[dim] + scores.element_size()


class LiveStorageCounter(TorchDispatchMode):
    """Counts the bytes of tensor storages created while it is active and still alive.

    An op's output either aliases an input (views, in-place and out= ops) or is a fresh allocation; only the
    latter is counted. `torch.tensor(data)` builds its storage outside dispatch and hands it to
    `aten.lift_fresh`, whose input is therefore counted as new. Blind spots, each pinned by a test against
    PyTorch's profiler:
    - allocations inside one kernel that no output keeps (casts inside a kernel, the 0-dim tensors wrapping
      Python scalars): transient, they matter only when the peak falls inside that kernel. The one kernel where
      a peak does fall, SDPA, is counted: the scratch of CPU flash attention (`flash_scratch_bytes`, which
      grows with torch's threads) and of the math path's softmax (`safe_softmax_scratch_bytes`) from their
      shapes, their outputs as any op's, provided SDPA runs under `no_grad` as `generate()` does (under
      `inference_mode` the mode sees only the outer `scaled_dot_product_attention`: neither the float copy of a
      bool mask, nor the logsumexp, nor the math path's scores, nor any scratch);
    - storages built without an op: `torch.load`, `torch.UntypedStorage(n)`;
    - tensors made in another Python thread (a dispatch mode is thread-local; the profiler misses them too);
    - memory c10 did not allocate: `torch.from_numpy`, `torch.frombuffer` (neither meter counts it);
    - storages from before that are freed while it runs are not subtracted.
    """

    def __init__(self, timed: bool = False):
        """timed: note each storage's address and wall time at birth and death (`births`, `deaths`), for the
        allocator's blocks to be matched to tensors."""
        super().__init__()
        self.timed = timed
        self.births: list[tuple[int, int, int, int]] = []  # (serial, address, nbytes, ns), with timed=True
        self.deaths: dict[int, int] = {}  # serial -> ns
        self.serials = 0  # storages registered so far: the next one's serial
        self.step_starts: list[int] = []  # the first serial of each step after the first (`close_step`)
        self.peak_step = 0  # the step the peak fell in
        self.live: dict[int, tuple[int, int]] = {}  # storage key -> (serial, nbytes)
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_storages: list[tuple[int, int]] = []  # (serial, nbytes) of each storage live at the peak
        self.step_peak_bytes = 0
        self.scratch = 0  # the last op's transient scratch (bytes), already freed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.scratch = 0
        inputs = None
        for storage in _storages(out):
            key = storage._cdata
            nbytes = storage.nbytes()
            if key in self.live:  # an input resized in place (resize_, out=): count the new size
                serial, old = self.live[key]
                if nbytes != old:
                    self.live[key] = (serial, nbytes)
                    self._add(nbytes - old)
                    self._born(serial, storage, nbytes)  # c10 moved it to a new block
                continue
            if inputs is None:
                inputs = {s._cdata for s in _storages((args, kwargs))}
            # lift_fresh's input was made just now, outside dispatch, by c10 (resizable); a from_numpy
            # storage also passes through it but wraps numpy's memory, which is not an allocation.
            if key in inputs and not (func is LIFT_FRESH and storage.resizable()):
                continue
            serial = self.serials
            self.serials += 1
            self.live[key] = (serial, nbytes)
            weakref.finalize(storage, self._free, key)
            self._add(nbytes)
            self._born(serial, storage, nbytes)
        if func is CPU_FLASH:  # on CPU, or on meta standing in for it (kvlab.planner.meta.MetaAsCpu)
            query, value = args[0], args[2]
            reduced = query.dtype in (torch.bfloat16, torch.float16)
            self._spike(flash_scratch_bytes(query.shape[-2], value.shape[-2], value.shape[-1], reduced))
        elif func is SAFE_SOFTMAX:
            self._spike(safe_softmax_scratch_bytes(args[0], args[1]))
        else:
            cast = promotion_scratch_bytes(func, args)
            if cast:
                self._spike(cast)
        return out

    def _spike(self, nbytes: int):
        """A transient inside the op just run: alive beside its outputs, freed before it returned."""
        self._add(nbytes, scratch=nbytes)
        self.live_bytes -= nbytes
        self.scratch = nbytes

    def _add(self, nbytes: int, scratch: int = 0):
        self.live_bytes += nbytes
        if self.live_bytes > self.step_peak_bytes:
            self.step_peak_bytes = self.live_bytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_storages = list(self.live.values()) + ([(-1, scratch)] if scratch else [])
            self.peak_step = len(self.step_starts)

    def _born(self, serial: int, storage, nbytes: int):
        if self.timed:
            self.births.append((serial, storage.data_ptr(), nbytes, time.time_ns()))

    def _free(self, key: int):
        entry = self.live.pop(key, None)
        if entry is not None:
            self.live_bytes -= entry[1]
            if self.timed:
                self.deaths[entry[0]] = time.time_ns()

    def close_step(self):
        """A step ends here: the storages registered from now on are the next step's."""
        self.step_starts.append(self.serials)
        self.step_peak_bytes = self.live_bytes

    def made_before_step(self, serial: int, step: int) -> bool:
        """Whether storage `serial` was made before step `step` began (step 0: nothing was)."""
        return step > 0 and serial < self.step_starts[step - 1]

    def serial_of(self, tensor: torch.Tensor):
        entry = self.live.get(tensor.untyped_storage()._cdata)
        return None if entry is None else entry[0]

    def bytes_by_serial(self) -> dict[int, int]:
        return {serial: nbytes for serial, nbytes in self.live.values()}


@dataclass
class StepMemory:
    step: int
    live_bytes: int  # above baseline, at the end of the step
    peak_bytes: int  # above baseline, highest inside the step


@dataclass
class MemoryReport:
    """What one `MemoryMeter` run measured; the same definitions on every device.

    baseline_bytes: the model's weights (0 without a model), not "everything live at the start" (the CPU has no
        counter of that). overhead_bytes = peak - baseline: the most bytes allocated inside the `with` block and
        not yet freed; what the process held at entry is in neither. On CUDA the allocator's total also drops
        when a tensor from before the block is freed inside it; the counter never sees that.
    """

    device: str
    method: str  # "cuda-allocator", "cpu-allocator" or "live-storages" (meta)
    baseline_bytes: int
    peak_bytes: int
    reserved_peak_bytes: int | None
    timeline: list[StepMemory] = field(default_factory=list)
    at_peak: dict[str, int] = field(default_factory=dict)  # category -> bytes live at the peak
    storages_peak_bytes: int | None = None  # the live-storage count's peak above the start (CPU; CUDA when tracked)
    # Of at_peak["kv"], the storages made before the step the peak falls in began: the cache that step started from,
    # still referenced at its peak (the rest of "kv" the step made). None where at_peak is not split.
    previous_kv_bytes: int | None = None

    @property
    def overhead_bytes(self) -> int:
        return self.peak_bytes - self.baseline_bytes


class Meter:
    """What every meter shares (this one, and kvlab.graphs.meter's profiler): a report made as its `with` block
    ends (the subclass's `__exit__` sets `_report`)."""

    _report: MemoryReport | None = None

    def report(self) -> MemoryReport:
        if self._report is None:
            raise RuntimeError("the meter's report is ready once its `with` block has ended")
        return self._report


@contextlib.contextmanager
def quiet_stderr():
    """Silence file descriptor 2 around the profiler's start and stop: Kineto (torch 2.13) writes lines there
    whatever KINETO_LOG_LEVEL says, which would land in executed notebooks."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class CpuAllocator:
    """c10's CPU allocator inside a `with` block, read from PyTorch's profiler: `blocks` (address, bytes, allocated
    at, freed at or None; ns), `events` (block, bytes, < 0 for a free) in time order, `live` (bytes after each event),
    `peak_bytes`, and `ends`: how many events each `mark()` closed. A free of a block from before the block is not
    an event: as for the counter, the peak is of bytes allocated inside. The events are read from the profiler's
    event tree in process (half the time of exporting and parsing its trace, which `kvlab.profiler` reads as an
    independent witness)."""

    def __enter__(self):
        self._allocations, self._marks, self._resets = [], [], []
        self._start()
        return self

    def _start(self):
        # The autograd profiler records the same kineto events as torch.profiler.profile (CPU activity only), and
        # starts without importing torch's compiler stack (seconds, once per process: a CPU plan's probe pays it).
        self._profile = profile(profile_memory=True, use_kineto=True)
        with quiet_stderr():
            self._profile.__enter__()

    def _stop(self, *exc):
        """End the profile so far and keep only its allocation events and marks, compactly: the profiler holds
        every op's event until it ends (gigabytes over hundreds of steps of a 32-layer model)."""
        with quiet_stderr():
            self._profile.__exit__(*exc)
        allocations, marks, resets = _profiled_events(self._profile.kineto_results.experimental_event_tree())
        del self._profile
        self._allocations += allocations
        self._marks += marks
        self._resets += resets

    def mark(self, name: str = STEP_MARK):
        with record_function(name):
            pass
        if name == STEP_MARK:  # between steps no tensor is made or freed: the profile is read and started anew
            enabled = gc.isenabled()
            gc.disable()  # nor may a collection free one while no profiler listens
            try:
                self._stop(None, None, None)
                self._start()
            finally:
                if enabled:
                    gc.enable()

    def __exit__(self, *exc):
        self._stop(*exc)
        allocations, marks, resets = self._allocations, self._marks, self._resets
        del self._allocations, self._marks, self._resets
        self.blocks: list[list] = []
        self.events: list[tuple[int, int]] = []
        times, open_blocks = [], {}  # address -> index of the live block there
        for when, address, nbytes in allocations:
            if nbytes > 0:
                block = open_blocks[address] = len(self.blocks)
                self.blocks.append([address, nbytes, when, None])
            else:
                block = open_blocks.pop(address, None)
                if block is None:
                    continue  # a block from before the region (c10 can remember one from an earlier profile)
                self.blocks[block][3] = when
            self.events.append((block, nbytes))
            times.append(when)
        self.live = list(itertools.accumulate(nbytes for _, nbytes in self.events))
        # From the last reset on (the live bytes at the reset count, as after reset_peak_memory_stats on CUDA).
        first = bisect.bisect_right(times, resets[-1]) - 1 if resets else -1
        self.peak_event = max(range(first, len(self.live)), key=lambda i: self.live[i] if i >= 0 else 0, default=-1)
        self.peak_bytes = self.live[self.peak_event] if self.peak_event >= 0 else 0
        self.reset_bytes = self.live[first] if first >= 0 else 0  # live at the last reset
        self.ends = [bisect.bisect_right(times, mark) for mark in marks]
        return False

    def live_at(self, event: int) -> list[int]:
        """The blocks live right after event number `event` (-1: none yet)."""
        live: set[int] = set()
        for block, nbytes in self.events[: event + 1]:
            (live.add if nbytes > 0 else live.discard)(block)
        return sorted(live)

    def timeline(self) -> list[StepMemory]:
        """Each marked step: the live bytes when it closed and the highest since the step before closed."""
        live = [0, *self.live]
        return [
            StepMemory(step, live[end], max(live[start : end + 1]))
            for step, (start, end) in enumerate(zip([0, *self.ends], self.ends))
        ]


def _profiled_events(roots) -> tuple[list[tuple[int, int, int]], list[int], list[int]]:
    """From the profiler's event tree: (ns, address, bytes) of each CPU allocation and free, and the ns of each step
    mark and peak reset, in time order (a stable sort of the tree's depth-first order breaks ties as the events
    were recorded)."""
    allocations, marks, resets, stack = [], [], [], list(reversed(roots))
    while stack:
        event = stack.pop()
        if event.tag == _ALLOCATION:
            fields = event.extra_fields
            if fields.device.type == "cpu":
                allocations.append((event.start_time_ns, fields.ptr, fields.alloc_size))
        elif event.name in (STEP_MARK, RESET_MARK):
            (marks if event.name == STEP_MARK else resets).append(event.start_time_ns)
        stack.extend(reversed(event.children))
    allocations.sort(key=lambda a: a[0])
    return allocations, sorted(marks), sorted(resets)


_ALLOCATION = torch._C._profiler._EventType.Allocation


def match_blocks(blocks: list[list], births, deaths: dict[int, int]) -> dict[int, int]:
    """Which allocator block each counted storage is: block index -> the counter's serial. A storage is the block at
    its address, of its size, whose lifetime overlaps its own most (a kernel's scratch at the same address, freed
    before the output was allocated there, overlaps it not at all)."""
    at_address: dict[int, list[int]] = {}  # address -> its blocks, in the order they were allocated
    for index, (address, *_) in enumerate(blocks):
        at_address.setdefault(address, []).append(index)
    allocated_at = {address: [blocks[i][2] for i in indices] for address, indices in at_address.items()}
    owner = {}
    for serial, address, nbytes, born in births:
        candidates = at_address.get(address, [])
        nearest = bisect.bisect_right(allocated_at.get(address, []), born) - 1
        died = deaths.get(serial, float("inf"))
        best, overlap = None, 0
        for index in candidates[max(nearest - 1, 0) : nearest + 2]:
            _, size, allocated, freed = blocks[index]
            shared = min(died, float("inf") if freed is None else freed) - max(born, allocated)
            if size == nbytes and shared > overlap:
                best, overlap = index, shared
        if best is not None:
            owner[best] = serial
    return owner


class MemoryMeter(Meter):
    """`with MemoryMeter(device, model) as meter: ...; meter.step() ...`. The allocator is the truth on CPU and
    CUDA; the live-storage counter runs beside it (`track_storages`, the default on CPU and meta) to split the peak
    by what each block is, and on meta it is the only meter. On CUDA `track_storages=True` counts live storages too
    (slower) for the split at the peak and a cross-check."""

    def __init__(self, device="cpu", model: torch.nn.Module | None = None, track_storages: bool | None = None):
        self.device = torch.device(device)
        kind = self.device.type
        self.on_cuda = kind == "cuda"
        self.track_storages = (not self.on_cuda) if track_storages is None else track_storages
        if kind not in ("cpu", "cuda") and not self.track_storages:
            raise ValueError(f"on {kind} the only meter is the live-storage counter")
        self.weights = weight_bytes(model) if model is not None else 0  # the baseline on every device
        self.allocator = CpuAllocator() if kind == "cpu" else None
        # The counter adds SDPA's scratch from its shapes on CPU too: its peak is what kvlab.theory predicts (tensors
        # and that scratch), while the allocator's peak also holds what other kernels allocate inside themselves.
        self.counter = LiveStorageCounter(timed=kind == "cpu") if self.track_storages else None
        self.labels: dict[int, str] = {}  # storage serial -> category
        self.timeline: list[StepMemory] = []
        self.cuda_peak = self.reserved_peak = 0  # CUDA: highest over the steps closed so far
        self.start_allocated = 0  # CUDA: bytes the allocator held at entry; overhead is counted above it

    def __enter__(self):
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_allocated = torch.cuda.memory_allocated(self.device)
        if self.allocator is not None:
            self.allocator.__enter__()
        if self.counter is not None:
            self.counter.__enter__()
        return self

    def __exit__(self, *exc):
        if self.counter is not None:
            self.counter.__exit__(*exc)
        if self.allocator is not None:
            self.allocator.__exit__(*exc)
            self.timeline = self.allocator.timeline()
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
        self._report = self._make_report()
        return False

    def live_bytes(self) -> int:
        """Bytes allocated since the meter started and still live (above the baseline). On CPU, while the block
        runs, the storages counted so far (the allocator's events are read when it ends)."""
        if self.on_cuda:
            return torch.cuda.memory_allocated(self.device) - self.start_allocated
        if self.counter is None:
            raise RuntimeError("on CPU without track_storages the live bytes are known once the block has ended")
        return self.counter.live_bytes

    def reset_peak(self):
        """Count the peak from here on (the bytes live now included), as torch.cuda.reset_peak_memory_stats does."""
        if self.allocator is not None:
            self.allocator.mark(RESET_MARK)
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.cuda_peak = self.reserved_peak = 0
        if self.counter is not None:
            self.counter.peak_bytes = self.counter.live_bytes
            self.counter.peak_storages = list(self.counter.live.values())
            self.counter.peak_step = len(self.counter.step_starts)

    def step(self):
        """Close one decoding step: record live bytes now and the peak since the last step."""
        if self.allocator is not None:
            self.allocator.mark()  # the timeline is read from the allocator's events at the end
        elif self.on_cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - self.start_allocated
            self.cuda_peak = max(self.cuda_peak, peak)
            self.reserved_peak = max(self.reserved_peak, torch.cuda.max_memory_reserved(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            peak = self.counter.step_peak_bytes
        if self.allocator is None:
            self.timeline.append(StepMemory(len(self.timeline), self.live_bytes(), peak))
        if self.counter is not None:
            self.counter.close_step()

    def label(self, tensors, category: str):
        """Name the storages behind `tensors` (any nesting of tensors) as `category`."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown category {category!r}; choose one of: {', '.join(CATEGORIES)}")
        if self.counter is None:
            return
        for leaf in tree_leaves(tensors):
            if isinstance(leaf, torch.Tensor):
                serial = self.counter.serial_of(leaf)
                if serial is not None:
                    self.labels.setdefault(serial, category)

    def _make_report(self) -> MemoryReport:
        storages_peak = self.counter.peak_bytes if self.counter is not None else None
        if self.allocator is not None:
            at_peak, previous = self._split_allocator_peak()
            return MemoryReport(
                str(self.device),
                "cpu-allocator",
                self.weights,
                self.weights + self.allocator.peak_bytes,
                None,
                self.timeline,
                at_peak,
                storages_peak,
                previous,
            )
        at_peak, previous = {"weights": self.weights, "kv": 0, "logits": 0, "other": 0}, None
        if self.counter is not None:
            at_peak, previous = self._split(self.counter.peak_storages, self.counter.peak_step, kernels=False)
        if not self.on_cuda:
            return MemoryReport(
                str(self.device),
                "live-storages",
                self.weights,
                self.weights + storages_peak,
                None,
                self.timeline,
                at_peak,
                previous_kv_bytes=previous,
            )
        peak = max(self.cuda_peak, torch.cuda.max_memory_allocated(self.device) - self.start_allocated)
        reserved = max(self.reserved_peak, torch.cuda.max_memory_reserved(self.device))
        return MemoryReport(
            str(self.device),
            "cuda-allocator",
            self.weights,
            self.weights + peak,
            reserved,
            self.timeline,
            at_peak,
            storages_peak,
            previous,
        )

    def _split_allocator_peak(self) -> tuple[dict[str, int], int | None]:
        """The blocks live at the allocator's peak, by what the counter knew them as (`_split`); `kernels`: blocks no
        op output is (allocated inside a kernel and freed before it returned, or held there while the peak fell
        inside it)."""
        if self.counter is None:
            return {"weights": self.weights}, None
        allocator = self.allocator
        if not allocator.events:
            return self._split([], 0, kernels=True)
        owner = match_blocks(allocator.blocks, self.counter.births, self.counter.deaths)
        live = [(owner.get(block), allocator.blocks[block][1]) for block in allocator.live_at(allocator.peak_event)]
        return self._split(live, bisect.bisect_right(allocator.ends, allocator.peak_event), kernels=True)

    def _split(self, storages, step: int, kernels: bool) -> tuple[dict[str, int], int]:
        """`storages` (serial, or None for a kernel's block; bytes), live at a peak in step `step`, by category; and
        the bytes of the `kv` among them made before that step began (MemoryReport.previous_kv_bytes)."""
        at_peak = {"weights": self.weights, "kv": 0, "logits": 0, "other": 0} | ({KERNELS: 0} if kernels else {})
        previous = 0
        for serial, nbytes in storages:
            category = KERNELS if serial is None else self.labels.get(serial, "other")
            at_peak[category] += nbytes
            if category == "kv" and self.counter.made_before_step(serial, step):
                previous += nbytes
        return at_peak, previous


def storage_bytes(tensors) -> int:
    """Bytes of the storages under `tensors`, each once (a view counts its whole storage; tied weights once)."""
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def weight_bytes(model: torch.nn.Module) -> int:
    return storage_bytes([*model.parameters(), *model.buffers()])
