"""An independent CPU memory meter: PyTorch's profiler, to check the live-storage counter against.

`torch.profiler.profile(profile_memory=True)` records every allocation and free of c10's CPU allocator as
`[memory]` events, a different witness from `kvlab.meter.LiveStorageCounter` (which sees dispatched ops'
outputs): it sees kernel workspaces, casts inside a kernel, wrapped Python scalars and storages built without
an op; it misses memory c10 did not allocate and other threads' allocations. A free of a block from before the
region is ignored, so, as for the counter, `peak_bytes` is of bytes allocated inside the region. The events are
read back through the public `export_chrome_trace`: a cross-check (about 4x a plain run), not the sweeps' meter.
"""

from __future__ import annotations

import json
import os
import tempfile

from torch.profiler import ProfilerActivity, profile

from .meter import quiet_stderr

CPU = 0  # the "Device Type" of a [memory] event (c10::DeviceType::CPU)


class ProfiledAllocations:
    """`with ProfiledAllocations() as p: ...` → `p.peak_bytes`, `p.live_bytes` (at exit), `p.events`: (address,
    bytes < 0 for a free) in time order, `times` (µs); `marks`: the times of `record_function(mark)` regions."""

    def __init__(self, mark: str | None = None):
        self.mark = mark
        self.events: list[tuple[int, int]] = []
        self.times: list[float] = []
        self.marks: list[float] = []
        self.peak_bytes = self.live_bytes = 0

    def __enter__(self):
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with quiet_stderr():
            self._profile.__enter__()
        return self

    def __exit__(self, *exc):
        with quiet_stderr():
            self._profile.__exit__(*exc)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "trace.json")
            self._profile.export_chrome_trace(path)
            with open(path) as file:
                trace = json.load(file)
        del self._profile
        self.marks = sorted(e["ts"] for e in trace["traceEvents"] if self.mark and e.get("name") == self.mark)
        memory = [e for e in trace["traceEvents"] if e.get("name") == "[memory]" and e["args"]["Device Type"] == CPU]
        # Time order; "Ev Idx" (recording order) breaks ties between events in the same nanosecond.
        memory.sort(key=lambda e: (e["ts"], e["args"]["Ev Idx"]))
        allocated: dict[int, int] = {}  # address -> bytes, blocks allocated in the region and still live
        for event in memory:
            address, nbytes = event["args"]["Addr"], event["args"]["Bytes"]
            if nbytes > 0:
                allocated[address] = nbytes
            elif allocated.pop(address, None) is None:
                continue  # a block from before the region (c10 can remember one from an earlier profile)
            self.events.append((address, nbytes))
            self.times.append(event["ts"])
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)


def profiler_peak(fn, *args, **kwargs) -> int:
    """Peak CPU bytes allocated while `fn(*args, **kwargs)` runs and not yet freed, as the profiler saw it."""
    with ProfiledAllocations() as allocations:
        fn(*args, **kwargs)
    return allocations.peak_bytes
