"""The experiment point's schema: its designs, kinds and defaults (a record's fields: kvlab.lab.store). Plain
Python, no torch: the store, the CLI, the plots and the predictor share it, and it loads in any process."""

from __future__ import annotations

from dataclasses import dataclass

# (cache, loop): the <= 4.41 baseline, each of the PR's two fixes alone (v4.42's loop on tuples, v4.40's
# loop on one cache object), the PR as released, then today's loop with every design.
DESIGNS = [
    ("tuple", "v4.40"),
    ("tuple", "v4.42"),
    ("dynamic", "v4.40"),
    ("dynamic", "v4.42"),
    ("dynamic", "v5"),
    ("list", "v5"),
    ("static", "v5"),
    ("prealloc", "v5"),
]

# The cache designs (kvlab.caches builds them).
CACHES = ("tuple", "dynamic", "list", "static", "prealloc")


# The loops of three releases' generate() (kvlab.loops runs them; kvlab.theory walks them).
@dataclass(frozen=True)
class Release:
    """What one release's `generate()` did differently (kvlab.loops' docstring says how)."""

    name: str
    keeps_previous_outputs: bool  # v4.40: `outputs` lived until the next forward returned
    major: int  # 4: the 4.x forward (fp32 logits of every position, repeat_kv); 5: 5.x (forward and beam buffers)


LOOPS = {"v4.40": Release("v4.40", True, 4), "v4.42": Release("v4.42", False, 4), "v5": Release("v5", False, 5)}
STRATEGIES = ("greedy", "sample", "beam")

# kind="reference": (cache, loop) → the transformers release whose own generate() that design reproduces,
# and the cache_implementation it is asked for (None: the release's default cache).
REFERENCES = {
    ("tuple", "v4.40"): ("4.40.1", None),
    ("dynamic", "v4.42"): ("4.42.4", None),
    ("dynamic", "v5"): ("installed", None),
    ("static", "v5"): ("installed", "static"),
}
KINDS = ("kvlab", "reference")
# What a restart passes back to the second call: the cache generate() returned, or (4.42's default, with
# return_legacy_cache=True) that cache's tensors as tuples, which the second call wraps in a new object.
RESTART_FROM = ("cache", "tuples")

DEFAULTS = dict(
    kind="kvlab",
    runtime="eager",
    preset="toy",
    overrides="",
    cache="dynamic",
    loop="v5",
    strategy="greedy",
    batch=8,
    prompt=64,
    new=512,
    restart_new=0,
    restart_from="cache",
    num_beams=4,
    device="auto",
    dtype="float32",
    seed=0,
    chunk_limit=50,
    block_tokens=32,
    track_storages="auto",
    timing=True,
    force=False,
)
# `kvlab explain`'s point: small, as it runs twice on the CPU (kvlab.explain.explain_point's defaults).
EXPLAIN_DEFAULTS = dict(preset="toy", batch=2, prompt=16, new=8, dtype="float32", cache="tuple", loop="v4.40", seed=0)
# A design point's keys: what kvlab.theory and the planner predict from, the point's parameters but the model
# (preset, overrides), whose code runs it (kind) and how the run is done (seed, meter, timing, force).
POINT_KEYS = tuple(
    key for key in DEFAULTS if key not in ("kind", "preset", "overrides", "seed", "track_storages", "timing", "force")
)


def check_choice(kind: str, value: str, choices) -> None:
    if value not in choices:
        raise ValueError(f"unknown {kind} {value!r}; choose one of: {', '.join(choices)}")


def is_true(value) -> bool:
    """A switch given as a bool, or as text from the command line or a sweep file."""
    return value in (True, "true", "True", "1", 1)


def beams(p: dict) -> int:
    """Sequences decoded per prompt: num_beams for beam search, one otherwise."""
    return p["num_beams"] if p["strategy"] == "beam" else 1


def over_kv(overhead: int, kv_final: int) -> float | None:
    """overhead / final KV; None for a model that caches nothing per token (recurrent layers only)."""
    return round(overhead / kv_final, 4) if kv_final else None
