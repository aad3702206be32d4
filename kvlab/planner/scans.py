"""The fast dry run's short scans: a reference implementation that loops over a prompt's chunks (transformers' torch
fallback of a linear-attention kernel) run for two chunks, which on meta count what all of them count.

`torch_chunk_gated_delta_rule` (the gated delta rule's chunked prefill: Qwen3-Next's linear-attention layers, and the
same function in Qwen3.5, OLMo-Hybrid and the others that copy it) first computes what every chunk needs over the
whole padded prompt, then scans its chunks (500 at a 32,000-token prompt), iteration i:

    v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
    inter_chunk_attn = query[:, :, i] @ state
    core_attn_out[:, :, i] = inter_chunk_attn + intra_chunk_attn[:, :, i] @ v_new
    state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new

Every tensor an iteration makes has one chunk's shape, the same at every i (the prompt is padded to whole chunks),
and it writes only into a view of the output made before the loop. As iteration i >= 1 starts, what is alive is what
the first phase left, the state iteration i - 1 made, and that iteration's `v_new` and `inter_chunk_attn` (each
freed when its name is bound anew): tensors of the same shapes for every i >= 1. On meta, where an op allocates what
its inputs' shapes say, iterations 1, 2, ... therefore allocate, hold and free the same bytes: iteration 1's peak is
every later one's, and after the loop the same tensors live whatever the number of iterations (iteration 0 starts
with less: no `v_new` yet, the state a tensor of zeros or the cache's). Two iterations count what all of them count.
tests/test_fast.py holds the short scan against the whole one under the meter, for every module that has it.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import types

# The scans shortened, by their name in a modeling module; the module's docstring argues each.
SCANS = ("torch_chunk_gated_delta_rule",)
ITERATIONS = 2  # the first, whose live set differs, and one of the rest, which are alike


@contextlib.contextmanager
def short_scans(model):
    """Within the block, each scan of `SCANS` that `model`'s modeling modules call runs `ITERATIONS` of its loop
    (`shortened`); the modules' own functions are back after it."""
    swapped = []
    try:
        for module in {sys.modules[type(part).__module__] for part in model.modules()}:
            for name in SCANS:
                reference = _reference(getattr(module, name, None))
                if reference is not None:
                    swapped.append((module, name, getattr(module, name)))
                    setattr(module, name, shortened(reference, ITERATIONS))
        yield
    finally:
        for module, name, function in reversed(swapped):
            setattr(module, name, function)


def _reference(function):
    """The torch function a modeling module's `function` runs, or None: transformers wraps it to call an optimized
    package's kernel where one is installed (its `implementation`), and then it is no scan of ours."""
    if not callable(function):
        return None
    reference = getattr(function, "__wrapped__", function)
    if reference is function:
        return reference
    implementation = inspect.getclosurevars(function).nonlocals.get("implementation")
    return reference if implementation is reference else None


def shortened(function: types.FunctionType, iterations: int) -> types.FunctionType:
    """`function`, its code unchanged, but each `range(n)` of one argument it calls stops after `iterations`: the
    scan's loop over its chunks, the only one-argument range in a function of `SCANS`."""

    def short_range(*bounds):
        return range(min(bounds[0], iterations)) if len(bounds) == 1 else range(*bounds)

    namespace = dict(function.__globals__, range=short_range)
    short = types.FunctionType(
        function.__code__, namespace, function.__name__, function.__defaults__, function.__closure__
    )
    short.__kwdefaults__ = function.__kwdefaults__
    return short
