"""A stream of requests of different batch sizes and encoder lengths, served with one cache design each.

    python -m kvlab stream encdec-cpu --out data/encdec/cpu

Modes (how each request gets its KV cache):
  hf-static    transformers' own `generate(cache_implementation="static")`: a new static cache per call,
               sized to that call's batch, decoder length and encoder length;
  reused       kvlab's `ReusableStaticCache(shapes="exact")`: one cache allocated at the maxima, every
               request served from views of it;
  reused-max   the same cache with `shapes="max"`: every request padded (and masked) to the maxima, so a
               compiled decoder sees one shape (T5 / BART only);
  dynamic      kvlab's loop with the default `EncoderDecoderCache(DynamicCache(), DynamicCache())`.

One record per request (flat, with provenance, as every kvlab record): the bytes the server held from
earlier requests (the reused cache), the peak of bytes allocated while the request ran and not yet freed
(encoder and decoding), their sum (the footprint), the bytes and the number of allocations made, the bytes of cache tensors that
were new (a storage that did not exist before the request), the cache's size measured and predicted,
whether the tokens equal transformers' `generate()`, and, from a plain (unmetered) pass, the time and,
with `torch.compile`, the graphs dynamo compiled while the request ran. On CPU the memory figures come
from kvlab's live-storage counter (checked against PyTorch's profiler); on CUDA from the caching
allocator's statistics, which add the reserved memory and its fragmentation (inactive split blocks /
reserved).
"""

from __future__ import annotations

import datetime
import gc
import os
import random
import sys
import time
import weakref
from pathlib import Path

import torch
import yaml

from .. import encdec, models
from ..compat import cache_from_outputs
from ..models import ENCODER_DECODERS, check_device, element_size, load_config, parse_dtype, resolve_device
from ..meter import LiveStorageCounter
from .reusable_cache import ReusableStaticCache
from ..lab.point import DEFAULTS as POINT_DEFAULTS
from ..lab.shipped import shipped_or_path

MODES = ("hf-static", "reused", "reused-max", "dynamic")
STREAMS_DIR = Path(__file__).resolve().parents[1] / "lab" / "streams"
COLUMNS = [
    "stream", "mode", "request", "batch", "encoder_length", "new_tokens", "preset", "overrides", "dtype", "device",
    "max_batch", "max_encoder_length", "compile_backend", "meter", "held_bytes", "peak_bytes", "footprint_bytes", "allocated_bytes", "allocations",
    "new_cache_bytes", "cache_bytes", "predicted_cache_bytes", "reserved_peak_bytes", "inactive_split_bytes",
    "fragmentation", "compiles", "tokens_match", "seconds", "tokens_per_s", "device_name", "torch_version",
    "transformers_version", "kvlab_version", "python_version", "git_commit", "measured_at",
]


# -- what a stream is ----------------------------------------------------------------------------
def stream_file(name: str | os.PathLike) -> Path:
    """An existing path, or the name of a stream shipped in kvlab/lab/streams/."""
    return shipped_or_path(name, STREAMS_DIR, "stream")


DEFAULTS = dict(preset="t5-small", overrides="", **{key: POINT_DEFAULTS[key] for key in ("dtype", "device", "seed")},
                new_tokens=16, count=12, batches=[1, 2, 4], encoder_lengths=[16, 32, 64], ragged=True,
                modes=list(MODES), compile_backend="none", check_tokens=True, description="")


def load_stream(name, **overrides) -> dict:
    """A stream's settings: the file's values over DEFAULTS, then `overrides`; checked before anything runs."""
    path = stream_file(name)
    try:
        spec = yaml.safe_load(path.read_text()) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise ValueError(f"{path}: not a readable YAML stream file ({' '.join(str(error).split())})") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: a stream file is a mapping of settings: {', '.join(DEFAULTS)}")
    unknown = set(spec) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {', '.join(sorted(unknown))}; valid: {', '.join(DEFAULTS)}")
    return check({**DEFAULTS, **spec, **{k: v for k, v in overrides.items() if v is not None}},
                 name=Path(str(name)).stem)


def check(settings: dict, name: str = "stream") -> dict:
    s = dict(settings, name=settings.get("name", name))
    config = load_config(s["preset"], s["overrides"])  # a bad preset or override fails here
    if not config.is_encoder_decoder:
        raise ValueError(f"{s['preset']} is a decoder: stream serves encoder-decoder models (e.g. "
                         f"{', '.join(ENCODER_DECODERS)}); use `python -m kvlab measure` (or predict, compare, sweep)")
    for key in ("new_tokens", "count", "seed"):  # an integer as written: 1.5 is refused, not cut to 1
        lowest = 0 if key == "seed" else 1
        if isinstance(s[key], bool) or not isinstance(s[key], int) or s[key] < lowest:
            raise ValueError(f"{key} must be {'an integer >= 0' if lowest == 0 else 'a positive integer'}, "
                             f"got {s[key]!r}")
    for key in ("batches", "encoder_lengths"):
        values = s[key] if isinstance(s[key], list) else [s[key]]
        if not values or any(not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"{key} must be a list of positive integers, got {s[key]!r}")
        s[key] = values
    modes = s["modes"] if isinstance(s["modes"], list) else str(s["modes"]).split(",")
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from: {', '.join(MODES)}")
    if "reused-max" in modes and encdec.is_whisper(config):
        raise ValueError("reused-max pads and masks the encoder output, but Whisper's decoder applies no encoder "
                         "mask; choose from: hf-static, reused, dynamic")
    s["modes"] = modes
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
    pairs += [(rng.choice(settings["batches"]), rng.choice(settings["encoder_lengths"]))
              for _ in range(settings["count"] - 1)]
    return pairs


# -- theory --------------------------------------------------------------------------------------
def cache_bytes_per_position(config, dtype: str) -> int:
    """Bytes one position of one row adds to a cache: keys and values, every decoder layer."""
    layers, heads, head_dim = encdec.decoder_shape(config)
    return 2 * layers * heads * head_dim * element_size(dtype)


def predicted_cache_bytes(config, dtype: str, mode: str, batch: int, encoder_length: int, new_tokens: int,
                          max_batch: int, max_encoder_length: int) -> int:
    """The cache a request holds at its end. Reused: the buffers at the maxima, known before the first
    request. Per call (hf-static, dynamic): self-attention over the `new_tokens` positions fed (the start
    token and all generated tokens but the last) plus cross-attention over the encoder output."""
    per = cache_bytes_per_position(config, dtype)
    if mode.startswith("reused"):
        return per * max_batch * (new_tokens + max_encoder_length)
    return per * batch * (new_tokens + encoder_length)


# -- measuring -----------------------------------------------------------------------------------
class AllocationCounter(LiveStorageCounter):
    """kvlab's live-storage counter (peak) that also counts the storages it sees made and their bytes.

    Checked against PyTorch's profiler in tests/test_encdec_stream.py: every allocation above 256 bytes
    is the same, in number and size; what it does not see are c10's small internal ones (the 0-dim
    tensors the argument parser wraps Python scalars in, a few bytes each)."""

    def __init__(self):
        super().__init__()
        self.allocations = self.allocated_bytes = 0
        self.sizes: list[int] = []

    def _add(self, nbytes: int):
        if nbytes > 0:  # a new storage, or one resized larger
            self.allocations += 1
            self.allocated_bytes += nbytes
            self.sizes.append(nbytes)
        super()._add(nbytes)


class RequestMeter:
    """Allocator facts of one request: CUDA's statistics, or kvlab's live-storage counter on CPU."""

    def __init__(self, device: str):
        self.cuda = torch.device(device).type == "cuda"
        self.device = device

    def __enter__(self):
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_stats(self.device)
        else:
            self.counter = AllocationCounter().__enter__()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            end = torch.cuda.memory_stats(self.device)
            self.result = dict(
                meter="cuda-allocator",
                peak_bytes=end["allocated_bytes.all.peak"] - self.start["allocated_bytes.all.current"],
                allocated_bytes=end["allocated_bytes.all.allocated"] - self.start["allocated_bytes.all.allocated"],
                allocations=end["allocation.all.allocated"] - self.start["allocation.all.allocated"],
                reserved_peak_bytes=end["reserved_bytes.all.peak"],
                inactive_split_bytes=end["inactive_split_bytes.all.current"],
                fragmentation=round(end["inactive_split_bytes.all.current"] / max(end["reserved_bytes.all.current"], 1), 4))
        else:
            self.counter.__exit__(*exc)
            self.result = dict(meter="live-storages", peak_bytes=self.counter.peak_bytes,
                               allocated_bytes=self.counter.allocated_bytes, allocations=self.counter.allocations)
        return False


def cache_tensors(cache) -> list[torch.Tensor]:
    return [t for part in (cache.self_attention_cache, cache.cross_attention_cache) for layer in part.layers
            for t in (layer.keys, layer.values) if t is not None]


def _base(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor._base is None else tensor._base


def dynamo_graphs() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


class Server:
    """Serves requests in one mode; keeps what a server keeps between requests (the reused cache, the
    compiled step) and nothing else."""

    def __init__(self, model, mode: str, settings: dict, max_batch: int, max_encoder_length: int):
        self.model, self.mode, self.settings = model, mode, settings
        self.max_batch, self.max_encoder_length = max_batch, max_encoder_length
        self.reusable = None  # built inside the first request, so that request pays for it
        backend = settings["compile_backend"]
        self.step = None
        self.generate_options = {}
        if backend != "none":
            if mode == "hf-static":
                from transformers.generation.configuration_utils import CompileConfig
                config = CompileConfig(backend=backend, mode="default")
                config._compile_all_devices = True  # generate() compiles only on accelerators unless told
                self.generate_options = dict(compile_config=config)
            elif mode != "dynamic":  # a dynamic cache changes shape every step: not compiled (as in generate())
                self.step = torch.compile(encdec.decoder_step, backend=backend)

    def serve(self, request: encdec.Request):
        """(tokens, the cache the request used)."""
        new = self.settings["new_tokens"]
        if self.mode == "hf-static":
            with torch.no_grad():
                return self._hf_generate(request, new)
        cache = None
        if self.mode.startswith("reused"):
            if self.reusable is None:
                self.reusable = ReusableStaticCache(
                    self.model.config, self.max_batch, new, self.max_encoder_length, device=self.model.device,
                    dtype=self.model.dtype, shapes="max" if self.mode == "reused-max" else "exact")
            cache = self.reusable
        out = encdec.generate(self.model, request, new, cache, step=self.step)
        return out.tokens, out.cache

    def _hf_generate(self, request, new):
        out = encdec.generate_reference(self.model, request, new, whole_output=True, cache_implementation="static",
                                        **self.generate_options)
        return out.sequences[:, 1:], cache_from_outputs(out)


def run_stream(model, settings: dict, mode: str, progress=None) -> list[dict]:
    """Serve the stream in one mode, twice: a plain pass (time, dynamo's compiles, tokens checked against
    transformers' `generate()`), then a metered pass with a fresh server and the compiled graphs warm
    (memory: the meter slows every op, so it never runs in the timed pass). One record per request."""
    from ..lab.point import provenance
    pairs = requests(settings)
    max_batch = max(b for b, _ in pairs)
    max_encoder = max(e for _, e in pairs)
    device, dtype, new = settings["device"], settings["dtype"], settings["new_tokens"]
    made = [encdec.make_request(model, b, e, seed=settings["seed"] + i, ragged=settings["ragged"])
            for i, (b, e) in enumerate(pairs)]
    torch._dynamo.reset()  # every mode compiles from scratch
    records = []
    timed = Server(model, mode, settings, max_batch, max_encoder)
    if progress is not None:
        progress.set_postfix_str(f"{mode}, timed pass")
    for index, request in enumerate(made):
        graphs = dynamo_graphs()
        _synchronize(device)
        started = time.perf_counter()
        tokens, _ = timed.serve(request)
        _synchronize(device)
        seconds = time.perf_counter() - started
        match = None
        if settings["check_tokens"]:
            match = bool(torch.equal(tokens, encdec.generate_reference(model, request, new)))
        records.append(dict(
            stream=settings["name"], mode=mode, request=index, batch=request.batch,
            encoder_length=request.encoder_length, new_tokens=new, preset=settings["preset"],
            overrides=settings["overrides"], dtype=dtype, device=device, max_batch=max_batch,
            max_encoder_length=max_encoder, compile_backend=settings["compile_backend"],
            compiles=dynamo_graphs() - graphs if settings["compile_backend"] != "none" else None,
            tokens_match=match, seconds=round(seconds, 4), tokens_per_s=round(request.batch * new / seconds, 2)))
    if progress is not None:  # the bar counts requests done, i.e. metered
        progress.set_postfix_str(f"{mode}, metered pass")
    metered = Server(model, mode, settings, max_batch, max_encoder)
    metered.step = timed.step
    seen_bases = weakref.WeakValueDictionary()  # id -> base tensor of a cache storage made before this request
    for record, request in zip(records, made):
        held = metered.reusable.nbytes if metered.reusable is not None else 0  # kept from earlier requests
        with RequestMeter(device) as meter:
            _, cache = metered.serve(request)
        bases = {id(_base(t)): _base(t) for t in cache_tensors(cache)}
        new_cache = sum(b.untyped_storage().nbytes() for key, b in bases.items() if seen_bases.get(key) is not b)
        seen_bases.update(bases)
        record.update(meter.result, held_bytes=held, footprint_bytes=held + meter.result["peak_bytes"],
                      new_cache_bytes=new_cache,
                      cache_bytes=sum(b.untyped_storage().nbytes() for b in bases.values()),
                      predicted_cache_bytes=predicted_cache_bytes(model.config, dtype, mode, request.batch,
                                                                  request.encoder_length, new, max_batch, max_encoder),
                      **provenance(device))
        del cache, bases
        if progress is not None:
            progress.update(1)
    return records


def _synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# -- the results file ----------------------------------------------------------------------------
def write_records(path: Path, records: list[dict]) -> None:
    """Replace the stream's rows of these modes in PATH (one row per request), keep the others: the sweep's
    store (kvlab.lab.store), its file lock and its all-at-once replace."""
    from ..lab.store import replace_rows
    done = {(r["stream"], r["mode"]) for r in records}
    replace_rows(path, records, lambda row: (row["stream"], row["mode"]) in done, COLUMNS)


def load_records(path):
    import pandas as pd
    path = Path(path)
    return pd.read_csv(path / "results.csv" if path.is_dir() else path, dtype={"overrides": "string"}).assign(
        overrides=lambda t: t["overrides"].fillna(""))


def run(settings: dict, out: Path | None = None, progress: bool = True) -> list[dict]:
    """Every mode of the stream, one after the other on one model; rows written to OUT/results.csv."""
    from tqdm.auto import tqdm
    model = models.build_model(settings["preset"], settings["overrides"], settings["device"], settings["dtype"],
                               settings["seed"])
    records = []
    with tqdm(total=settings["count"] * len(settings["modes"]), desc=f"stream {settings['name']}",
              unit="request", disable=not progress) as bar:
        for mode in settings["modes"]:
            mode_records = run_stream(model, settings, mode, progress=bar)
            records += mode_records
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
                write_records(out / "results.csv", mode_records)
    return records


# -- command line: `python -m kvlab stream` (its options are in kvlab.lab.cli) -------------------------
def serve(args, command: str) -> None:
    """Check the settings and the results folder, then serve the stream in every mode and log the run."""
    overrides = ",".join(args.override) if args.override else ("" if args.preset else None)
    settings = load_stream(args.stream, preset=args.preset, overrides=overrides, modes=args.modes, count=args.count,
                           device=args.device, compile_backend=args.compile_backend)
    out = results_folder(args.out or Path("results") / settings["name"])
    started = datetime.datetime.now(datetime.timezone.utc)
    run(settings, out)
    _provenance(out, command, settings, started)
    count, modes = settings["count"], len(settings["modes"])
    print(f"{out / 'results.csv'}: {count} request{'s' * (count != 1)} x {modes} mode{'s' * (modes != 1)}",
          file=sys.stderr)


def results_folder(out) -> Path:
    """OUT, made if need be and writable: checked before the first request, so no mode's work is lost."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a results folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"--out {out}: cannot make this folder ({error.strerror})") from None
    if not os.access(out, os.W_OK):
        raise ValueError(f"--out {out}: this folder is not writable")
    return out


def _provenance(out: Path, command: str, settings: dict, started) -> None:
    """This run in OUT/provenance.json, as a sweep logs its runs (load average: a busy machine slows timings)."""
    from ..lab.store import append_run
    append_run(out, command, started, settings["device"], settings=dict(settings))
