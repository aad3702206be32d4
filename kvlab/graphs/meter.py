"""A memory meter for decoders run as graphs, with `kvlab.meter.MemoryMeter`'s interface.

The live-storage counter (kvlab.meter) sees the outputs of aten ops dispatched from Python; a
TorchScript module runs its ops in C++ where no dispatch mode reaches. On CPU this meter reads
PyTorch's profiler instead: every allocation and free of c10's CPU allocator, in time order, as
`kvlab.profiler.ProfiledAllocations` reads them (only blocks allocated inside the region count), with a
marker event at the end of each decoding step for the per-step timeline. On CUDA it is the
allocator's own counters (`MemoryMeter` with `track_storages=False`), graph or not.

It does not split the peak into kv / logits / other: the profiler knows addresses, not tensors.
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from ..meter import MemoryMeter, MemoryReport, StepMemory
from ..meter import weight_bytes
from ..profiler import ProfiledAllocations

STEP_MARK = "kvlab.step"


class ProfilerMeter:
    """`with ProfilerMeter(model) as meter: ...; meter.step() ...` then `meter.report()` (CPU only)."""

    method = "profiler"

    def __init__(self, model: torch.nn.Module | None = None):
        self.weights = weight_bytes(model) if model is not None else 0
        self.steps = 0
        self._report: MemoryReport | None = None

    def __enter__(self):
        self._allocations = ProfiledAllocations(mark=STEP_MARK).__enter__()
        return self

    def step(self):
        """Close one decoding step (a marker in the profile; the numbers are read at the end)."""
        with record_function(STEP_MARK):
            self.steps += 1

    def label(self, tensors, category: str):
        """Accepted for MemoryMeter's interface; the profiler cannot tell which tensor a block is."""

    def __exit__(self, *exc):
        allocations, self._allocations = self._allocations, None
        allocations.__exit__(*exc)
        self._report = self._make_report(allocations)
        return False

    def _make_report(self, allocations: ProfiledAllocations) -> MemoryReport:
        """The per-step timeline: the region's allocations (kvlab.profiler's rules) cut at the step marks."""
        marks = allocations.marks
        live = step_peak = 0
        timeline: list[StepMemory] = []
        for time, (_, nbytes) in zip(allocations.times, allocations.events):
            while len(timeline) < len(marks) and marks[len(timeline)] < time:
                timeline.append(StepMemory(len(timeline), live, step_peak))
                step_peak = live
            live += nbytes
            step_peak = max(step_peak, live)
        while len(timeline) < len(marks):
            timeline.append(StepMemory(len(timeline), live, step_peak))
            step_peak = live
        at_peak = {"weights": self.weights}  # no kv / logits / other: see the module docstring
        return MemoryReport("cpu", self.method, self.weights, self.weights + allocations.peak_bytes, None, timeline,
                            at_peak)

    def report(self) -> MemoryReport:
        if self._report is None:
            raise RuntimeError("the meter's report is ready once its `with` block has ended")
        return self._report


def graph_meter(device: str, model=None):
    """The meter for a graph runtime: the profiler on CPU, the CUDA allocator on CUDA."""
    kind = torch.device(device).type
    if kind == "cuda":
        return MemoryMeter(device, model, track_storages=False)
    if kind != "cpu":
        raise ValueError(f"graph runtimes run on cpu or cuda, not {kind!r}")
    return ProfilerMeter(model)
