"""Will this point fit? The predicted peak (weights + the overhead: `kvlab.theory`'s walk for the families it
models, a dry run of kvlab's loop on the meta device for every other decoder), before anything is allocated.
The weights are counted by building the model on the meta device (shapes, no data), so tied embeddings and
buffers count exactly as in `meter.weight_bytes`. `measure` and `sweep` call `check_fits` first.
"""

from __future__ import annotations

import bisect
import functools
import json
import re

import torch

from ..cuda_memory import CUDA_CONTEXT, cublas_workspace
from ..models import parse_dtype
from ..schema import DESIGNS, POINT_KEYS, beams
from ..theory import MODELED
from . import plain, theory
from .meta import cpu_kernels, meta_as, uncounted_workspace
from .params import normalize, target_arch, target_threads
from .sources import is_hub_id

GIB = 2**30
UNITS = {
    "": 1,
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "kb": 10**3,
    "kib": 2**10,
    "mb": 10**6,
    "mib": 2**20,
    "gb": 10**9,
    "gib": 2**30,
    "tb": 10**12,
    "tib": 2**40,
}


class Prediction(dict):
    """`predict`'s answer: a plain dict (`json.dumps` writes it whole; each design's row under "designs", with
    "peak_bytes" and, given a memory, "fits") that prints as the table `kvlab predict` shows."""

    def __str__(self) -> str:
        return format_prediction(self)


class TooBig(ValueError):
    """A point whose predicted peak exceeds the free memory of its device."""


MAX_MEMORY = 2**60  # 1 EiB: more than any machine has (past it, "1e400" is infinity, not a size)


def parse_bytes(text) -> int:
    """`"24GiB"`, `"22.5 GB"`, `"512MiB"`, `"1000000"` (bytes) → bytes, from 1 byte to MAX_MEMORY."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    try:
        size = float(match.group(1)) * UNITS[match.group(2)] if match and match.group(2) in UNITS else None
    except ValueError:  # "1.2.3": digits and dots, not a number
        size = None
    if size is not None and size > MAX_MEMORY:
        raise ValueError(f"memory size {text!r} is more than 1 EiB (2**60 bytes), more than any machine has")
    if not size or int(size) < 1:
        why = "not understood" if size is None else "is not positive"
        raise ValueError(f"memory size {text!r} {why}; give a number and one of: GiB, GB, MiB, MB, bytes")
    return int(size)


def format_bytes(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB else f"{n / 2**20:.1f} MiB"


@functools.lru_cache(maxsize=32)
def _weights(config_class: type, config_json: str, dtype: str) -> int:
    from ..meter import weight_bytes
    from ..models import instantiate

    values = json.loads(config_json)  # an infinite float comes back as {"__float__": "Infinity"} (Mamba-2)
    config = config_class.from_dict(getattr(config_class, "_decode_special_floats", lambda v: v)(values))
    with torch.device("meta"):  # shapes only: a 7B model costs nothing to build here
        return weight_bytes(instantiate(config, parse_dtype(dtype)))


def model_weight_bytes(config, dtype: str) -> int:
    """Bytes of the weights a model of this config and dtype holds: in closed form for kvlab.theory's families
    (kvlab.planner.plain), else built on meta (cached)."""
    if config.model_type in plain.FAMILIES:
        return plain.weight_bytes(config, dtype)
    return _weights(type(config), config.to_json_string(use_diff=False), dtype)


def free_bytes(device: str) -> int | None:
    """Memory a point can still allocate on `device`; None on meta, which allocates nothing."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0]
    if kind == "cpu":
        import psutil

        return psutil.virtual_memory().available
    return None


def point_of(p: dict, **changes) -> dict:
    return {**{key: p[key] for key in POINT_KEYS}, **changes}


def largest_new(fits, limit: int) -> int:
    """The largest n in 1..limit with fits(n), for a fits that holds up to some n and not beyond (the peak grows
    with the tokens generated); 0 if not even one. One walk of the theory when the whole context fits (a sliding
    cache's plateau, a large memory), else a bisection: a few walks."""
    if fits(limit):
        return limit
    return bisect.bisect_left(range(1, limit), True, key=lambda n: not fits(n))


def largest_batch(predict_overhead, design: dict, room: int) -> int:
    """The largest batch whose predicted overhead (`predict_overhead(design)`) fits in `room` bytes. The batch-1
    overhead dividing the room is the first guess (exact where every byte is per sequence; terms that are not, the
    flash scratch, a mask 5.x builds once for every sequence, move it), then a doubling and a bisection: the
    overhead grows with the batch, so a few walks find it."""
    overhead = lambda batch: predict_overhead(dict(design, batch=batch))  # noqa: E731
    if overhead(1) > room:
        return 0
    low = max(1, room // overhead(1))
    high = low + 1
    if overhead(low) > room:
        low, high = 1, low
    else:
        while overhead(high) <= room:
            low, high = high, 2 * high
    return low + bisect.bisect_left(range(low + 1, high), True, key=lambda batch: overhead(batch) > room)


def predict(
    preset: str = "toy",
    *,
    memory=None,
    max_batch: bool = False,
    max_new: bool = False,
    dry_run: bool = False,
    exact: bool = False,
    cache: str | None = None,
    loop: str | None = None,
    threads: int | None = None,
    arch: str | None = None,
    **point,
) -> Prediction:
    """The predicted peak of `generate()` for `preset` (a preset, a config.json or a hub id) before anything is
    allocated, under every (cache, loop) design of kvlab.schema.DESIGNS, those of one `cache` or `loop`, or exactly
    the pair given. `point`: batch, prompt, new, dtype, strategy, num_beams, restart_new, overrides (as `measure`).

    With `memory` ("80GiB", "22.5 GB" or bytes) each design says whether it fits, and answers the inverse questions
    for that memory: the largest batch (`max_batch`: nearly every byte theory counts is per sequence, so the
    overhead is about the batch times that of batch 1, then checked at that batch and the next; CPU flash
    attention's scratch is per thread) and the longest generation (`max_new`, up to the model's context).

    The device planned for is an input, whatever this machine has (`device`: cuda, the default when none is named,
    cpu or meta): a CPU of `threads` torch threads (default: this machine's), a CUDA GPU of `arch` ("hopper", the
    default, or "other": kvlab.cuda_memory), whose context (`CUDA_CONTEXT`) a "fits" answer counts beside the peak.

    The model types kvlab.theory models are walked term by term; every other decoder kvlab runs, or any with
    `dry_run`, gets a dry run on the meta device, as the device planned for allocates (kvlab.planner.meta): of a
    few layers, extrapolated to all (kvlab.planner.fast: within 1 % of the whole model's, well under a second per
    design), or with `exact` of the whole model (`DryRun`: within 8 bytes of a CPU run, seconds per design, minutes
    for a large model's every design).
    """
    if (max_batch or max_new) and memory is None:
        raise ValueError("--max-batch and --max-new answer for a memory size: give --memory too")
    memory = None if memory is None else parse_bytes(memory)
    named = point.get("device") not in (None, "", "auto")
    p = normalize(target=True, preset=preset, cache=cache, loop=loop, **point)
    target = Target(p["device"], named, target_threads(threads, p["device"]), target_arch(arch, p["device"]))
    target.threads_given = threads is not None  # else this machine's (target_threads), which the output says
    return _predict(p, designs_for(cache, loop, p), memory, max_batch, max_new, dry_run or exact, target, exact)


class Target:
    """The device a prediction plans for: its name, whether it was named or is the default, a CPU's threads, a GPU's
    architecture, and the bytes a "fits" answer counts beside the peak on it (a CUDA GPU's context)."""

    def __init__(self, device: str, named: bool, threads: int | None, arch: str | None):
        self.device, self.named, self.threads, self.arch = device, named, threads, arch
        self.threads_given = False
        self.cuda = torch.device(device).type == "cuda"
        self.context = CUDA_CONTEXT if self.cuda else 0

    def describe(self) -> dict:
        """The target as the prediction states it."""
        return dict(
            device=self.device,
            device_is_default=not self.named,
            threads=self.threads,
            threads_are_default=self.threads is not None and not self.threads_given,
            arch=self.arch,
            cuda_context_bytes=self.context if self.cuda else None,
        )


def designs_for(cache: str | None, loop: str | None, p: dict) -> list[tuple[str, str]]:
    """Every design, those of one cache or loop, or exactly the (cache, loop) asked for (normalized in `p`)."""
    designs = [design for design in DESIGNS if cache in (None, design[0]) and loop in (None, design[1])]
    return designs if designs and not (cache and loop) else [(p["cache"], p["loop"])]


def _predict(
    p: dict,
    designs,
    memory: int | None,
    max_batch: bool,
    max_new: bool,
    dry_run: bool,
    target: Target,
    exact: bool = False,
) -> Prediction:
    config = plain.config_for(p["preset"], p["overrides"])
    if config.model_type in MODELED and not dry_run:
        walk = Theory(config, target.threads, target.arch)
    else:
        walk = _dry_run(p, target, exact)
    weights = model_weight_bytes(config, p["dtype"])
    room = None if memory is None else memory - target.context  # what the caching allocator can hand out
    rows, refused = [], {}
    for cache, loop in designs:
        try:
            _check_layers(config, cache)
        except ValueError as why:  # a design this model cannot hold: named under the table, unless it was asked for
            if len(designs) == 1:
                raise
            refused[f"{cache}/{loop}"] = str(why)
            continue
        design = point_of(p, cache=cache, loop=loop)
        row = dict(cache=cache, loop=loop, **walk.breakdown(design))
        row["peak_bytes"] = weights + row["predicted_overhead_bytes"]
        if memory is not None:
            row["fits"] = row["peak_bytes"] <= room
        if max_batch:
            row["max_batch"] = largest_batch(walk.overhead, design, room - weights)
        if max_new:
            limit = config.max_position_embeddings - p["prompt"] - p["restart_new"]  # the positions left
            fits = lambda n, design=design: weights + walk.overhead(dict(design, new=n)) <= room
            row["max_new"] = largest_new(fits, limit) if limit > 0 else 0  # a prompt past the context: none
            row["max_new_is_context"] = row["max_new"] == max(limit, 0)
        rows.append(row)
    sizes = {
        key: p[key] for key in ("preset", "overrides", "dtype", "strategy", "batch", "prompt", "new", "restart_new")
    }
    model = {
        key: getattr(config, key, None)
        for key in (
            "model_type",
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
        )
    }
    # num_beams as in a measured record: 1 unless the point searches beams.
    return Prediction(
        **sizes,
        num_beams=beams(p),
        model=model,
        weights_bytes=weights,
        memory_bytes=memory,
        **target.describe(),
        # This machine's CPU kernels: what a CPU target allocates when it is this machine.
        cpu_kernels=cpu_kernels() if target.threads else None,
        uncounted=uncounted_workspace(parse_dtype(p["dtype"])) if target.threads else None,
        designs=rows,
        refused=refused,
    )


def _dry_run(p: dict, target: Target, exact: bool):
    """A dry run as the target allocates: of a few layers extrapolated, or (`exact`) of the whole model."""
    from .dry_run import DryRun, PlusWorkspace  # they import transformers' modelling code: only for a dry run
    from .fast import fast_or_exact

    as_device = meta_as(target.device, target.threads, target.arch)  # makes a fresh mode for each run
    walk = DryRun(p, as_device) if exact else fast_or_exact(p, as_device)
    return PlusWorkspace(walk, cublas_workspace(target.arch)) if target.cuda else walk


def _check_layers(config, cache: str) -> None:
    """kvlab.caches.check_layers, but for a PlainConfig: every layer of its families is attention, which every
    design holds."""
    if not isinstance(config, plain.PlainConfig):
        from ..caches import check_layers

        check_layers(config, cache)


class Theory:
    """kvlab.theory's walk, term by term, for the model types it models, on a CPU of `threads` or a GPU of `arch`."""

    def __init__(self, config, threads: int | None = None, arch: str | None = None):
        self.config, self.device = config, dict(threads=threads, **({"arch": arch} if arch else {}))

    def overhead(self, design: dict) -> int:
        return theory.predict_overhead(self.config, **self.device, **design)

    def breakdown(self, design: dict) -> dict:
        return theory.breakdown(self.config, **self.device, **design)


def format_prediction(result: dict) -> str:
    """The table `python -m kvlab predict` prints: GiB with 3 decimals."""
    m, r, memory, gib = result["model"], result, result["memory_bytes"], lambda n: f"{n / GIB:.3f}"
    name = f"{r['preset']} ({r['overrides']})" if r["overrides"] else r["preset"]
    beams = f", {r['num_beams']} beams" if r["strategy"] == "beam" else ""
    restart = f" + {r['restart_new']} after a restart" if r["restart_new"] else ""
    context = " with the CUDA context" if r.get("cuda_context_bytes") else ""
    fits = [f"fits in {gib(memory)} GiB{context}"] if memory is not None else []
    first = r["designs"][0] if r["designs"] else {}
    inverse = [name for key, name in (("max_batch", "max batch"), ("max_new", "max new")) if key in first]
    table = [
        [
            "design",
            "peak GiB",
            "overhead GiB",
            "overhead/KV",
            "KV GiB",
            *fits,
            *inverse,
            "cache at the end: tokens x layers",
            "peak at",
        ]
    ]
    for d in r["designs"]:
        answers = [str(d["max_batch"])] if "max_batch" in d else []
        if "max_new" in d:
            answers.append(f"{d['max_new']}{' (context)' if d['max_new_is_context'] else ''}")
        table.append(
            [
                f"{d['cache']}/{d['loop']}",
                gib(d["peak_bytes"]),
                gib(d["predicted_overhead_bytes"]),
                f"{d['overhead_over_kv']:.3f}" if d["overhead_over_kv"] is not None else "-",
                gib(d["kv_final_bytes"]),
                *(["yes" if d["fits"] else "NO"] if fits else []),
                *answers,
                d["cache_tokens_per_layer"],
                d["peak_at"],
            ]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join(
        [
            f"{name}: {m['model_type']}, {m['num_hidden_layers']} layers, hidden {m['hidden_size']}, "
            f"{m['num_attention_heads']} heads / {m['num_key_value_heads']} KV heads, vocab {m['vocab_size']}, "
            f"{r['dtype']}",
            f"batch {r['batch']}, prompt {r['prompt']}, {r['new']} new{restart}, {r['strategy']}{beams}; "
            f"weights {gib(r['weights_bytes'])} GiB",
            planned_for(r),
            "",
            # the four numbers right-aligned, the rest left-aligned
            *(
                "  ".join(
                    c.rjust(w) if 1 <= i <= 4 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
                ).rstrip()
                for row in table
            ),
            "",
            "peak = weights + overhead (kvlab.theory, or a dry run on meta; live bytes above the weights); "
            "KV = prompt + new tokens in every layer that caches them; cache at the end = what each layer's "
            "storage holds (5.x sliding layers stop at the window, prealloc's at a buffer of window - 1 + "
            "block_tokens slots)",
            *([f"kernels' scratch as this CPU allocates it: {r['cpu_kernels']}"] if r.get("cpu_kernels") else []),
            *cuda_notes(r),
            *(
                [
                    f"max batch / max new: the largest batch (at {r['new']} new) and the longest generation (at batch "
                    f"{r['batch']}) each design fits in {gib(memory)} GiB; (context): the model's positions end first"
                ]
                if inverse
                else []
            ),
            *([f"not counted: {r['uncounted']}"] if r.get("uncounted") else []),
            *([f"routing bounded: {_routing_bound()}"] if any("bound" in d for d in r["designs"]) else []),
            *(f"{design}: {why}" for design, why in r.get("refused", {}).items()),
        ]
    )


def _routing_bound() -> str:
    from .dry_run import ROUTING_BOUND

    return ROUTING_BOUND


def planned_for(r: dict) -> str:
    """The line that names the device the prediction plans for, and where it came from."""
    device = r.get("device", "cpu")
    default = " (the default: no device named)" if r.get("device_is_default") else ""
    if r.get("arch"):
        gpu = "a Hopper GPU (compute capability 9.0)" if r["arch"] == "hopper" else "a GPU other than Hopper"
        return f"planned for: {device}{default}, {gpu} (--gpu-arch); this machine's devices are not read"
    if r.get("threads"):
        whose = " (this machine's; --threads N for another CPU)" if r.get("threads_are_default") else ""
        threads = f"{r['threads']} torch thread{'s' if r['threads'] != 1 else ''}"
        return f"planned for: {device}{default}, a CPU of {threads}{whose}"
    return f"planned for: {device}{default}"


def cuda_notes(r: dict) -> list[str]:
    """A CUDA plan's notes: what "fits" counts beside the peak, and the allocator's reserved bytes."""
    if not r.get("cuda_context_bytes"):
        return []
    gib = lambda n: f"{n / GIB:.3f}"  # noqa: E731
    reserved = [
        f"{d['cache']}/{d['loop']} {gib(d['reserved_estimate_bytes'])}"
        for d in r["designs"]
        if "reserved_estimate_bytes" in d
    ]  # kvlab.theory's walk gives it, a dry run does not
    return [
        f"CUDA context: {gib(r['cuda_context_bytes'])} GiB outside the caching allocator (measured on one H100; "
        "approximate: a few hundred MiB, by driver, CUDA version and GPU), counted in 'fits' beside the peak",
        *(
            [f"reserved by the caching allocator at the peak, GiB (an estimate, a floor): {', '.join(reserved)}"]
            if reserved
            else []
        ),
    ]


def check_fits(p: dict, model=None) -> None:
    """Raise TooBig when a normalized point's predicted peak exceeds the free memory of its device. With `model`
    given its weights are resident: only the overhead has to fit. A point that cannot be predicted passes, and so
    does a model type kvlab.theory does not walk (its dry run would cost a few forwards before every point)."""
    free = free_bytes(p["device"])
    if free is None:
        return
    try:
        config = model.config if model is not None else plain.config_for(p["preset"], p["overrides"])
    except ValueError:
        if is_hub_id(p["preset"]):  # no config to predict from; loading the model will say why
            return
        raise
    if getattr(config, "model_type", None) not in MODELED:
        return
    weights = 0 if model is not None else model_weight_bytes(config, p["dtype"])
    overhead = theory.predict_overhead(config, **point_of(p))
    if weights + overhead > free:
        loaded = "weights already loaded" if model is not None else f"weights {format_bytes(weights)}"
        raise TooBig(
            f"predicted peak {format_bytes(weights + overhead)} ({loaded} + overhead "
            f"{format_bytes(overhead)}) exceeds the {format_bytes(free)} free on {p['device']}; "
            f"pass --force (force=True) to try anyway"
        )
