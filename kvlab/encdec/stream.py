"""A stream of requests of different batch sizes and encoder lengths, served with one cache design each.

    python -m kvlab stream encdec-cpu --out data/encdec/cpu

Modes: hf-static (`generate(cache_implementation="static")`, a new cache per call), reused and reused-max
(`ReusableStaticCache`, shapes "exact" and "max"), dynamic (kvlab's loop on a `DynamicCache` pair). One record
per request, with provenance, through kvlab.lab.store; fields and findings: docs/encoder-decoder.md.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import random
import time
import weakref
from pathlib import Path

import torch

from .. import encdec, models
from ..compat import cache_from_outputs
from ..schema import DEFAULTS as POINT_DEFAULTS
from ..lab.provenance import provenance
from ..lab.shipped import read_yaml, shipped_or_path
from ..lab.store import append_run, load_results, prepare_folder, replace_rows
from ..loops import check_choice
from ..meter import LiveStorageCounter
from ..configs import load_config
from ..models import check_device, element_size, parse_dtype, resolve_device
from ..presets import ENCODER_DECODERS
from .reusable_cache import ReusableStaticCache

MODES = ("hf-static", "reused", "reused-max", "dynamic")
STREAMS_DIR = Path(__file__).resolve().parents[1] / "lab" / "streams"
# Fixed column order: CUDA's columns stay in place (empty) for CPU rows, as in data/encdec/.
COLUMNS = ["stream", "mode", "request", "batch", "encoder_length", "new_tokens", "preset", "overrides", "dtype",
           "device", "max_batch", "max_encoder_length", "compile_backend", "meter", "held_bytes", "peak_bytes",
           "footprint_bytes", "allocated_bytes", "allocations", "new_cache_bytes", "cache_bytes",
           "predicted_cache_bytes", "reserved_peak_bytes", "inactive_split_bytes", "fragmentation", "compiles",
           "tokens_match", "seconds", "tokens_per_s", "device_name", "torch_version", "transformers_version",
           "kvlab_version", "python_version", "git_commit", "measured_at"]
DEFAULTS = dict(preset="t5-small", overrides="", **{key: POINT_DEFAULTS[key] for key in ("dtype", "device", "seed")},
                new_tokens=16, count=12, batches=[1, 2, 4], encoder_lengths=[16, 32, 64], ragged=True,
                modes=list(MODES), compile_backend="none", check_tokens=True, description="")

# An existing path, or the name of a stream shipped in kvlab/lab/streams/.
stream_file = functools.partial(shipped_or_path, folder=STREAMS_DIR, what="stream")


# -- what a stream is ----------------------------------------------------------------------------
def load_stream(name, **overrides) -> dict:
    """A stream's settings: the file's values over DEFAULTS, then `overrides`; checked before anything runs."""
    path = stream_file(name)
    spec = read_yaml(path, "stream")
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: a stream file is a mapping of settings: {', '.join(DEFAULTS)}")
    if unknown := set(spec) - set(DEFAULTS):
        raise ValueError(f"{name}: unknown key(s) {', '.join(sorted(unknown))}; valid: {', '.join(DEFAULTS)}")
    return check({**DEFAULTS, **spec, **{k: v for k, v in overrides.items() if v is not None}},
                 name=Path(str(name)).stem)


def check(settings: dict, name: str = "stream") -> dict:
    s = dict(settings, name=settings.get("name", name))
    config = load_config(s["preset"], s["overrides"])  # a bad preset or override fails here
    if not config.is_encoder_decoder:
        raise ValueError(f"{s['preset']} is a decoder: stream serves encoder-decoder models (e.g. "
                         f"{', '.join(ENCODER_DECODERS)}); use `python -m kvlab measure` (or predict, compare, sweep)")
    for key, lowest in (("new_tokens", 1), ("count", 1), ("seed", 0)):  # as written: 1.5 is refused, not cut to 1
        if isinstance(s[key], bool) or not isinstance(s[key], int) or s[key] < lowest:
            raise ValueError(f"{key} must be {'a positive integer' if lowest else 'an integer >= 0'}, got {s[key]!r}")
    for key in ("batches", "encoder_lengths"):
        s[key] = s[key] if isinstance(s[key], list) else [s[key]]
        if not s[key] or any(not isinstance(v, int) or v < 1 for v in s[key]):
            raise ValueError(f"{key} must be a list of positive integers, got {settings[key]!r}")
    s["modes"] = s["modes"] if isinstance(s["modes"], list) else str(s["modes"]).split(",")
    for mode in s["modes"]:
        check_choice("mode", mode, MODES)
    if "reused-max" in s["modes"] and encdec.is_whisper(config):
        raise ValueError("reused-max pads and masks the encoder output, but Whisper's decoder applies no encoder "
                         "mask; choose from: hf-static, reused, dynamic")
    s["device"] = check_device(resolve_device(s["device"]))
    if torch.device(s["device"]).type == "meta":
        raise ValueError("a stream runs its requests (timed, tokens checked against generate()), which the meta "
                         "device cannot; choose one of: cpu, cuda, auto")
    parse_dtype(s["dtype"])
    s["compile_backend"] = str(s["compile_backend"])
    return s


def requests(settings: dict) -> list[tuple[int, int]]:
    """The stream: (batch, encoder length) pairs drawn with the stream's seed; the first is the largest,
    as a server's warm-up request would be (so every mode's first request sizes its cache for the rest)."""
    rng = random.Random(settings["seed"])
    pairs = [(max(settings["batches"]), max(settings["encoder_lengths"]))]
    return pairs + [(rng.choice(settings["batches"]), rng.choice(settings["encoder_lengths"]))
                    for _ in range(settings["count"] - 1)]


# -- theory --------------------------------------------------------------------------------------
def cache_bytes_per_position(config, dtype: str) -> int:
    """Bytes one position of one row adds to a cache: keys and values, every decoder layer."""
    layers, heads, head_dim = encdec.decoder_shape(config)
    return 2 * layers * heads * head_dim * element_size(dtype)


def predicted_cache_bytes(config, dtype: str, mode: str, batch: int, encoder_length: int, new_tokens: int,
                          max_batch: int, max_encoder_length: int) -> int:
    """The cache a request holds at its end: reused, the buffers at the maxima; per call (hf-static, dynamic),
    self-attention over the `new_tokens` positions fed plus cross-attention over the encoder output."""
    if mode.startswith("reused"):
        batch, encoder_length = max_batch, max_encoder_length
    return cache_bytes_per_position(config, dtype) * batch * (new_tokens + encoder_length)


# -- measuring -----------------------------------------------------------------------------------
class AllocationCounter(LiveStorageCounter):
    """kvlab's live-storage counter (peak) that also keeps the size of every storage it sees made: above 256
    bytes the same, in number and size, as PyTorch's profiler (tests/infra/test_encdec_stream.py)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def _add(self, nbytes: int):
        if nbytes > 0:  # a new storage, or one resized larger
            self.sizes.append(nbytes)
        super()._add(nbytes)


@contextlib.contextmanager
def request_meter(device: str):
    """Allocator facts of one request, in the dict it yields, filled as the block ends: CUDA's allocator
    statistics (with reserved memory and fragmentation), or on CPU kvlab's live-storage counter."""
    result = {}
    gc.collect()
    if torch.device(device).type != "cuda":
        with AllocationCounter() as counter:
            yield result
        result.update(meter="live-storages", peak_bytes=counter.peak_bytes, allocated_bytes=sum(counter.sizes),
                      allocations=len(counter.sizes))
        return
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_stats(device)
    yield result
    torch.cuda.synchronize(device)
    end = torch.cuda.memory_stats(device)
    inactive = end["inactive_split_bytes.all.current"]
    result.update(meter="cuda-allocator",
                  peak_bytes=end["allocated_bytes.all.peak"] - start["allocated_bytes.all.current"],
                  allocated_bytes=end["allocated_bytes.all.allocated"] - start["allocated_bytes.all.allocated"],
                  allocations=end["allocation.all.allocated"] - start["allocation.all.allocated"],
                  reserved_peak_bytes=end["reserved_bytes.all.peak"], inactive_split_bytes=inactive,
                  fragmentation=round(inactive / max(end["reserved_bytes.all.current"], 1), 4))


class Server:
    """Serves requests in one mode, keeping between requests what a server keeps: the reused cache (built in its
    first request, which pays for it) and the compiled decoder step (`step`: one compiled already)."""

    def __init__(self, model, mode: str, settings: dict, max_batch: int, max_encoder_length: int, step=None):
        self.model, self.mode, self.new_tokens, self.step = model, mode, settings["new_tokens"], step
        self.max_batch, self.max_encoder_length = max_batch, max_encoder_length
        self.reusable, self.generate_options = None, {}
        backend = settings["compile_backend"]
        if backend != "none" and mode == "hf-static":
            from transformers.generation.configuration_utils import CompileConfig
            config = CompileConfig(backend=backend, mode="default")
            config._compile_all_devices = True  # generate() compiles only on accelerators unless told
            self.generate_options = dict(compile_config=config)
        elif backend != "none" and mode != "dynamic" and step is None:  # a dynamic cache changes shape every step
            self.step = torch.compile(encdec.decoder_step, backend=backend)

    def serve(self, request: encdec.Request):
        """(tokens, the cache the request used)."""
        if self.mode == "hf-static":
            with torch.no_grad():
                out = encdec.generate_reference(self.model, request, self.new_tokens, whole_output=True,
                                                cache_implementation="static", **self.generate_options)
            return out.sequences[:, 1:], cache_from_outputs(out)
        if self.mode.startswith("reused") and self.reusable is None:
            self.reusable = ReusableStaticCache(
                self.model.config, self.max_batch, self.new_tokens, self.max_encoder_length, device=self.model.device,
                dtype=self.model.dtype, shapes="max" if self.mode == "reused-max" else "exact")
        out = encdec.generate(self.model, request, self.new_tokens, self.reusable, step=self.step)
        return out.tokens, out.cache


def run_stream(model, settings: dict, mode: str, bar) -> list[dict]:
    """Serve the stream in one mode, twice: a plain pass (time, dynamo's compiles, tokens against `generate()`),
    then a metered pass, a fresh server with the compiled step warm (the meter slows every op, so it never runs
    in the timed pass). One record per request; `bar` (tqdm) counts the requests metered."""
    from torch._dynamo.utils import counters
    pairs = requests(settings)
    max_batch, max_encoder = pairs[0]  # the largest request comes first
    device, dtype, new = settings["device"], settings["dtype"], settings["new_tokens"]
    compiled = settings["compile_backend"] != "none"
    synchronize = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda device: None
    made = [encdec.make_request(model, b, e, seed=settings["seed"] + i, ragged=settings["ragged"])
            for i, (b, e) in enumerate(pairs)]
    torch._dynamo.reset()  # every mode compiles from scratch
    records = []
    timed = Server(model, mode, settings, max_batch, max_encoder)
    bar.set_postfix_str(f"{mode}, timed pass")
    for index, request in enumerate(made):
        graphs = counters["stats"]["unique_graphs"]
        synchronize(device)
        started = time.perf_counter()
        tokens, _ = timed.serve(request)
        synchronize(device)
        seconds = time.perf_counter() - started
        records.append(dict(
            stream=settings["name"], mode=mode, request=index, batch=request.batch,
            encoder_length=request.encoder_length, new_tokens=new, preset=settings["preset"],
            overrides=settings["overrides"], dtype=dtype, device=device, max_batch=max_batch,
            max_encoder_length=max_encoder, compile_backend=settings["compile_backend"],
            compiles=counters["stats"]["unique_graphs"] - graphs if compiled else None,
            tokens_match=bool(torch.equal(tokens, encdec.generate_reference(model, request, new)))
            if settings["check_tokens"] else None,
            seconds=round(seconds, 4), tokens_per_s=round(request.batch * new / seconds, 2)))
    bar.set_postfix_str(f"{mode}, metered pass")
    metered = Server(model, mode, settings, max_batch, max_encoder, step=timed.step)
    seen = weakref.WeakValueDictionary()  # id -> base tensor of a cache storage made before this request
    for record, request in zip(records, made):
        held = sum(t.nbytes for t in metered.reusable.buffers()) if metered.reusable else 0  # kept from earlier
        with request_meter(device) as meter:
            _, cache = metered.serve(request)
        tensors = [t for part in (cache.self_attention_cache, cache.cross_attention_cache) for layer in part.layers
                   for t in (layer.keys, layer.values) if t is not None]
        bases = {id(base): base for base in (t if t._base is None else t._base for t in tensors)}  # views' owners
        record.update(meter, held_bytes=held, footprint_bytes=held + meter["peak_bytes"],
                      new_cache_bytes=sum(b.untyped_storage().nbytes() for key, b in bases.items()
                                          if seen.get(key) is not b),
                      cache_bytes=sum(b.untyped_storage().nbytes() for b in bases.values()),
                      predicted_cache_bytes=predicted_cache_bytes(model.config, dtype, mode, request.batch,
                                                                  request.encoder_length, new, max_batch, max_encoder),
                      **provenance(device))
        seen.update(bases)
        del cache, tensors, bases
        bar.update(1)
    return records


# -- the results file ----------------------------------------------------------------------------
def write_records(path: Path, records: list[dict]) -> None:
    """Replace the stream's rows of these modes in PATH (one row per request), keep the others."""
    done = {(r["stream"], r["mode"]) for r in records}
    replace_rows(path, records, lambda row: (row["stream"], row["mode"]) in done, COLUMNS)


def load_records(path):
    """A stream's rows (or its folder's results.csv) as a DataFrame."""
    return load_results(path, check=False)


def run(settings: dict, out: Path | None = None, progress: bool = True, command: str | None = None) -> list[dict]:
    """Every mode of the stream, one after the other on one model. With OUT, as a sweep: the folder checked
    before the first request, each mode's rows written to OUT/results.csv as it ends, the run logged in
    OUT/provenance.json with `command` (default: this call, spelled out)."""
    from tqdm.auto import tqdm
    if out is not None:
        prepare_folder(out, folders=())
    started = datetime.datetime.now(datetime.timezone.utc)
    model = models.build_model(settings["preset"], settings["overrides"], settings["device"], settings["dtype"],
                               settings["seed"])
    records = []
    with tqdm(total=settings["count"] * len(settings["modes"]), desc=f"stream {settings['name']}",
              unit="request", disable=not progress) as bar:
        for mode in settings["modes"]:
            mode_records = run_stream(model, settings, mode, bar)
            records += mode_records
            if out is not None:
                write_records(Path(out) / "results.csv", mode_records)
    if out is not None:
        append_run(out, command or f"kvlab.encdec.stream.run({settings['name']!r}, {str(out)!r})", started,
                   settings["device"], settings=settings)
    return records
