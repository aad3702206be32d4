"""A memory meter for decoders run as graphs, with `kvlab.memory.MemoryMeter`'s interface.

The live-storage counter (kvlab.memory) sees the outputs of aten ops dispatched from Python; a
TorchScript module runs its ops in C++ where no dispatch mode reaches. On CPU this meter reads
PyTorch's profiler instead: every allocation and free of c10's CPU allocator, in time order (the
same witness and the same rules as `kvlab.profiler`: only blocks allocated inside the region count),
with a marker event at the end of each decoding step for the per-step timeline. On CUDA it is the
allocator's own counters (`MemoryMeter` with `track_storages=False`), graph or not.

It does not split the peak into kv / logits / other: the profiler knows addresses, not tensors.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from .memory import MemoryMeter, MemoryReport, StepMemory
from .models import weight_bytes
from .profiler import CPU

STEP_MARK = "kvlab.step"


@contextlib.contextmanager
def _quiet_stderr():
    """Kineto (torch 2.13) writes timestamped "profiler_start/stop" lines to the process's stderr whatever
    KINETO_LOG_LEVEL says; they would land in executed notebooks. Silence file descriptor 2 around the
    profiler's start and stop only (not around the measured run)."""
    import sys
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class ProfilerMeter:
    """`with ProfilerMeter(model) as meter: ...; meter.step() ...` then `meter.report()` (CPU only)."""

    method = "profiler"

    def __init__(self, model: torch.nn.Module | None = None):
        self.weights = weight_bytes(model) if model is not None else 0
        self.steps = 0
        self._report: MemoryReport | None = None

    def __enter__(self):
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():
            self._profile.__enter__()
        return self

    def step(self):
        """Close one decoding step (a marker in the profile; the numbers are read at the end)."""
        with record_function(STEP_MARK):
            self.steps += 1

    def label(self, tensors, category: str):
        """Accepted for MemoryMeter's interface; the profiler cannot tell which tensor a block is."""

    def __exit__(self, *exc):
        with _quiet_stderr():
            self._profile.__exit__(*exc)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "trace.json")
            self._profile.export_chrome_trace(path)
            with open(path) as file:
                events = json.load(file)["traceEvents"]
        del self._profile
        self._report = self._make_report(events)
        return False

    def _make_report(self, events) -> MemoryReport:
        marks = sorted(e["ts"] for e in events if e.get("name") == STEP_MARK)
        memory = [e for e in events if e.get("name") == "[memory]" and e["args"]["Device Type"] == CPU]
        memory.sort(key=lambda e: (e["ts"], e["args"]["Ev Idx"]))
        allocated: dict[int, int] = {}  # blocks allocated in the region and still live
        live = peak = step_peak = 0
        timeline: list[StepMemory] = []
        for event in memory:
            while len(timeline) < len(marks) and marks[len(timeline)] < event["ts"]:
                timeline.append(StepMemory(len(timeline), live, step_peak))
                step_peak = live
            address, nbytes = event["args"]["Addr"], event["args"]["Bytes"]
            if nbytes > 0:
                allocated[address] = nbytes
            elif allocated.pop(address, None) is None:
                continue  # a block from before the region
            live += nbytes
            step_peak, peak = max(step_peak, live), max(peak, live)
        while len(timeline) < len(marks):
            timeline.append(StepMemory(len(timeline), live, step_peak))
            step_peak = live
        at_peak = {"weights": self.weights}  # no kv / logits / other: see the module docstring
        return MemoryReport("cpu", self.method, self.weights, self.weights + peak, None, timeline, at_peak)

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
