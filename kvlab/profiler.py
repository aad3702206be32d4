"""An independent CPU memory meter: PyTorch's profiler, to check the live-storage counter against.

`torch.profiler.profile(profile_memory=True)` records every allocation and free that goes through
c10's CPU allocator, in time order, as `[memory]` events (bytes > 0 allocated, < 0 freed, with the
block's address). That is a different witness from `kvlab.meter.LiveStorageCounter`, which sees
only the outputs of dispatched aten ops:

- it sees what no op outputs: workspaces that a kernel allocates and frees before it returns (SDPA's
  per-thread buffers), dtype casts inside a kernel, Python scalars wrapped into 0-dim tensors by the
  argument parser, storages built without an op (`torch.load`, `torch.UntypedStorage(n)`);
- it does not see memory that c10 did not allocate (`torch.from_numpy`, `torch.frombuffer`: numpy's
  or Python's buffers), nor, like the counter, allocations made in a Python thread other than the
  one that entered the profiler;
- blocks allocated before the region and freed inside it are not reported by c10 (it logs "Memory
  block of unknown size was allocated before the profiling started"), and we ignore any free of an
  address the region did not allocate, so, as for the counter, `peak_bytes` is the peak of bytes
  allocated inside the region and not yet freed.

Cost: the profiler records every op, and the events are read back through the public
`export_chrome_trace`, a JSON file of every op event (a few MB for a short decode, growing with the
number of ops). A 24-step toy decode took about 4x its plain time under it, 2x under the counter.
It is a cross-check, not the meter for sweeps; it reads CPU allocations only (meta has none; on CUDA
the allocator's own counters are the meter).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile

from torch.profiler import ProfilerActivity, profile

CPU = 0  # the "Device Type" of a [memory] event (c10::DeviceType::CPU)


@contextlib.contextmanager
def quiet_stderr():
    """Kineto (torch 2.13) writes timestamped "profiler_start/stop" lines to the process's stderr whatever
    KINETO_LOG_LEVEL says; they would land in executed notebooks. Silence file descriptor 2 around the
    profiler's start and stop only (not around the measured run)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class ProfiledAllocations:
    """`with ProfiledAllocations() as p: ...` → `p.peak_bytes`, `p.live_bytes` (at exit), `p.events`.

    `events` is the region's CPU allocator events in time order: (address, bytes), bytes < 0 for a free;
    `times` their profiler timestamps (µs). `mark`: the name of a `record_function` region the caller
    opens at chosen moments (e.g. the end of each decoding step); `marks` are their timestamps.
    """

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
        return False


def profiler_peak(fn, *args, **kwargs) -> int:
    """Peak CPU bytes allocated while `fn(*args, **kwargs)` runs and not yet freed, as the profiler saw it."""
    with ProfiledAllocations() as allocations:
        fn(*args, **kwargs)
    return allocations.peak_bytes
