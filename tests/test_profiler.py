"""The live-storage counter against an independent witness: PyTorch's profiler (c10's CPU allocator events).

First the profiler meter on known allocations, then the two meters on decodes of every cache design,
then each blind spot of the counter: what it sees against what the profiler sees.
"""

import io
import threading

import numpy as np
import pytest
import torch

from kvlab.caches import CACHES
from kvlab.loops import LOOPS, generate
from kvlab.meter import LiveStorageCounter, MemoryMeter
from kvlab.profiler import ProfiledAllocations, profiler_peak

F32 = 4

ENDS = (list(LOOPS)[0], list(LOOPS)[-1])  # the oldest loop and the newest (LOOPS: in release order)


def both(fn):
    """(peak, live at the end) as the counter and as the profiler see two separate runs of `fn`."""
    with LiveStorageCounter() as counter:
        kept = fn()
        counted = counter.peak_bytes, counter.live_bytes
    del kept
    with ProfiledAllocations() as profiled:
        kept = fn()
    del kept
    return counted, (profiled.peak_bytes, profiled.live_bytes)


# -- the profiler meter on known allocations ------------------------------------------------------


def test_profiler_meter_on_known_allocations():
    older = torch.ones(5000)  # from before the region: its free inside is not an allocation of the region

    def run():
        a, b, c = torch.ones(1000), torch.ones(2000), torch.ones(3000)
        del b
        d = torch.cat([a, c])  # 4000 new while a and c live
        del a, c, d

    with ProfiledAllocations() as profiled:
        run()
        del older
    assert profiled.peak_bytes == (1000 + 3000 + 4000) * F32
    assert profiled.live_bytes == 0
    assert [nbytes for _, nbytes in profiled.events] == [4000, 8000, 12000, -8000, 16000, -4000, -12000, -16000]
    assert profiler_peak(run) == (1000 + 3000 + 4000) * F32


def test_a_block_from_an_earlier_profile_is_not_freed_twice():
    with ProfiledAllocations():
        survivor = torch.ones(1000)
    with ProfiledAllocations() as profiled:
        del survivor  # c10 remembers its size from the first profile and reports the free
        newer = torch.ones(500)
    assert (profiled.peak_bytes, profiled.live_bytes) == (500 * F32, 500 * F32)
    del newer


# -- the two meters on decodes ---------------------------------------------------------------------


@pytest.mark.parametrize("loop", ENDS)
@pytest.mark.parametrize("cache", CACHES)
def test_counter_and_profiler_agree_on_a_decode(toy, cache, loop, one_thread):
    # Measured equal to the byte for every design and loop here (greedy, beam and sample; several shapes):
    # the kernels' own transients (below) never fall on these peaks. 1% leaves room for one that does.
    prompt = torch.randint(0, toy.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with MemoryMeter("cpu", toy) as meter:
        generate(toy, prompt, 24, meter=meter, cache=cache, loop=loop)
    with ProfiledAllocations() as profiled:  # a separate run of the same decode
        generate(toy, prompt, 24, cache=cache, loop=loop)
    counted = meter.report().overhead_bytes
    assert counted > 0
    assert abs(profiled.peak_bytes - counted) <= 0.01 * counted, (counted, profiled.peak_bytes)


# -- blind spots of the counter ---------------------------------------------------------------------


def test_python_scalars_and_casts_inside_a_kernel():
    x = torch.ones(1000)
    counted, profiled = both(lambda: x * 2.0)
    # The argument parser wraps 2.0 in a 0-dim float64 tensor (8 bytes) and mul casts it to float32
    # (4 bytes) inside its kernel; both die before the op returns, and no op outputs them.
    assert counted == (1000 * F32, 1000 * F32)
    assert profiled == (1000 * F32 + 8 + 4, 1000 * F32)


def test_attention_workspace_inside_the_sdpa_kernel(one_thread):
    q = torch.randn(2, 4, 64, 32)
    counted, profiled = both(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q))
    output, logsumexp = q.numel() * F32, 2 * 4 * 64 * F32  # the flash kernel's two outputs
    assert counted == (output + logsumexp, output)
    # Per-thread buffers (scores, row max and sum, accumulator) allocated and freed inside the kernel.
    assert profiled[0] > output + logsumexp
    assert profiled[1] == output


def test_storages_built_without_an_op():
    buffer = io.BytesIO()
    torch.save(torch.ones(1000), buffer)

    def load():
        buffer.seek(0)
        return torch.load(buffer)

    assert both(load) == ((0, 0), (1000 * F32, 1000 * F32))
    made = both(lambda: torch.empty(0).set_(torch.UntypedStorage(1000 * F32)))
    assert made == ((0, 0), (1000 * F32, 1000 * F32))


def test_memory_torch_did_not_allocate():
    array = np.ones(1000, dtype=np.float32)
    for wrap in (lambda: torch.from_numpy(array), lambda: torch.frombuffer(bytearray(4000), dtype=torch.float32)):
        assert both(wrap) == ((0, 0), (0, 0))  # numpy's and Python's buffers


def test_tensors_made_in_another_thread():
    made = []

    def in_a_thread():
        worker = threading.Thread(target=lambda: made.append(torch.ones(1000)))
        worker.start()
        worker.join()

    # Both meters are per thread: the dispatch mode's stack and the profiler's memory reporting.
    assert both(in_a_thread) == ((0, 0), (0, 0))
    assert sum(t.nbytes for t in made) == 2 * 1000 * F32


def test_frees_of_older_tensors_are_not_subtracted():
    older = torch.ones(1000)
    with LiveStorageCounter() as counter:
        del older  # frees 4000 bytes allocated before the region
        newer = torch.ones(1000)
    older = torch.ones(1000)
    with ProfiledAllocations() as profiled:
        del older
        newer = torch.ones(1000)
    # The process holds no more than at the start, yet both report the bytes the region allocated.
    assert counter.peak_bytes == profiled.peak_bytes == 1000 * F32
    del newer
