"""kvlab: measure where the memory of LLM generation goes, one KV-cache design at a time.

    from kvlab import build_model, make_cache, generate, MemoryMeter, predict

    print(predict("llama2-7b", batch=8, prompt=300, new=500, dtype="bfloat16", memory="80GiB"))

Read in this order: caches (transformers' designs; kvlab's own: designs), loops (three releases' generate()),
meter (live bytes, and profiler: its independent check), theory (the peak, term by term), models and presets (twins
of real models).
The README's "Using kvlab" runs all five names.
"""

__version__ = "0.1.0"

# Imported on first use, not here: the real transformers 4.40.1 runs `python -m kvlab.lab.reference` in a
# subprocess, and the lesson's modules need transformers 5.x.
_PUBLIC = {
    "build_model": "planner.sources",
    "make_cache": "caches",
    "generate": "loops",
    "MemoryMeter": "meter",
    "predict": "planner.plan",
}
__all__ = list(_PUBLIC)
# The public make_cache and generate build every design: kvlab.designs registers kvlab's own (list, prealloc).
_WITH_OWN_DESIGNS = ("make_cache", "generate")


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
    import importlib

    if name in _WITH_OWN_DESIGNS:
        importlib.import_module("kvlab.designs")
    return getattr(importlib.import_module(f"kvlab.{_PUBLIC[name]}"), name)
