"""A point's parameters checked in one place: defaults filled, every choice and size checked, before anything is
allocated. `measure`, `predict`, the CLI and every sweep call `normalize` first."""

from __future__ import annotations

import torch

from ..caches import CACHES, check_layers
from ..configs import load_config, parse_overrides
from ..graphs import RUNTIMES, check_runtime
from ..loops import LOOPS, STRATEGIES, check_choice
from ..models import check_device, parse_dtype, resolve_device
from ..schema import DEFAULTS, KINDS, REFERENCES, RESTART_FROM, is_true


def normalize(**params) -> dict:
    """Fill defaults and check every choice and size, before anything is allocated."""
    if unknown := set(params) - set(DEFAULTS):
        raise ValueError(f"unknown parameter(s) {', '.join(sorted(unknown))}; valid: {', '.join(DEFAULTS)}")
    p = {**DEFAULTS, **{k: v for k, v in params.items() if v is not None}}
    for key, choices in (
        ("kind", KINDS),
        ("cache", CACHES),
        ("loop", LOOPS),
        ("strategy", STRATEGIES),
        ("restart_from", RESTART_FROM),
    ):
        check_choice(key, p[key], choices)
    if p["restart_from"] == "tuples" and p["cache"] != "dynamic":
        raise ValueError(
            "restart_from=tuples passes back a dynamic cache's tensors as tuples (4.42's default); "
            "choose cache dynamic, or restart_from=cache"
        )
    if p["kind"] == "reference":
        if (p["cache"], p["loop"]) not in REFERENCES:
            pairs = ", ".join(f"{cache}/{loop} ({version})" for (cache, loop), (version, _) in REFERENCES.items())
            raise ValueError(
                f"no transformers release runs {p['cache']}/{p['loop']} in its own generate(); a "
                f"reference point is one of: {pairs}"
            )
        if p["strategy"] not in ("greedy", "beam"):
            raise ValueError("a reference point decodes greedy or beam")
        # A 4.x release's generate() returns tuples, which its caller passes back: the tuple design, or the
        # dynamic one with restart_from=tuples.
        if int(p["restart_new"]) and (
            p["strategy"] != "greedy"
            or p["loop"] == "v5"
            or (p["cache"] == "dynamic") != (p["restart_from"] == "tuples")
        ):
            raise ValueError(
                "a reference restart is greedy and passes back what 4.40.1 or 4.42.4 returned: "
                "tuple/v4.40, or dynamic/v4.42 with restart_from=tuples"
            )
        if str(p["device"]).startswith("meta"):
            raise ValueError(
                "a reference point runs a release's own generate(), which the meta device cannot; "
                "choose one of: cpu, cuda, auto"
            )
    check_choice("runtime", p["runtime"], RUNTIMES)
    if p["runtime"] != "eager":  # a graph runtime (kvlab.graphs) carries one cache design: the default if none given
        if params.get("cache") is None:
            p["cache"] = RUNTIMES[p["runtime"]][0]
        check_runtime(p["runtime"], p["cache"], p["loop"], p["strategy"])
        if p["kind"] != "kvlab" or int(p["restart_new"]) or resolve_device(p["device"]).startswith("meta"):
            raise ValueError(
                f"runtime {p['runtime']!r} measures kvlab's own decode (kind kvlab), on cpu or cuda, without a restart"
            )
    for key, least in dict(batch=1, prompt=1, new=1, num_beams=1, chunk_limit=1, block_tokens=1, restart_new=0).items():
        p[key] = int(p[key])
        if p[key] < least:
            raise ValueError(f"{key} must be {'a positive integer' if least else 'zero or positive'}, got {p[key]}")
    p["device"] = resolve_device(p["device"])
    check_device(p["device"])
    if p["device"] == "meta" and p["cache"] == "static" and (p["strategy"] == "beam" or p["restart_new"]):
        raise ValueError(
            "on meta the static cache decodes greedy or sampled in one call: its beam reorder and a restart read "
            "its length's value, which meta tensors do not have; choose one of: cpu, cuda"
        )
    parse_dtype(p["dtype"])
    if isinstance(p["overrides"], (list, tuple, dict)):
        p["overrides"] = ",".join(f"{k}={v}" for k, v in parse_overrides(p["overrides"]).items())
    config = load_config(p["preset"], p["overrides"])  # raises on a bad preset, key or size, or a hub id not to be had
    if config.is_encoder_decoder:
        raise ValueError(
            f"{p['preset']} is an encoder-decoder model: measure, predict, compare and sweep run decoders; "
            "notebook 06 serves them (kvlab.encdec)"
        )
    if p["kind"] == "kvlab":
        check_layers(config, p["cache"])
    if p["track_storages"] == "auto":
        p["track_storages"] = torch.device(p["device"]).type != "cuda"
    p["track_storages"] = is_true(p["track_storages"])
    # Timing needs real kernels: the meta device has none.
    p["timing"] = is_true(p["timing"]) and torch.device(p["device"]).type != "meta"
    # Skip the check that refuses a point predicted not to fit in the free memory of its device.
    p["force"] = is_true(p["force"])
    return p
