"""A memory meter for decoders run as graphs, with `kvlab.meter.MemoryMeter`'s interface.

The live-storage counter (kvlab.meter) cannot see inside TorchScript, which runs its ops in C++. On CPU this
meter reads PyTorch's profiler instead (`kvlab.profiler.ProfiledAllocations`: every allocation and free of
c10's CPU allocator inside the region), cut into steps at a marker event; on CUDA it is the allocator's own
counters. It gives no kv / logits / other split: the profiler knows addresses, not tensors.
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from ..meter import MemoryMeter, MemoryReport, StepMemory, weight_bytes
from ..profiler import ProfiledAllocations

STEP_MARK = "kvlab.step"


class ProfilerMeter:
    """`with ProfilerMeter(model) as meter: ...; meter.step() ...` then `meter.report()` (CPU only)."""

    def __init__(self, model: torch.nn.Module | None = None):
        self.weights = weight_bytes(model) if model is not None else 0
        self._report: MemoryReport | None = None

    def __enter__(self):
        self._allocations = ProfiledAllocations(mark=STEP_MARK).__enter__()
        return self

    def step(self):
        """Close one decoding step: a marker in the profile (the numbers are read at the end)."""
        with record_function(STEP_MARK):
            pass

    def label(self, tensors, category: str):
        """Accepted for MemoryMeter's interface; the profiler cannot tell which tensor a block is."""

    def __exit__(self, *exc):
        allocations, self._allocations = self._allocations, None
        allocations.__exit__(*exc)
        # The timeline: the allocator's events and the step marks in time order (an event before a mark at
        # the same time); each mark closes a step with the live bytes then and the peak since the last mark.
        live = step_peak = 0
        timeline: list[StepMemory] = []
        events = [(time, False, nbytes) for time, (_, nbytes) in zip(allocations.times, allocations.events)]
        for _, is_mark, nbytes in sorted(events + [(time, True, 0) for time in allocations.marks], key=lambda e: e[:2]):
            if is_mark:
                timeline.append(StepMemory(len(timeline), live, step_peak))
                step_peak = live
            else:
                live += nbytes
                step_peak = max(step_peak, live)
        self._report = MemoryReport("cpu", "profiler", self.weights, self.weights + allocations.peak_bytes, None,
                                    timeline, {"weights": self.weights})
        return False

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
