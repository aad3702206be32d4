"""A point's parameters checked in one place: defaults filled, every choice and size checked, before anything is
allocated. `measure`, `predict`, the CLI and every sweep call `normalize` first."""

from __future__ import annotations

import numbers

import torch

from ..configs import parse_overrides
from ..cuda_memory import ARCHES
from ..models import check_device, parse_dtype, resolve_device
from ..schema import CACHES, DEFAULTS, KINDS, LOOPS, REFERENCES, RESTART_FROM, STRATEGIES, check_choice, is_true
from .plain import PlainConfig, config_for
from .sources import check_decoder

# The least and the most of each size, and why the most: past these no question kvlab answers is real, and the
# walks over every decoding step (kvlab.theory, the meta dry run, the loop) would run for minutes or exhaust memory.
SIZE_LIMIT = 2**24  # 16,777,216
SIZE_WHY = "past any model's context (the longest, 10M tokens) and any batch a device holds"
STEP_LIMIT = 2**16  # decoding steps: a prediction walks each of them
SEED_LIMIT = 2**64 - 1  # torch.manual_seed's largest
STEP_WHY = "kvlab walks every decoding step (kvlab.theory, the meta dry run, the loop): more take minutes"
BOUNDS = dict(
    new=(STEP_LIMIT, STEP_WHY), restart_new=(STEP_LIMIT, STEP_WHY), seed=(SEED_LIMIT, "torch's seeds end there")
)
SIZES = dict(batch=1, prompt=1, new=1, num_beams=1, chunk_limit=1, block_tokens=1, restart_new=0, seed=0)


def whole(key: str, value, least: int, most: int, why: str) -> int:
    """`value` if it is an integer (not a bool, a float such as 2.7 or inf, a string such as "8", a list) in
    least..most; else one line naming the value and the bound."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{key} must be {_kind(least)}, got {value!r} ({type(value).__name__})")
    if value < least:
        raise ValueError(f"{key} must be {_kind(least)}, got {value}")
    if value > most:
        raise ValueError(f"{key} must be at most {most:,}: {why}; got {value:,}")
    return int(value)


def _kind(least: int) -> str:
    return "a positive integer" if least else "an integer, zero or positive"


def check_sizes(p: dict) -> None:
    """Every size of a point an integer within its bounds (in place), the decoding steps within STEP_LIMIT."""
    for key, least in SIZES.items():
        if key in p:
            p[key] = whole(key, p[key], least, *BOUNDS.get(key, (SIZE_LIMIT, SIZE_WHY)))
    if (steps := p.get("new", 1) + p.get("restart_new", 0)) > STEP_LIMIT:
        raise ValueError(f"new + restart_new must be at most {STEP_LIMIT:,}: {STEP_WHY}; got {steps:,}")


TARGETS = ("cuda", "cpu", "meta")  # the devices a prediction plans for
THREAD_LIMIT = 2**12  # torch threads of a CPU target: more cores than any one machine has


def target_device(device) -> str:
    """The device a prediction plans for, read from the name alone (no device is asked whether it exists): cuda
    (cuda:N alike), cpu or meta; none named ("auto", the default) plans for cuda."""
    if device in (None, "", "auto"):
        return "cuda"
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        kind = None
    if kind not in TARGETS:
        raise ValueError(f"unknown device {device!r} to plan for; choose one of: {', '.join(TARGETS)}")
    return str(device)


def target_threads(threads, device: str) -> int | None:
    """A CPU target's torch threads (its flash kernel's scratch is a block per thread): the number given, else this
    machine's; None for another device, which takes none."""
    if torch.device(device).type != "cpu":
        if threads is not None:
            raise ValueError(f"threads are a CPU's: the device planned for is {device}; give --device cpu with them")
        return None
    if threads is None:
        return torch.get_num_threads()
    return whole("threads", threads, 1, THREAD_LIMIT, "more than any one machine's cores")


def target_arch(arch, device: str) -> str | None:
    """A CUDA target's architecture (kvlab.cuda_memory.ARCHES: "hopper", compute capability 9.0, the default, or
    "other"); None for another device, which takes none."""
    if torch.device(device).type != "cuda":
        if arch is not None:
            raise ValueError(f"a GPU architecture is a CUDA target's: the device planned for is {device}")
        return None
    arch = "hopper" if arch is None else arch
    check_choice("GPU architecture", arch, ARCHES)
    return arch


def normalize(target: bool = False, **params) -> dict:
    """Fill defaults and check every choice and size, before anything is allocated. `target`: the device is the one
    a prediction plans for (`target_device`), not one to run on here."""
    if unknown := set(params) - set(DEFAULTS):
        raise ValueError(f"unknown parameter(s) {', '.join(sorted(unknown))}; valid: {', '.join(DEFAULTS)}")
    p = {**DEFAULTS, **{k: v for k, v in params.items() if v is not None}}
    check_sizes(p)  # integers first: the checks below compute with them
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
    if p["runtime"] != "eager":  # a graph runtime (kvlab.graphs) carries one cache design: the default if none given
        from ..graphs import RUNTIMES, check_runtime  # (it imports transformers: only for a graph runtime)

        check_choice("runtime", p["runtime"], RUNTIMES)
        if params.get("cache") is None:
            p["cache"] = RUNTIMES[p["runtime"]][0]
        check_runtime(p["runtime"], p["cache"], p["loop"], p["strategy"])
        if p["kind"] != "kvlab" or int(p["restart_new"]) or resolve_device(p["device"]).startswith("meta"):
            raise ValueError(
                f"runtime {p['runtime']!r} measures kvlab's own decode (kind kvlab), on cpu or cuda, without a restart"
            )
    if target:
        p["device"] = target_device(params.get("device"))
    else:
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
    config = config_for(p["preset"], p["overrides"])  # raises on a bad preset, key or size, or a hub id not to be had
    if not isinstance(config, PlainConfig):  # (a PlainConfig is a decoder whose every layer is attention)
        from ..caches import check_layers

        check_decoder(config, p["preset"])
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
