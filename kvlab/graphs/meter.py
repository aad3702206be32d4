"""A memory meter for decoders run as graphs, with `kvlab.meter.MemoryMeter`'s interface.

The live-storage counter (kvlab.meter) cannot see inside TorchScript, which runs its ops in C++. On CPU this
meter reads PyTorch's profiler instead (`kvlab.profiler.ProfiledAllocations`: every allocation and free of
c10's CPU allocator inside the region), cut into steps at a marker event; on CUDA it is the allocator's own
counters. It gives no kv / logits / other split: the profiler knows addresses, not tensors.
"""

from __future__ import annotations

import bisect
import itertools

import torch
from torch.profiler import record_function

from ..meter import MemoryMeter, MemoryReport, Meter, StepMemory, weight_bytes
from ..profiler import ProfiledAllocations

STEP_MARK = "kvlab.step"


class ProfilerMeter(ProfiledAllocations, Meter):
    """`with ProfilerMeter(model) as meter: ...; meter.step() ...` then `meter.report()` (CPU only)."""

    def __init__(self, model: torch.nn.Module | None = None):
        super().__init__(mark=STEP_MARK)
        self.weights = weight_bytes(model) if model is not None else 0

    def step(self):
        """Close one decoding step: a marker in the profile (the numbers are read at the end)."""
        with record_function(STEP_MARK):
            pass

    def label(self, tensors, category: str):
        """Accepted for MemoryMeter's interface; the profiler cannot tell which tensor a block is."""

    def __exit__(self, *exc):
        super().__exit__(*exc)
        # Live bytes after each of the allocator's events (time order); a step mark closes a step after every
        # event up to its time, with the live bytes then and the peak since the last mark.
        live = [0, *itertools.accumulate(nbytes for _, nbytes in self.events)]
        ends = [bisect.bisect_right(self.times, mark) for mark in self.marks]
        timeline = [
            StepMemory(step, live[end], max(live[start : end + 1]))
            for step, (start, end) in enumerate(zip([0, *ends], ends))
        ]
        self._report = MemoryReport(
            "cpu", "profiler", self.weights, self.weights + self.peak_bytes, None, timeline, {"weights": self.weights}
        )
        return False


def graph_meter(device: str, model=None):
    kind = torch.device(device).type
    if kind == "cuda":
        return MemoryMeter(device, model, track_storages=False)
    if kind != "cpu":
        raise ValueError(f"graph runtimes run on cpu or cuda, not {kind!r}")
    return ProfilerMeter(model)
