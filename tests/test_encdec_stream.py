"""The request stream: its meter against PyTorch's profiler, its records against the theory, its CLI."""

import collections

import pytest
import torch

from kvlab import encdec, request_stream
from kvlab.profiler import ProfiledAllocations
from kvlab.request_stream import AllocationCounter

T5 = "num_layers=2,num_decoder_layers=2,d_model=64,d_ff=128,num_heads=4,d_kv=16,vocab_size=500"


@pytest.fixture(scope="module")
def t5():
    return encdec.build_model("t5-small", T5)


def test_allocation_counter_matches_the_profiler(t5):
    """Every allocation above 256 bytes, in number and size, as c10's allocator reported it to the profiler;
    the counter's peak equal to the byte."""
    request = encdec.make_request(t5, 3, 20, ragged=True)
    encoded = encdec.encode(t5, request)
    encdec.generate(t5, request, 6, encoder_output=encoded)  # warm-up: first-call allocations of the kernels
    with AllocationCounter() as counter:
        encdec.generate(t5, request, 6, encoder_output=encoded)
    with ProfiledAllocations() as profiled:
        encdec.generate(t5, request, 6, encoder_output=encoded)
    seen = collections.Counter(counter.sizes)
    reported = collections.Counter(nbytes for _, nbytes in profiled.events if nbytes > 0)
    assert not seen - reported  # the counter sees nothing the allocator did not do
    assert {n: k for n, k in seen.items() if n > 256} == {n: k for n, k in reported.items() if n > 256}
    assert counter.allocations == sum(seen.values()) and counter.allocated_bytes == sum(counter.sizes)
    assert counter.peak_bytes == profiled.peak_bytes


@pytest.fixture(scope="module")
def records():
    settings = request_stream.check(dict(request_stream.DEFAULTS, preset="t5-small", overrides=T5, device="cpu",
                                         new_tokens=6, count=5, batches=[1, 2, 3], encoder_lengths=[8, 16, 24],
                                         compile_backend="none"), name="test")
    return request_stream.run(settings, out=None, progress=False)


def test_every_mode_gives_generates_tokens(records):
    assert {r["mode"] for r in records} == set(request_stream.MODES)
    assert all(r["tokens_match"] for r in records)


def test_reused_cache_is_allocated_once_and_as_predicted(records):
    by_mode = collections.defaultdict(list)
    for r in records:
        by_mode[r["mode"]].append(r)
    for mode in ("reused", "reused-max"):
        rows = by_mode[mode]
        size = rows[0]["predicted_cache_bytes"]
        assert [r["new_cache_bytes"] for r in rows] == [size] + [0] * (len(rows) - 1)
        assert all(r["cache_bytes"] == size and r["held_bytes"] == (size if r["request"] else 0) for r in rows)
        assert rows[0]["peak_bytes"] >= size  # the first request pays for the buffers
    for mode in ("hf-static", "dynamic"):  # a new cache every request, of the request's own size
        for r in by_mode[mode]:
            assert r["new_cache_bytes"] == r["cache_bytes"] == r["predicted_cache_bytes"] > 0
            assert r["held_bytes"] == 0
    # The dynamic cache grows by torch.cat: it allocates more bytes than the static one for the same request.
    for static, dynamic in zip(by_mode["hf-static"], by_mode["dynamic"]):
        assert dynamic["allocated_bytes"] > static["allocated_bytes"] - static["cache_bytes"]


def test_stream_cli_refuses_bad_input_in_one_line(capsys):
    from kvlab.__main__ import main
    for args, message in ((["no-such-stream"], "not found; give a path or one of: encdec-cpu"),
                          (["encdec-cpu", "--modes", "fast"], "unknown mode 'fast'; choose from: hf-static"),
                          (["encdec-whisper-cpu", "--modes", "reused-max"], "Whisper's decoder applies no encoder mask"),
                          (["encdec-cpu", "--count", "0"], "count must be a positive integer")):
        with pytest.raises(SystemExit) as exit_:
            main(["stream", *args])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("kvlab stream: error:") and message in err and len(err.strip().splitlines()) == 1


def test_shipped_streams_are_valid():
    for path in sorted(request_stream.STREAMS_DIR.glob("*.yaml")):
        settings = request_stream.load_stream(path, device="cpu")
        pairs = request_stream.requests(settings)
        assert len(pairs) == settings["count"] and pairs[0] == (max(settings["batches"]), max(settings["encoder_lengths"]))
    assert torch.device(request_stream.load_stream("encdec-cpu")["device"]).type == "cpu"
