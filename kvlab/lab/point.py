"""One measured point: parameters in, one flat record (a dict) out. The CLI, the notebooks and every sweep call
it, so a number in a figure always comes from here. Kind "kvlab" decodes with kvlab's cache and loop; kind
"reference" runs the real release's own `generate()` that the (cache, loop) pair stands for (REFERENCES) in a
subprocess (`kvlab.lab.reference`) and returns the same record, so the two sit in one table.
"""

from __future__ import annotations

import datetime
import functools
import gc
import platform
import subprocess
from pathlib import Path

import torch
import transformers

from .. import __version__, theory
from ..caches import CACHES, KVCache, num_layers
from ..loops import LOOPS, STRATEGIES, Sampling, check_choice, generate
from ..meter import MemoryMeter
from ..models import check_device, kv_bytes_per_token, parse_dtype, resolve_device
from .configs import load_config, parse_overrides

# (cache, loop): the <= 4.41 baseline, each of the PR's two fixes alone (v4.42's loop on tuples, v4.40's
# loop on one cache object), the PR as released, then today's loop with every design.
DESIGNS = [("tuple", "v4.40"), ("tuple", "v4.42"), ("dynamic", "v4.40"), ("dynamic", "v4.42"),
           ("dynamic", "v5"), ("list", "v5"), ("static", "v5"), ("prealloc", "v5")]

# kind="reference": (cache, loop) → the transformers release whose own generate() that design reproduces,
# and the cache_implementation it is asked for (None: the release's default cache).
REFERENCES = {("tuple", "v4.40"): ("4.40.1", None), ("dynamic", "v4.42"): ("4.42.4", None),
              ("dynamic", "v5"): ("installed", None), ("static", "v5"): ("installed", "static")}
KINDS = ("kvlab", "reference")
# What a restart passes back to the second call: the cache generate() returned, or (4.42's default, with
# return_legacy_cache=True) that cache's tensors as tuples, which the second call wraps in a new object.
RESTART_FROM = ("cache", "tuples")

DEFAULTS = dict(kind="kvlab", runtime="eager", preset="toy", overrides="", cache="dynamic", loop="v5", strategy="greedy", batch=8,
                prompt=64, new=512, restart_new=0, restart_from="cache", num_beams=4, device="auto", dtype="float32", seed=0,
                chunk_limit=50, block_tokens=32, track_storages="auto", timing=True, force=False)
# A record: the point's parameters (those below), then these fields, in results.csv's column order.
RECORD_PARAMETERS = ("preset", "overrides", "cache", "loop", "kind", "runtime", "strategy", "batch", "prompt", "new",
                     "restart_new", "restart_from", "num_beams", "device", "dtype")
RECORD_FIELDS = ("meter", "baseline_bytes", "peak_bytes", "overhead_bytes", "reserved_peak_bytes",
                 "storages_peak_bytes", "kv_final_bytes", "overhead_over_kv", "predicted_overhead_bytes",
                 "prediction_error", "kv_at_peak_bytes", "logits_at_peak_bytes", "other_at_peak_bytes", "seconds",
                 "tokens_per_s", "graph_build_seconds", "device_name", "torch_version", "transformers_version",
                 "kvlab_version", "python_version", "git_commit", "measured_at")


@functools.lru_cache(maxsize=1)
def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=Path(__file__).resolve().parents[2],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device: str) -> str:
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    if kind == "meta":
        return "meta (no data)"
    try:  # Linux names the processor model here; platform.processor() is often empty
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def provenance(device: str) -> dict:
    return dict(device_name=device_name(device), torch_version=torch.__version__,
                transformers_version=transformers.__version__, kvlab_version=__version__,
                python_version=platform.python_version(), git_commit=git_commit(),
                measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def is_true(value) -> bool:
    """A switch given as a bool, or as text from the command line or a sweep file."""
    return value in (True, "true", "True", "1", 1)


def normalize(**params) -> dict:
    """Fill defaults and check every choice and size, before anything is allocated."""
    from ..graphs import RUNTIMES, check_runtime
    if unknown := set(params) - set(DEFAULTS):
        raise ValueError(f"unknown parameter(s) {', '.join(sorted(unknown))}; valid: {', '.join(DEFAULTS)}")
    p = {**DEFAULTS, **{k: v for k, v in params.items() if v is not None}}
    for key, choices in (("kind", KINDS), ("cache", CACHES), ("loop", LOOPS), ("strategy", STRATEGIES),
                         ("restart_from", RESTART_FROM)):
        check_choice(key, p[key], choices)
    if p["restart_from"] == "tuples" and p["cache"] != "dynamic":
        raise ValueError("restart_from=tuples passes back a dynamic cache's tensors as tuples (4.42's default); "
                         "choose cache dynamic, or restart_from=cache")
    if p["kind"] == "reference":
        if (p["cache"], p["loop"]) not in REFERENCES:
            pairs = ", ".join(f"{cache}/{loop} ({version})" for (cache, loop), (version, _) in REFERENCES.items())
            raise ValueError(f"no transformers release runs {p['cache']}/{p['loop']} in its own generate(); a "
                             f"reference point is one of: {pairs}")
        if p["strategy"] not in ("greedy", "beam"):
            raise ValueError("a reference point decodes greedy or beam")
        # A 4.x release's generate() returns tuples, which its caller passes back: the tuple design, or the
        # dynamic one with restart_from=tuples.
        if int(p["restart_new"]) and (p["strategy"] != "greedy" or p["loop"] == "v5"
                                      or (p["cache"] == "dynamic") != (p["restart_from"] == "tuples")):
            raise ValueError("a reference restart is greedy and passes back what 4.40.1 or 4.42.4 returned: "
                             "tuple/v4.40, or dynamic/v4.42 with restart_from=tuples")
        if str(p["device"]).startswith("meta"):
            raise ValueError("a reference point runs a release's own generate(), which the meta device cannot; "
                             "choose one of: cpu, cuda, auto")
    check_choice("runtime", p["runtime"], RUNTIMES)
    if p["runtime"] != "eager":  # a graph runtime (kvlab.graphs) carries one cache design: the default if none given
        if params.get("cache") is None:
            p["cache"] = RUNTIMES[p["runtime"]][0]
        check_runtime(p["runtime"], p["cache"], p["loop"], p["strategy"])
        if p["kind"] != "kvlab" or int(p["restart_new"]) or resolve_device(p["device"]).startswith("meta"):
            raise ValueError(f"runtime {p['runtime']!r} measures kvlab's own decode (kind kvlab), on cpu or cuda, "
                             "without a restart")
    for key, least in dict(batch=1, prompt=1, new=1, num_beams=1, chunk_limit=1, block_tokens=1, restart_new=0).items():
        p[key] = int(p[key])
        if p[key] < least:
            raise ValueError(f"{key} must be {'a positive integer' if least else 'zero or positive'}, got {p[key]}")
    p["device"] = resolve_device(p["device"])
    check_device(p["device"])
    parse_dtype(p["dtype"])
    if isinstance(p["overrides"], (list, tuple, dict)):
        p["overrides"] = ",".join(f"{k}={v}" for k, v in parse_overrides(p["overrides"]).items())
    config = load_config(p["preset"], p["overrides"])  # raises on a bad preset, key or size, or a hub id not to be had
    if config.is_encoder_decoder:
        raise ValueError(f"{p['preset']} is an encoder-decoder model: measure, predict, compare and sweep run decoders; "
                         "use `python -m kvlab stream`")
    if p["track_storages"] == "auto":
        p["track_storages"] = torch.device(p["device"]).type != "cuda"
    p["track_storages"] = is_true(p["track_storages"])
    # Timing needs real kernels: the meta device has none.
    p["timing"] = is_true(p["timing"]) and torch.device(p["device"]).type != "meta"
    # Skip the check that refuses a point predicted not to fit in the free memory of its device.
    p["force"] = is_true(p["force"])
    return p


def beams(p: dict) -> int:
    """Sequences decoded per prompt: num_beams for beam search, one otherwise."""
    return p["num_beams"] if p["strategy"] == "beam" else 1


def run_point(model=None, **params) -> dict:
    """Measure one point and return its flat record. Pass `model` to reuse one already built."""
    return measure(model, **params)[0]


def measure(model=None, **params):
    """Measure one point: (flat record, the meter's full report with timeline and split).
    A reference point runs in its own process: the report is None and `model` is not used."""
    from ..graphs import GRAPH_RUNTIMES, build_graphs
    p = normalize(**params)
    if not p["force"]:  # refuse a point predicted not to fit, before allocating anything
        from .predict import check_fits
        check_fits(p, model if p["kind"] == "kvlab" else None)
    if p["kind"] == "reference":  # the release's own generate() in a subprocess (kvlab.lab.reference), the same meter
        from .reference import REFERENCE_KEYS, measure_reference
        version, implementation = REFERENCES[(p["cache"], p["loop"])]
        real = measure_reference(version, cache_implementation=implementation, **{key: p[key] for key in REFERENCE_KEYS})
        # Provenance of this process, with the versions the subprocess really ran.
        origin = dict(provenance(p["device"]), transformers_version=real["transformers_version"],
                      torch_version=real["torch_version"])
        return _record(p, load_config(p["preset"], p["overrides"]), real, None, origin), None
    if model is None:
        from ..models import build_model
        model = build_model(p["preset"], p["overrides"], p["device"], p["dtype"], p["seed"])
    # Seeded token ids drawn on the CPU (the same on every device); on meta, shapes only, so that counting a
    # point far beyond this machine's memory allocates nothing real.
    if torch.device(p["device"]).type == "meta":
        prompt = torch.empty((p["batch"], p["prompt"]), dtype=torch.long, device="meta")
    else:
        prompt = torch.randint(0, model.config.vocab_size, (p["batch"], p["prompt"]),
                               generator=torch.Generator().manual_seed(p["seed"])).to(p["device"])
    options = dict(cache=p["cache"], loop=p["loop"], strategy=p["strategy"], num_beams=p["num_beams"],
                   sampling=Sampling(temperature=0.7, top_k=50, top_p=0.9, seed=p["seed"]),
                   cache_options=dict(chunk_limit=p["chunk_limit"], block_tokens=p["block_tokens"],
                                      max_cache_len=p["prompt"] + p["new"] + p["restart_new"] - 1))
    # Trace or export before the meter starts (its time is recorded apart).
    graphs = build_graphs(model, prompt, p["new"], p["runtime"]) if p["runtime"] != "eager" else None
    if p["runtime"] in GRAPH_RUNTIMES or torch.device(p["device"]).type == "cuda":
        # Older garbage collected mid-run would read as a free to the profiler and to CUDA's allocator; the
        # live-storage counter ignores storages from before it started (and a full collection costs ~0.3 s).
        gc.collect()
    if p["runtime"] in GRAPH_RUNTIMES:  # the meter that sees inside the graph
        from ..graphs.meter import graph_meter
        meter = graph_meter(p["device"], model)
    else:
        meter = MemoryMeter(p["device"], model, track_storages=p["track_storages"])
    with meter:
        metered_seconds = _decode(model, prompt, p, options, meter, graphs)
    report = meter.report()
    seconds = None
    if p["timing"]:
        # The live-storage counter and the profiler run Python at every op and slow designs unequally: time a
        # run without them. The CUDA allocator's counters cost nothing: there the measured run is the timed one.
        seconds = metered_seconds if report.method == "cuda-allocator" else _decode(model, prompt, p, options, None,
                                                                                      graphs)
    at_peak = report.at_peak if p["track_storages"] else {}
    measured = dict(meter=report.method, overhead_bytes=report.overhead_bytes,
                    **{key: getattr(report, key) for key in ("baseline_bytes", "peak_bytes", "reserved_peak_bytes",
                                                             "storages_peak_bytes")},
                    **{f"{part}_at_peak_bytes": at_peak.get(part) for part in ("kv", "logits", "other")},
                    graph_build_seconds=round(graphs.build_seconds, 3) if graphs and graphs.build_seconds else None)
    return _record(p, model.config, measured, seconds, provenance(p["device"])), report


def _record(p: dict, config, measured: dict, seconds: float | None, origin: dict) -> dict:
    """The flat record of a measured point: its parameters, what the meter saw, KV, theory, speed, provenance."""
    kv_final = kv_bytes_per_token(config, p["batch"] * beams(p), p["dtype"]) * (p["prompt"] + p["new"] + p["restart_new"])
    predicted = theory.predict_overhead(config, **{k: p[k] for k in theory.POINT_KEYS})
    overhead = measured["overhead_bytes"]
    values = dict(measured, **origin, kv_final_bytes=kv_final, overhead_over_kv=round(overhead / kv_final, 4),
                  predicted_overhead_bytes=predicted,
                  prediction_error=round(overhead / predicted - 1, 4) if predicted else None,
                  seconds=round(seconds, 4) if seconds else None,
                  tokens_per_s=round(p["batch"] * (p["new"] + p["restart_new"]) / seconds, 2) if seconds else None)
    return dict({key: p[key] for key in RECORD_PARAMETERS}, num_beams=beams(p),
                **{key: values.get(key) for key in RECORD_FIELDS})


def _decode(model, prompt, p, options, meter, graphs=None) -> float:
    """One run of the point (a restart included); returns the seconds spent decoding."""
    if p["runtime"] != "eager":
        from ..graphs import generate_graph
        return generate_graph(model, prompt, p["new"], p["runtime"], graphs, meter=meter).seconds
    first = generate(model, prompt, p["new"], meter=meter, **options)
    seconds = first.seconds
    if p["restart_new"]:
        # The caller still holds `first` (and so its cache) while the second call runs.
        past = first.cache
        if p["restart_from"] == "tuples":  # 4.42: to_legacy_cache, then from_legacy_cache (neither copies)
            first.cache = past.to_tuples()
            past = KVCache.from_tuples(first.cache, num_layers(model))
        second = generate(model, first.tokens, p["restart_new"], past=past, meter=meter, **options)
        seconds += second.seconds
        del second, past
    del first
    return seconds
