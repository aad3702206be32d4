"""Who holds the bytes: at the peak of a run, each live tensor storage and the Python names that keep it.

1. Run the callable under kvlab's live-storage counter, noting the live bytes after each aten op; the peak is the
   op after which they were highest (within one model forward, if asked).
2. Run it again and stop inside `__torch_dispatch__` once that op has returned. The Python tensors on live
   storages come from `gc.get_objects()`; their names from the frames between the callable and the op, walking
   from each local through dicts, lists, tuples and attributes: `function: local['key'][3].attribute`. Each
   direct holder is named once, by its outermost name; a view keeps its whole storage alive.
Limits: only storages the counter sees (CPU, meta). One no Python object reaches is "unreferenced from Python";
one reached only from outside these frames is named by the type of what refers to it. The run must repeat its
ops (the rerun checks the bytes); the cyclic garbage collector is off during both runs.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import subprocess
import sys
import types
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch

from .meter import LiveStorageCounter
from .models import random_prompt
from .schema import CACHES, EXPLAIN_DEFAULTS

UNREFERENCED = "unreferenced from Python"
TORCH_DIR = os.path.dirname(torch.__file__)
MAX_DEPTH = 8  # item and attribute steps from a local; transformers' holders are within 5
ATOMS = (
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    type(None),
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    torch.dtype,
    torch.device,
    torch.nn.Parameter,
)


@dataclass
class Held:
    """One live storage: its bytes, the tensor first named on it, and every direct holder's name."""

    nbytes: int
    tensor: str  # e.g. "float32[1, 2, 15, 16]"; "-" when no Python tensor is left on the storage
    tensor_bytes: int  # what that tensor shows: less than nbytes for a view of a larger storage
    holders: list[str]  # outermost first; [UNREFERENCED] when no Python object holds it


@dataclass
class Explanation:
    peak_bytes: int  # live bytes counted since the run began, right after `op`
    op: str
    op_index: int  # the op's number in the run
    where: str  # the Python line (outside torch) that ran it
    held: list[Held] = field(default_factory=list)  # largest first
    forward: int | None = None  # the model forward the op ran in (0: the prefill; -1: before it), given the model

    def format(self, min_share: float = 0.0) -> str:
        """A table: storages grouped by their first holder's name with indices as [i], largest first. Groups under
        `min_share` of the peak are left out and counted in one last line (default: every group is shown)."""
        groups = defaultdict(lambda: [0, 0, 0])  # name -> storages, bytes, bytes their tensors show
        for item in self.held:
            row = groups[re.sub(r"\[\d+\]", "[i]", item.holders[0])]
            row[0], row[1], row[2] = row[0] + 1, row[1] + item.nbytes, row[2] + item.tensor_bytes
        mib = lambda nbytes: f"{nbytes / 2**20:.3f} MiB"
        lines = [
            f"peak {mib(self.peak_bytes)} after op #{self.op_index} {self.op} in {self.where}",
            f"{'bytes':>12} {'share':>6} {'count':>5}  held by",
        ]
        left_out = [0, 0]  # groups, bytes
        for name, (count, nbytes, shown) in sorted(groups.items(), key=lambda g: -g[1][1]):
            if nbytes < min_share * self.peak_bytes:
                left_out[0], left_out[1] = left_out[0] + 1, left_out[1] + nbytes
                continue
            view = f"  (views showing {mib(shown)})" if shown < nbytes else ""
            lines.append(f"{mib(nbytes):>12} {nbytes / max(self.peak_bytes, 1):>6.1%} {count:>5}  {name}{view}")
        if left_out[0]:
            lines.append(
                f"and {left_out[0]} more holders, each under {min_share:.0%} of the peak: {left_out[1]:,} bytes"
            )
        return "\n".join(lines)


class _Stop(BaseException):  # not an Exception: a callable's `except Exception` must not swallow it
    """Ends the rerun once the chosen op has been looked at."""


class _OpCounter(LiveStorageCounter):
    """The live-storage counter, plus the live bytes after each op; at op `stop_at` it looks and stops."""

    def __init__(self, stop_at: int | None = None):
        super().__init__()
        self.live_after: list[int] = []
        self.stop_at, self.outer_frame, self.explanation = stop_at, None, None

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types_, args, kwargs)
        self.live_after.append(self.live_bytes + self.scratch)
        if len(self.live_after) - 1 == self.stop_at:
            self.explanation = _look(self, str(func), sys._getframe())
            raise _Stop
        return out


def _qualname(code) -> str:
    """A frame's function with its class (Python 3.11's co_qualname; the bare name on 3.10)."""
    return getattr(code, "co_qualname", code.co_name)


def explain(run, *, model: torch.nn.Module | None = None, step: int | None = None) -> Explanation:
    """Call `run()` twice; explain what is alive at its peak, or at the peak of `model`'s forward number
    `step` (0: the prefill; each step runs from one forward's start to the next's)."""
    if step is not None and model is None:
        raise ValueError("step needs the model, to find where each forward begins")
    counter = _OpCounter()
    starts = _call(run, counter, model)
    ops = range(len(counter.live_after))
    if step is not None:
        if not 0 <= step < len(starts):
            raise ValueError(f"step {step} was not run; choose one of 0..{len(starts) - 1}")
        ops = range(starts[step], starts[step + 1] if step + 1 < len(starts) else len(ops))
    if not ops:
        raise ValueError("the run dispatched no tensor op to explain")
    target = max(ops, key=counter.live_after.__getitem__)
    rerun = _OpCounter(stop_at=target)
    _call(run, rerun, model)  # the same hooks as the first run
    if rerun.explanation is None or rerun.explanation.peak_bytes != counter.live_after[target]:
        raise RuntimeError("the rerun did not repeat the first run's ops and bytes; is the callable deterministic?")
    if model is not None:
        rerun.explanation.forward = sum(start <= target for start in starts) - 1
    return rerun.explanation


def _call(run, counter: _OpCounter, model=None) -> list[int]:
    """Run under `counter` with the cyclic collector off; return the op number at each start of `model`'s forward."""
    counter.outer_frame = sys._getframe()  # the names start below this frame
    starts = []
    record_start = lambda *_: starts.append(len(counter.live_after))
    hook = model.register_forward_pre_hook(record_start) if model else contextlib.nullcontext()
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with hook, contextlib.suppress(_Stop), counter:
            run()
    finally:
        if enabled:
            gc.enable()
    return starts


def _look(counter: _OpCounter, op: str, dispatch_frame) -> Explanation:
    live = {key: nbytes for key, (_, nbytes) in counter.live.items()}
    tensors = defaultdict(list)  # storage key -> the Python tensors on it
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.untyped_storage()._cdata in live:  # type(): no __class__ calls
            tensors[obj.untyped_storage()._cdata].append(obj)
    frames, frame = [], dispatch_frame.f_back
    while frame is not None and frame is not counter.outer_frame:
        frames.insert(0, frame)
        frame = frame.f_back
    # Torch's own frames (Module._call_impl, ...) pass arguments on: they name only what nothing else does.
    ours = [f for f in frames if not f.f_code.co_filename.startswith(TORCH_DIR)]
    op_locals = [(f"{op}: {name}", dispatch_frame.f_locals[name]) for name in ("out", "args", "kwargs")]
    names = _names(_locals(ours) + op_locals, live)
    fallback = _names(_locals([f for f in frames if f not in ours]), live)
    held = []
    for key, nbytes in live.items():
        found = _holders(tensors[key], names) or _holders(tensors[key], fallback)[:1]
        first = found[0][2] if found else next(iter(tensors[key]), None)
        holders = [name for _, name, _ in found] or [_referrer(first, tensors)]
        shape = "-" if first is None else f"{str(first.dtype).removeprefix('torch.')}{list(first.shape)}"
        held.append(Held(nbytes, shape, nbytes if first is None else first.nbytes, holders))
    if counter.scratch:
        held.append(Held(counter.scratch, "-", counter.scratch, [f"{op}: its scratch, freed before it returned"]))
    held.sort(key=lambda h: -h.nbytes)
    caller = (ours or frames)[-1]
    where = f"{_qualname(caller.f_code)} ({_importable(caller.f_code.co_filename)}:{caller.f_lineno})"
    return Explanation(counter.live_bytes + counter.scratch, op, len(counter.live_after) - 1, where, held)


def _importable(filename: str) -> str:
    """A source file as its package names it (transformers/cache_utils.py), not by this machine's folders."""
    roots = [os.path.abspath(p) + os.sep for p in sys.path if p and filename.startswith(os.path.abspath(p) + os.sep)]
    return filename[len(max(roots, key=len)) :] if roots else filename


def _locals(frames) -> list[tuple[str, object]]:
    return [(f"{_qualname(f.f_code)}: {name}", value) for f in frames for name, value in f.f_locals.items()]


def _names(roots, live) -> dict[int, dict]:
    """id(tensor) -> {direct holder: (root number, name)}: one name per direct holder (a local, or the container
    or object that has it as item or attribute), the first root's; every frame below generate() reaches its cache."""
    names = defaultdict(dict)
    for number, (root, value) in enumerate(roots):
        for path, tensor, parent in _tensors_under(value, live):
            names[id(tensor)].setdefault(parent or root, (number, root + path))
    return names


def _holders(tensors, names) -> list[tuple[int, str, torch.Tensor]]:
    """(root number, name, tensor) for every name of the tensors on one storage, outermost first."""
    return sorted(((number, name, t) for t in tensors for number, name in names[id(t)].values()), key=lambda h: h[:2])


def _referrer(tensor, tensors) -> str:
    """For a tensor no frame names: the type of what refers to it, other than our own lists of tensors."""
    if tensor is None:
        return UNREFERENCED
    mine = {id(tensors), *map(id, tensors.values())}
    outside = [r for r in gc.get_referrers(tensor) if id(r) not in mine and not isinstance(r, types.FrameType)]
    return f"a {type(outside[0]).__name__} no frame reaches" if outside else UNREFERENCED


def _tensors_under(value, live):
    """(path, tensor, id of its direct holder; None for `value` itself) for each tensor on a live storage
    that `value` reaches, by its shortest path (breadth first)."""
    seen, level = {id(value)}, [("", value, None)]
    for _ in range(MAX_DEPTH + 1):
        below = []
        for path, obj, parent in level:
            if isinstance(obj, torch.Tensor):
                if obj.untyped_storage()._cdata in live:
                    yield path, obj, parent
                continue
            for step, child in _children(obj):
                if id(child) not in seen and not isinstance(child, ATOMS):
                    seen.add(id(child))
                    below.append((path + step, child, id(obj)))
        level = below


def _children(obj):
    """(path step, child): a container's items, an object's attributes (a module's children as attributes)."""
    if isinstance(obj, ATOMS):
        return
    attributes = getattr(obj, "__dict__", None)
    for name, child in attributes.items() if isinstance(attributes, dict) else ():
        if name in ("_modules", "_buffers", "_parameters") and isinstance(child, dict):
            yield from ((f".{n}", c) for n, c in child.items())
        else:
            yield f".{name}", child
    if isinstance(obj, dict):
        yield from ((f"[{k!r}]", c) for k, c in list(obj.items()))
    elif isinstance(obj, (list, tuple)):
        yield from ((f"[{i}]", c) for i, c in enumerate(obj))


def explain_point(
    preset: str = EXPLAIN_DEFAULTS["preset"],
    overrides=None,
    batch: int = EXPLAIN_DEFAULTS["batch"],
    prompt: int = EXPLAIN_DEFAULTS["prompt"],
    new: int = EXPLAIN_DEFAULTS["new"],
    dtype: str = EXPLAIN_DEFAULTS["dtype"],
    cache: str = EXPLAIN_DEFAULTS["cache"],
    loop: str = EXPLAIN_DEFAULTS["loop"],
    generate_of: str = "kvlab",
    step: int | None = None,
    seed: int = EXPLAIN_DEFAULTS["seed"],
) -> Explanation:
    """Explain one greedy point of whose generate() `generate_of` names: kvlab's loop ("kvlab", with `cache` and
    `loop`), this transformers' own ("installed"), or a release's own ("4.40.1", "4.42.4": in its own process)."""
    from .models import parse_dtype
    from .planner.sources import build_model, load_config
    from .releases import RELEASES, ROOT, install_reference, release_values
    from .schema import LOOPS, check_choice

    for kind, value, choices in (
        ("generate_of", generate_of, ("kvlab", "installed", *RELEASES)),
        ("cache", cache, CACHES),
        ("loop", loop, LOOPS),
    ):
        check_choice(kind, value, choices)
    dtype = str(parse_dtype(dtype)).removeprefix("torch.")
    config = load_config(preset, overrides)  # raises on a bad preset or override before anything is built
    if generate_of in RELEASES:
        spec = dict(
            model_type=config.model_type,
            config=release_values(config),
            batch=batch,
            prompt=prompt,
            new=new,
            dtype=dtype,
            step=step,
            seed=seed,
        )
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(install_reference(generate_of)), str(ROOT)]))
        result = subprocess.run(
            [sys.executable, "-m", "kvlab.explain", json.dumps(spec)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"transformers {generate_of} run failed:\n{result.stderr[-3000:]}")
        record = json.loads(result.stdout.strip().splitlines()[-1])
        return Explanation(**dict(record, held=[Held(**item) for item in record["held"]]))
    model = build_model(preset, overrides, dtype=dtype, seed=seed)
    ids = random_prompt(config.vocab_size, batch, prompt, seed)
    if generate_of == "kvlab":
        from . import designs  # noqa: F401 (registers kvlab's own designs, list and prealloc, with make_cache)
        from .loops import generate

        return explain(lambda: generate(model, ids, new, cache=cache, loop=loop), model=model, step=step)
    return explain_generate(model, ids, new, step)


def explain_generate(model, ids: torch.Tensor, new: int, step: int | None = None, **options) -> Explanation:
    """transformers' own greedy generate(), exactly `new` tokens (no EOS), under `explain`; `options` go to
    generate() (num_beams, cache_implementation, ...)."""
    with torch.no_grad():
        return explain(generate_call(model, ids, new, **options), model=model, step=step)


def generate_call(model, ids: torch.Tensor, new: int, **options):
    """A callable that runs transformers' own generate() for exactly `new` tokens (no EOS), greedy unless
    `options` say otherwise."""
    options = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        **options,
    )
    model.generation_config.eos_token_id = None
    return lambda: model.generate(ids, **options)


def _release_worker(spec: dict) -> Explanation:
    """In a release's own process: its classes build the model (as kvlab.lab.reference does)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(spec["model_type"], **spec["config"], attn_implementation="sdpa")
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_config(config, torch_dtype=getattr(torch, spec["dtype"])).eval()
    ids = random_prompt(config.vocab_size, spec["batch"], spec["prompt"], spec["seed"])
    return explain_generate(model, ids, spec["new"], spec["step"])


if __name__ == "__main__":
    print(json.dumps(asdict(_release_worker(json.loads(sys.argv[1])))))
