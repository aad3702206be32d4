"""Will this point fit? The predicted peak (weights + `kvlab.theory`'s overhead), before anything is allocated.

    python -m kvlab predict --preset llama2-7b --dtype bfloat16 --batch 8 --prompt 300 --new 500 --memory 24GiB

The weights are counted from the config by building the model on the meta device (shapes, no data), so
tied embeddings and buffers count exactly as in `meter.weight_bytes`. `measure` and `sweep` call
`check_fits` to refuse a point whose predicted peak exceeds the free memory of its device.
"""

from __future__ import annotations

import functools
import json
import re

import torch

from .. import theory
from ..meter import weight_bytes
from ..models import DECODERS, instantiate, is_hub_id, load_config, parse_dtype
from .point import beams

GIB = 2**30
# Decoders whose layers kvlab.theory walks through (attention with grouped KV heads, gated MLP).
MODELED = ("llama", "mistral", "qwen2")
UNITS = {"": 1, "b": 1, "byte": 1, "bytes": 1, "kb": 10**3, "kib": 2**10, "mb": 10**6, "mib": 2**20,
         "gb": 10**9, "gib": 2**30, "tb": 10**12, "tib": 2**40}


class TooBig(ValueError):
    """A point whose predicted peak exceeds the free memory of its device."""


def parse_bytes(text) -> int:
    """`"24GiB"`, `"22.5 GB"`, `"512MiB"`, `"1000000"` (bytes) → bytes."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not match or match.group(2) not in UNITS:
        raise ValueError(f"memory size {text!r} not understood; give a number and one of: GiB, GB, MiB, MB, bytes")
    size = int(float(match.group(1)) * UNITS[match.group(2)])
    if size < 1:
        raise ValueError(f"memory size {text!r} is not positive; give a number and one of: GiB, GB, MiB, MB, bytes")
    return size


def format_bytes(n: int) -> str:
    """Readable size for messages: GiB above 1 GiB, else MiB."""
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB else f"{n / 2**20:.1f} MiB"


def check_modeled(config, name: str) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in MODELED:
        raise ValueError(f"{name}: model_type {model_type!r} is not modelled by kvlab.theory, which models "
                         f"{', '.join(MODELED)} decoders; choose one of: {', '.join(DECODERS)}, or such a config")


@functools.lru_cache(maxsize=32)
def _weights(config_class: type, config_json: str, dtype: str) -> int:
    config = config_class.from_dict(json.loads(config_json))
    with torch.device("meta"):  # shapes only: a 7B model costs nothing to build here
        model = instantiate(config, parse_dtype(dtype))
    return weight_bytes(model)


def model_weight_bytes(config, dtype: str) -> int:
    """Bytes of the weights a model of this config and dtype holds (built on meta, cached)."""
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
    return {**{key: p[key] for key in theory.POINT_KEYS}, **changes}


def predict(p: dict, designs, memory: int | None = None) -> dict:
    """The predicted peak of a normalized point under each (cache, loop) design; `fits` when `memory` is given."""
    config = load_config(p["preset"], p["overrides"])
    check_modeled(config, p["preset"])
    weights = model_weight_bytes(config, p["dtype"])
    rows = []
    for cache, loop in designs:
        row = dict(cache=cache, loop=loop, **theory.explain(config, **point_of(p, cache=cache, loop=loop)))
        row["peak_bytes"] = weights + row["predicted_overhead_bytes"]
        if memory is not None:
            row["fits"] = row["peak_bytes"] <= memory
        rows.append(row)
    sizes = {key: p[key] for key in ("preset", "overrides", "dtype", "strategy", "batch", "prompt", "new",
                                     "restart_new")}
    sizes["num_beams"] = beams(p)  # as in a measured record: 1 unless the point searches beams
    model = {key: getattr(config, key, None) for key in ("model_type", "num_hidden_layers", "hidden_size",
                                                         "num_attention_heads", "num_key_value_heads", "vocab_size")}
    return dict(**sizes, model=model, weights_bytes=weights, memory_bytes=memory, designs=rows)


def format_prediction(result: dict) -> str:
    """The table `python -m kvlab predict` prints: GiB with 3 decimals."""
    m, gib = result["model"], lambda n: f"{n / GIB:.3f}"
    beams = f", {result['num_beams']} beams" if result["strategy"] == "beam" else ""
    restart = f" + {result['restart_new']} after a restart" if result["restart_new"] else ""
    name = f"{result['preset']} ({result['overrides']})" if result["overrides"] else result["preset"]
    lines = [
        f"{name}: {m['model_type']}, "
        f"{m['num_hidden_layers']} layers, hidden {m['hidden_size']}, {m['num_attention_heads']} heads / "
        f"{m['num_key_value_heads']} KV heads, vocab {m['vocab_size']}, {result['dtype']}",
        f"batch {result['batch']}, prompt {result['prompt']}, {result['new']} new{restart}, "
        f"{result['strategy']}{beams}; weights {gib(result['weights_bytes'])} GiB",
        "",
    ]
    memory = result["memory_bytes"]
    header = ["design", "peak GiB", "overhead GiB", "overhead/KV", "KV GiB"]
    header += [f"fits in {gib(memory)} GiB"] if memory is not None else []
    table = [header + ["peak at"]]
    for row in result["designs"]:
        cells = [f"{row['cache']}/{row['loop']}", gib(row["peak_bytes"]), gib(row["predicted_overhead_bytes"]),
                 f"{row['overhead_over_kv']:.3f}", gib(row["kv_final_bytes"])]
        cells += (["yes" if row["fits"] else "NO"] if memory is not None else []) + [row["peak_at"]]
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    numbers = range(1, 5)  # right-aligned; the rest left-aligned
    for r in table:
        cells = [c.rjust(w) if i in numbers else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells).rstrip())
    lines.append("")
    lines.append("peak = weights + overhead (kvlab.theory, live bytes above the weights); KV = final cache size")
    return "\n".join(lines)


def check_fits(p: dict, model=None) -> None:
    """Raise TooBig when a normalized point's predicted peak exceeds the free memory of its device.

    With `model` given its weights are already resident, so only the overhead has to fit. A point that
    cannot be predicted (a hub id whose config cannot be loaded, a model type theory does not model) passes.
    """
    free = free_bytes(p["device"])
    if free is None:
        return
    if model is not None:
        config = model.config
    else:
        try:
            config = load_config(p["preset"], p["overrides"])
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
        raise TooBig(f"predicted peak {format_bytes(weights + overhead)} ({loaded} + overhead "
                     f"{format_bytes(overhead)}) exceeds the {format_bytes(free)} free on {p['device']}; "
                     f"pass --force (force=True) to try anyway")
