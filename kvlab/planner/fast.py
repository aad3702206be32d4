"""predict's fast dry run: the dry run (kvlab.planner.dry_run) of a model cut down to a few layers, its count
extrapolated to every layer, within 1 % of the dry run of the whole model (tests/test_fast.py) in well under a
second a design where the whole one takes 8-90 s.

Where a whole-model dry run spends its time (profiled on Qwen3-30B-A3B, batch 8, prompt 32,000, 512 new, dynamic:
34 s): three quarters growing each of 48 layers' caches a token at a time for every skipped step (each token an
update under the meter and MetaAsCpu: ~0.8 ms), the rest forwarding 48 layers on meta (~37 ms a layer, every
expert of 128 run) at each kept step; `list` and `prealloc` keep 50 and 32 steps more, hence 86 s and 35 s.
Cut down as below, most of what is left is PyTorch's meta kernels (Python, ~0.3 ms an op), which every dry run
asks from memory once it has asked them (kvlab.planner.meta.KnownShapes, exact: the same inputs' shapes, the same
outputs'). Four cuts, each kept exact where it can be:

- fewer steps, and no token-by-token growth (`BulkSkippingForward`): of the last `period` steps only those
  where a layer reallocates run the forward (`ForwardRule`; a stand-in cache of one number a token finds which,
  before the run: `bulk_plan`), and the loop runs those, steps 0-2 and one before each kept step that follows a
  gap: that step adds the gap's tokens in bulk, each layer left with the tensors token-by-token growth leaves it.
  On meta the same shapes are the same count: the kept steps are exact, the skipped ones' transients smaller.
- a shorter scan (kvlab.planner.scans): the gated delta rule's reference prefill loops over its prompt's chunks
  (500 at 32,000 tokens, in each linear-attention layer), and on meta every chunk after the first allocates what
  the second does: two chunks count what all of them count, exactly.
- fewer layers (`LayerCut`): a model's layers come in a few kinds (a layer's cache type and its modules' classes,
  parameter shapes and settings: sliding or full attention, Mamba or attention, a dense MLP or experts). Bytes
  held per layer add up (caches, and a layer's share of anything per layer), and the transients inside a forward
  are one layer's at a time; so each step's peak is a + sum over kinds of b_k n_k for n_k layers of kind k, from
  the second layer of a kind on (the first layer's transients differ: Qwen3-MoE's second layer holds 32 MB more
  than its first at a 4,000-token prompt, its third no more than its second). One dry run of two layers of each
  kind (the last layer of each kind in the model's order, after a copy of each: the peak inside the last layer,
  or after it, sees every earlier layer's cache as in the whole model) gives the base; one more per kind with a
  third layer of that kind in front gives b_k; each step's peak is extrapolated, and the highest is the answer.
  What is not linear: a peak inside a layer while layers of another kind after it have not cached yet (the
  prompt's step) counts those later layers' cache early, at most a few layers' share of the prompt's cache
  (benchmarks/predict.py measures the error on six large models; tests/test_fast.py on small ones).
- one run where it can (`Shares`): b_k is what one more layer of kind k holds at each step, its cache; the base's
  first layer of each kind, once its forward has ended, holds what a layer more in front would. Its share of the
  base's storages stands in for the run with that layer more, once the two have agreed at the point on one design
  (`FastDryRun.shares_hold`; tests/test_fast.py holds them equal for every design on every layout): on six large
  models, all designs of one in half the time.

kvlab.theory's closed forms stay what predict uses for the families it models; this walks every other decoder.
A model whose layers read other layers' caches (KV sharing) cannot be cut; it gets the whole model's dry run.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..caches import every_tensor
from ..decoding import decoding
from ..loops import generate
from ..meter import LiveStorageCounter, MemoryMeter, MemoryReport, StepMemory, storage_bytes, weight_bytes
from ..models import layer_kinds
from .dry_run import BulkPlan, BulkSkippingForward, DryRun, SkippingForward, bulk_plan, cache_options, held_tokens
from .meta import MetaAsCpu
from .scans import short_scans
from .sources import build_model

# How many steps apart the two runs of the loop alone are (`FastDryRun._loop_bytes`).
LOOP_STEPS = 4


class Uncuttable(ValueError):
    """A model `LayerCut` cannot cut down: the whole model's dry run answers."""


class FastDryRun(DryRun):
    """`DryRun`'s answer from dry runs of a model cut to a few layers (`LayerCut`), with bulk skipping."""

    def __init__(self, p: dict, as_device=None):
        if p["restart_new"]:
            super().__init__(p)  # refuses, as the exact run does
        self.p, self.as_device = p, as_device or (lambda: MetaAsCpu())  # a fresh mode for every run
        self.cut = layer_cut(p["preset"], json.dumps(p["overrides"], sort_keys=True), p["dtype"], p["seed"])
        self.model = self.cut.model

    # Points (a model, and a design's point but its cache and loop) where the first cut's shares were checked against
    # the other cuts' runs -> whether they gave the same answer. Shared by the process's predictions.
    shares_hold: dict = {}

    def measure(self, design: dict):
        """`DryRun.measure` from the cut models' runs, each looping only the steps of its `bulk_plan`; where the
        first cut's shares stand in for the other cuts' runs (`Shares`), from its run alone."""
        d = design
        plans = [bulk_plan(model, d["cache"], d["prompt"], d["new"], cache_options(d)) for model in self.cut.models]
        if len(set(plans)) != 1:
            raise RuntimeError("the cut models' dry runs would step differently")
        left_out, point = self._left_out(design, plans[0]), self._point(design)
        first, held, shares = self._run(self.cut.models[0], design, plans[0], self.cut.watched)
        mine = self._from_shares(first, shares, design, left_out)
        if mine is not None and self.shares_hold.get(point):
            return mine, self.cut.held([held])
        reports = [first] + [self._run(model, design, plans[0])[0] for model in self.cut.models[1:]]
        whole = self.cut.extrapolate(reports, left_out)
        if mine is not None and point not in self.shares_hold:
            self.shares_hold[point] = mine.timeline == whole.timeline and mine.peak_bytes == whole.peak_bytes
        return whole, self.cut.held([held])

    def _from_shares(self, first: MemoryReport, shares: Shares, design: dict, left_out: dict) -> MemoryReport | None:
        """The answer from the first cut's run and its shares; None where they cannot give it."""
        if design["strategy"] == "beam" or len(self.cut.models) == 1:  # beam search reorders caches between steps
            return None
        extra = self.cut.increments(first, shares)
        mine = None if extra is None else self.cut.extrapolate([first, *extra], left_out)
        # The shares split the first cut's peak: where the answer's is another step, the runs answer.
        return mine if mine is not None and peak_step(mine) == peak_step(first) else None

    def _point(self, design: dict) -> str:
        """The model and the point of `design` but its cache and loop: where one check of the shares holds."""
        model = (self.p["preset"], self.p["overrides"], self.p["dtype"], self.p["seed"])
        return json.dumps([model, {k: v for k, v in design.items() if k not in ("cache", "loop")}], sort_keys=True)

    def _left_out(self, design: dict, plan: BulkPlan) -> dict[int, int]:
        """Bytes the loop's own tensors would hold more at each step looped, had the loop run every step."""
        if len(plan.visits) == design["new"]:
            return dict.fromkeys(plan.visits, 0)
        upfront, growth = self._loop_bytes(design)
        left_out = design["new"] - len(plan.visits)
        return {step: upfront * left_out + growth * (step - i) for i, step in enumerate(plan.visits)}

    def _loop_bytes(self, design: dict) -> tuple[int, int]:
        """Bytes a step more adds to what the loop's own tensors hold as a forward starts (the ids, positions, a
        mask, beam search's buffers): (from the loop's start: buffers sized by the tokens to decode; after step 2,
        besides those: what grows a token a step). From two runs of the loop alone, LOOP_STEPS steps apart: no
        forward, no cache, the live bytes read as each step's forward would start."""
        d, starts = design, []
        for new in (4, 4 + LOOP_STEPS):
            ids = torch.empty((d["batch"], d["prompt"]), dtype=torch.long, device="meta")
            strategy = decoding(d["strategy"], d["num_beams"])
            with self.as_device(), MemoryMeter("meta", self.cut.models[0]) as meter:
                starts.append(live := [])
                generate(self.cut.models[0], ids, new, cache="dynamic", loop=d["loop"], strategy=strategy,
                         meter=meter, step_forward=_Reading(meter, live))  # fmt: skip
        upfront = (starts[1][0] - starts[0][0]) // LOOP_STEPS
        growth = (starts[1][3 + LOOP_STEPS] - starts[1][3]) // LOOP_STEPS
        return upfront, growth

    def _run(self, model, design: dict, plan: BulkPlan, watched: dict | None = None):
        """(report, tokens each layer holds, and with `watched` the `Shares` of those layers, else None) of one cut's
        run."""
        shares = Shares(watched) if watched else None
        hooks = [hook for i in watched or () for hook in shares.watch(model.get_decoder().layers[i], i)]
        try:
            with short_scans(model):  # a prompt's scan over its chunks in two of them (kvlab.planner.scans)
                step_forward = _SharedGrowth(plan, shares) if shares is not None else None
                report, cache = self.run(design, model=model, plan=plan, counter=shares, step_forward=step_forward)
            if shares is not None:
                shares.end_bytes = {i: storage_bytes([*every_tensor(cache.layers[i])]) for i in watched}
        finally:
            for hook in hooks:
                hook.remove()
        return report, held_tokens(cache), shares


def peak_step(report: MemoryReport) -> int:
    """The step of a report's peak (the first that reaches it)."""
    return max(report.timeline, key=lambda s: s.peak_bytes).step


class Shares(LiveStorageCounter):
    """The meter's live-storage counter, also noting what a few layers of a cut model hold (`layers`: their
    indexes) at each step's peak and end: the storages each made in its forward or its growth (`_SharedGrowth`)
    and still holds, but the hidden states it returns (the next layer's input, not the layer's). The extrapolation
    adds, for each layer more of a kind, what one more layer of it holds at each step (`LayerCut`'s other cuts: one
    more layer of a kind in front); a layer's share is that without another run. At a peak after its forward (or
    growth) in the step, the share is what it holds then; at a peak inside or before it, what it holds as its
    forward ends (as the layer in front would already), where it held all of that at the peak, else None: the runs
    answer. What it holds is its cache (and the round trip's previous one where a loop keeps it), which a layer more in
    front would hold as well, if nothing else a layer holds differs by its place: `FastDryRun` checks that once a
    point, against the other cuts' runs, and uses the shares only where they gave the same answer."""

    def __init__(self, layers):
        super().__init__()
        self.tag = None  # the layer whose forward or growth runs now
        self.labels: dict[int, str] = {}  # the meter's names of storages (kvlab.planner.dry_run.dry_run sets it)
        self.end_bytes: dict[int, int] = {}  # each watched layer's cache bytes as the run ends (`FastDryRun._run`)
        self.owned: dict[int, dict[int, int]] = {i: {} for i in layers}  # layer -> {serial: bytes}
        self.done: set[int] = set()  # the layers whose forward or growth has ended in this step
        self.at_step_peak = self._now(every=True)
        self.at_peak: dict[int, dict[int, int] | None] = {}
        self.before_step_peak = self.before_peak = {}  # what every layer held at those peaks, done or not
        self.steps: list[tuple[dict, dict]] = []  # each closed step's (shares at its peak, at its end)

    def watch(self, layer: nn.Module, index: int):
        """Hooks that tag what `layer` makes in its forward as layer `index`'s, and end its share's step there."""
        before = layer.register_forward_pre_hook(lambda *_: setattr(self, "tag", index))
        after = layer.register_forward_hook(lambda module, args, out: self.ended(index, out))
        return before, after

    def ended(self, index: int, returned=None):
        """Layer `index` has ended its forward (returning `returned`) or growth in this step."""
        self.tag = None
        if index not in self.owned:
            return
        for storage in (t.untyped_storage() for t in tree_leaves(returned) if isinstance(t, torch.Tensor)):
            entry = self.live.get(storage._cdata)
            if entry is not None:
                self.owned[index].pop(entry[0], None)
        self.done.add(index)
        # A peak before this layer's forward ended: a layer in front would hold what this one holds now, which it
        # holds at the peak too where every storage it keeps was there then, as large (the peak was after its
        # cache's update, or the update wrote in place); what else it held then was its forward's own transient.
        now = dict(self.owned[index])
        for shares, before in ((self.at_step_peak, self.before_step_peak), (self.at_peak, self.before_peak)):
            if shares.get(index, 0) is None and now.items() <= before.get(index, {}).items():
                shares[index] = now

    def _now(self, every: bool = False) -> dict:
        return {i: dict(owned) if every or i in self.done else None for i, owned in self.owned.items()}

    def _add(self, nbytes: int, scratch: int = 0):
        step_peak, peak = self.step_peak_bytes, self.peak_bytes
        super()._add(nbytes, scratch)
        if self.step_peak_bytes > step_peak:
            self.at_step_peak, self.before_step_peak = self._now(), self._now(every=True)
        if self.peak_bytes > peak:
            self.at_peak, self.before_peak = self._now(), self._now(every=True)

    def _born(self, serial: int, storage, nbytes: int):
        super()._born(serial, storage, nbytes)
        owner = next((i for i, owned in self.owned.items() if serial in owned), self.tag)
        if owner in self.owned:
            self.owned[owner][serial] = nbytes

    def _free(self, key: int):
        entry = self.live.get(key)
        if entry is not None:
            for owned in self.owned.values():
                owned.pop(entry[0], None)
        super()._free(key)

    def close_step(self):
        self.steps.append((self.at_step_peak, self._now(every=True)))
        super().close_step()
        self.done, self.before_peak = set(), {}  # a later step's forward does not fill an earlier step's peak
        self.at_step_peak = self._now(every=True)  # a step whose peak is its start: what the last one left


class _SharedGrowth(BulkSkippingForward):
    """`BulkSkippingForward` growing one layer at a time, each watched layer's growth tagged as its own (`Shares`)."""

    def __init__(self, plan: BulkPlan, shares: Shares):
        super().__init__(plan)
        self.shares = shares

    def grow(self, cache, step: int, tokens: int) -> None:
        for index, layer in enumerate(cache.layers):
            self.shares.tag = index
            super().grow(_OneLayer(layer), step, tokens)
            self.shares.ended(index)


class _OneLayer:
    """A cache of one layer, for the growth functions (they read `layers` alone)."""

    def __init__(self, layer):
        self.layers = [layer]


class _Reading(SkippingForward):
    """A `step_forward` that runs no forward and notes the meter's live bytes as each step's forward would start."""

    def __init__(self, meter, live: list[int]):
        super().__init__(frozenset())
        self.meter, self.live = meter, live

    def __call__(self, step, model, cache, **inputs):
        self.live.append(self.meter.live_bytes())
        return super().__call__(step, model, cache, **inputs)


def fast_or_exact(p: dict, as_device=None) -> DryRun:
    """The fast dry run where the model can be cut down, else the whole model's (each as `as_device` allocates)."""
    try:
        return FastDryRun(p, as_device)
    except Uncuttable:
        return DryRun(p, as_device)


@functools.lru_cache(maxsize=8)
def layer_cut(preset: str, overrides: str, dtype: str, seed: int) -> LayerCut:
    """The cut of a model (built on meta once per process: a warm plan builds nothing)."""
    return LayerCut(build_model(preset, json.loads(overrides), "meta", dtype, seed))


class LayerCut:
    """A decoder on meta and the few-layer models its dry run is extrapolated from (see the module's docstring):
    `models[0]` holds the last layer of each kind, in the model's order, after one more of each kind that has more;
    `models[1:]` each one more layer of one kind in front. `kinds[i]`: layer i's kind."""

    def __init__(self, model):
        self.model = model
        decoder = model.get_decoder()
        layers = getattr(decoder, "layers", None)
        config = model.config
        if not isinstance(layers, nn.ModuleList) or len(layers) != config.num_hidden_layers:
            raise Uncuttable(f"{config.model_type}: no list of its decoder layers")
        if getattr(config.get_text_config(decoder=True), "num_kv_shared_layers", 0):
            raise Uncuttable(f"{config.model_type}: layers read other layers' caches")
        cache_kinds = [repr(kind) for kind in layer_kinds(config)]
        self.kinds = [(cache_kinds[i], _structure(layer)) for i, layer in enumerate(layers)]
        last = {kind: i for i, kind in enumerate(self.kinds)}  # each kind's last layer
        anchors = sorted(last.values())
        self.counts = {kind: self.kinds.count(kind) for kind in last}
        # kinds of more than two layers: models[1 + i] has one more layer of kind extra[i] than models[0]
        self.extra = [self.kinds[i] for i in anchors if self.counts[self.kinds[i]] > 2]
        base = [i for i in anchors if self.counts[self.kinds[i]] > 1] + anchors
        self.models = [_cut(model, decoder, base, cache_kinds)]
        self.models += [_cut(model, decoder, [last[kind], *base], cache_kinds) for kind in self.extra]
        self.anchor_kinds = [self.kinds[i] for i in anchors]
        self.base = len(base)
        self.weights = weight_bytes(model)
        # In models[0], the first layer of each kind in `extra` (in front of that kind's others): whose shares
        # (`Shares`) stand in for models[1:]'s runs.
        self.watched = {base.index(last[kind]): kind for kind in self.extra}

    def increments(self, first: MemoryReport, shares: Shares) -> list[MemoryReport] | None:
        """The reports of models[1:] as models[0]'s (`first`) plus, at each step's peak and end and at the peak,
        what its layer of each kind in `extra` holds (`shares`); None where a share is not known (`Shares`) or the
        layer holds more than its cache as the run ends."""
        if len(shares.steps) != len(first.timeline) or shares.at_peak is None:
            return None
        index = {kind: i for i, kind in self.watched.items()}
        reports = []
        for kind in self.extra:
            i = index[kind]
            held = [(at_peak[i], at_end[i]) for at_peak, at_end in shares.steps]
            if any(a is None for pair in held for a in pair) or shares.at_peak.get(i) is None:
                return None
            if sum(held[-1][1].values()) != shares.end_bytes[i]:  # the layer holds more than its cache, or less
                return None
            timeline = [
                StepMemory(s.step, s.live_bytes + sum(end.values()), s.peak_bytes + sum(peak.values()))
                for s, (peak, end) in zip(first.timeline, held)
            ]
            at_peak = dict(first.at_peak)
            for serial, nbytes in shares.at_peak[i].items():
                part = shares.labels.get(serial, "other")
                at_peak[part] = at_peak.get(part, 0) + nbytes
            reports.append(dataclasses.replace(first, timeline=timeline, at_peak=at_peak))
        return reports

    def _linear(self, values: list[int]) -> int:
        """The whole model's value from the cut models' (a + sum of (n_k - 2) b_k: the base holds two of each)."""
        base = values[0]
        return base + sum((self.counts[kind] - 2) * (v - base) for kind, v in zip(self.extra, values[1:]))

    def extrapolate(self, reports: list[MemoryReport], left_out: dict[int, int]) -> MemoryReport:
        """The whole model's report from the cut models' runs: each step's bytes extrapolated in the layers, plus
        what the loop's tensors of the steps left out of the runs' loops hold (`left_out`, by step); the peak the
        highest step; what it holds (kv, logits, other) extrapolated from each run's split at its peak, the loop's
        tensors left out counted as other."""
        steps = [{s.step: s for s in report.timeline} for report in reports]
        if len({tuple(timeline) for timeline in steps}) != 1:
            raise RuntimeError("the cut models' dry runs stepped differently")

        def per_step(step: int, field: str) -> int:
            return self._linear([getattr(timeline[step], field) for timeline in steps]) + left_out[step]

        timeline = [StepMemory(step, per_step(step, "live_bytes"), per_step(step, "peak_bytes")) for step in steps[0]]
        peak = max(timeline, key=lambda s: s.peak_bytes)
        parts = {part for report in reports for part in report.at_peak if part != "weights"}
        at_peak = {"weights": self.weights}
        at_peak |= {part: self._linear([r.at_peak.get(part, 0) for r in reports]) for part in sorted(parts)}
        at_peak["other"] = at_peak.get("other", 0) + left_out[peak.step]
        overhead = peak.peak_bytes
        first = reports[0]
        return MemoryReport(first.device, first.method, self.weights, self.weights + overhead, None, timeline, at_peak)

    def held(self, held: list[list[int]]) -> list[int]:
        """Tokens each of the whole model's layers holds: its kind's, in the first cut model."""
        of_kind = dict(zip(self.anchor_kinds, held[0][self.base - len(self.anchor_kinds) :]))
        return [of_kind[kind] for kind in self.kinds]


def _structure(layer: nn.Module) -> tuple:
    """What makes two decoder layers the same kind: each module's class, parameter shapes and plain settings
    (a window, a layer type's name), all but the layer's index."""
    return tuple(
        (
            name,
            type(module).__name__,
            tuple((key, tuple(p.shape), p.dtype) for key, p in module.named_parameters(recurse=False)),
            tuple(
                (key, value)
                for key, value in sorted(vars(module).items())
                if key not in ("layer_idx", "training") and isinstance(value, (str, int, float, bool, type(None)))
            ),
        )
        for name, module in layer.named_modules()
    )


def _cut(model, decoder, indices: list[int], cache_kinds: list[str]):
    """A model of `model`'s layers `indices` (copies, renumbered) and its other modules (shared: on meta they
    hold no data), with a config of that many layers of those types."""
    config = copy.deepcopy(model.config)
    types = getattr(config, "layer_types", None)  # read first: Bamba's follow num_hidden_layers
    config.num_hidden_layers = len(indices)
    if hasattr(config, "attn_layer_indices") and config.attn_layer_indices:  # Bamba's types: from these indices
        config.attn_layer_indices = [new for new, old in enumerate(indices) if old in config.attn_layer_indices]
    elif isinstance(types, list):
        try:
            config.layer_types = [types[i] for i in indices]
        except AttributeError:  # derived from other keys, in a spelling of that config's own (Jamba, Mamba-2)
            raise Uncuttable(f"{config.model_type}: its layer types cannot be set") from None
    if [repr(kind) for kind in layer_kinds(config)] != [cache_kinds[i] for i in indices]:
        raise Uncuttable(f"{config.model_type}: a config of fewer layers gives them other cache types")
    layers = nn.ModuleList(copy.deepcopy(decoder.layers[i], {id(model.config): config}) for i in indices)
    for index, layer in enumerate(layers):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = index
    cut_decoder = _shallow(decoder, layers=layers)
    cut_decoder.config = config
    name = next((name for name, child in model.named_children() if child is decoder), None)
    if name is None:  # OPT's decoder inside its model
        raise Uncuttable(f"{config.model_type}: its decoder is not a module of the model's own")
    cut = _shallow(model, **{name: cut_decoder})
    cut.config = config
    return cut


def _shallow(module: nn.Module, **children) -> nn.Module:
    """A copy of `module` sharing its parameters and submodules but those in `children`, with hook and child
    tables of its own (what is registered on the copy stays on the copy)."""
    clone = copy.copy(module)
    clone.__dict__ = {
        key: copy.copy(value) if isinstance(value, dict) else value for key, value in vars(module).items()
    }
    for name, child in children.items():
        clone._modules[name] = child
    return clone
