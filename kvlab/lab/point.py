"""One measured point: parameters in, one flat record (a dict) out. The CLI, the notebooks and every sweep call
it, so a number in a figure always comes from here. Kind "kvlab" decodes with kvlab's cache and loop; kind
"reference" runs the real release's own `generate()` that the (cache, loop) pair stands for (REFERENCES) in a
subprocess (`kvlab.lab.reference`) and returns the same record, so the two sit in one table.
"""

from __future__ import annotations

import contextlib
import gc

import torch

from .. import designs  # noqa: F401 (registers kvlab's own designs, list and prealloc, with make_cache)
from ..caches import KVCache, num_layers
from ..decoding import Sampling, decoding
from ..loops import generate
from ..meter import MemoryMeter
from ..models import final_kv_bytes, random_prompt
from ..planner import theory
from ..planner.dry_run import skipping_forward
from ..planner.meta import MetaAsCpu
from ..planner.params import normalize
from ..planner.plan import check_fits
from ..planner.sources import build_model, load_config
from ..releases import REFERENCE_KEYS, measure_references
from ..schema import POINT_KEYS, REFERENCES, beams, over_kv
from ..theory import MODELED
from .provenance import provenance
from .store import RECORD_FIELDS, RECORD_PARAMETERS


def run_point(model=None, **params) -> dict:
    """Measure one point and return its flat record. Pass `model` to reuse one already built."""
    return measure(model, **params)[0]


def measure(model=None, **params):
    """Measure one point: (flat record, the meter's full report with timeline and split).
    A reference point runs in its own process: the report is None and `model` is not used."""
    from ..graphs import GRAPH_RUNTIMES, build_graphs

    p = normalize(**params)
    if not p["force"]:  # refuse a point predicted not to fit, before allocating anything
        check_fits(p, model if p["kind"] == "kvlab" else None)
    if p["kind"] == "reference":  # the release's own generate() in a subprocess (kvlab.lab.reference), the same meter
        version, implementation = REFERENCES[(p["cache"], p["loop"])]
        point = dict({key: p[key] for key in REFERENCE_KEYS}, cache_implementation=implementation)
        real = measure_references(version, [point], load_config)[0]
        # Provenance of this process, with the versions the subprocess really ran.
        origin = dict(
            provenance(p["device"]),
            transformers_version=real["transformers_version"],
            torch_version=real["torch_version"],
        )
        return _record(p, load_config(p["preset"], p["overrides"]), real, None, origin), None
    if model is None:
        model = build_model(p["preset"], p["overrides"], p["device"], p["dtype"], p["seed"])
    # On meta, shapes only, so that counting a point far beyond this machine's memory allocates nothing real.
    if torch.device(p["device"]).type == "meta":
        prompt = torch.empty((p["batch"], p["prompt"]), dtype=torch.long, device="meta")
    else:
        prompt = random_prompt(model.config.vocab_size, p["batch"], p["prompt"], p["seed"]).to(p["device"])
    options = dict(
        cache=p["cache"],
        loop=p["loop"],
        strategy=decoding(
            p["strategy"], p["num_beams"], Sampling(temperature=0.7, top_k=50, top_p=0.9, seed=p["seed"])
        ),
        cache_options=dict(
            chunk_limit=p["chunk_limit"],
            block_tokens=p["block_tokens"],
            max_cache_len=p["prompt"] + p["new"] + p["restart_new"] - 1,
        ),
    )
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
        seconds = (
            metered_seconds if report.method == "cuda-allocator" else _decode(model, prompt, p, options, None, graphs)
        )
    at_peak = report.at_peak if p["track_storages"] else {}
    measured = dict(
        meter=report.method,
        overhead_bytes=report.overhead_bytes,
        **{
            key: getattr(report, key)
            for key in ("baseline_bytes", "peak_bytes", "reserved_peak_bytes", "storages_peak_bytes")
        },
        **{f"{part}_at_peak_bytes": at_peak.get(part) for part in ("kv", "logits", "other", "kernels")},
        graph_build_seconds=round(graphs.build_seconds, 3) if graphs and graphs.build_seconds else None,
    )
    return _record(p, model.config, measured, seconds, provenance(p["device"])), report


def _record(p: dict, config, measured: dict, seconds: float | None, origin: dict) -> dict:
    """The flat record of a measured point: its parameters, what the meter saw, KV, theory, speed, provenance."""
    kv_final = final_kv_bytes(config, p["batch"] * beams(p), p["prompt"] + p["new"] + p["restart_new"], p["dtype"])
    # No prediction rather than a wrong one for a model type the theory does not walk through.
    modeled = config.model_type in MODELED
    predicted = theory.predict_overhead(config, **{k: p[k] for k in POINT_KEYS}) if modeled else None
    overhead = measured["overhead_bytes"]
    # The theory predicts tensors (and SDPA's scratch): on CPU the live-storage count's peak, not what other
    # kernels allocate inside themselves, which depends on the CPU's kernel library (kernels_at_peak_bytes).
    tensors = overhead
    if measured["meter"] == "cpu-allocator" and measured.get("storages_peak_bytes") is not None:
        tensors = measured["storages_peak_bytes"]  # counted above the start, as the overhead
    values = dict(
        measured,
        **origin,
        kv_final_bytes=kv_final,
        overhead_over_kv=over_kv(overhead, kv_final),
        predicted_overhead_bytes=predicted,
        prediction_error=round(tensors / predicted - 1, 4) if predicted else None,
        seconds=round(seconds, 4) if seconds else None,
        tokens_per_s=round(p["batch"] * (p["new"] + p["restart_new"]) / seconds, 2) if seconds else None,
    )
    return dict(
        {key: p[key] for key in RECORD_PARAMETERS},
        num_beams=beams(p),
        **{key: values.get(key) for key in RECORD_FIELDS},
    )


def _steps(p, prompt, new: int):
    """On meta, where only shapes are computed, the forward only at the steps that can hold the peak
    (kvlab.planner.dry_run): the same count as decoding every step, in a few forwards. Elsewhere every step."""
    if prompt.device.type != "meta":
        return None
    return skipping_forward(p["cache"], new, p)


def _decode(model, prompt, p, options, meter, graphs=None) -> float:
    """One run of the point (a restart included); returns the seconds spent decoding. On meta, as on a CPU
    (kvlab.planner.meta.MetaAsCpu)."""
    if p["runtime"] != "eager":
        from ..graphs import generate_graph

        return generate_graph(model, prompt, p["new"], p["runtime"], graphs, meter=meter).seconds
    with MetaAsCpu() if prompt.device.type == "meta" else contextlib.nullcontext():
        first = generate(model, prompt, p["new"], meter=meter, step_forward=_steps(p, prompt, p["new"]), **options)
        seconds = first.seconds
        if p["restart_new"]:
            # The caller still holds `first` (and so its cache) while the second call runs.
            past = first.cache
            if p["restart_from"] == "tuples":  # 4.42: to_legacy_cache, then from_legacy_cache (neither copies)
                first.cache = past.to_tuples()
                past = KVCache.from_tuples(first.cache, num_layers(model))
            step_forward = _steps(p, prompt, p["restart_new"])
            options = dict(options, cache=past)
            second = generate(model, first.tokens, p["restart_new"], meter=meter, step_forward=step_forward, **options)
            seconds += second.seconds
            del second, past, options
        del first
    return seconds
