"""Side-by-side timing: contenders run in turn, `repeats` times, so a slow moment of a shared machine hits all alike
(`benchmarks/speed.py`, `benchmarks/graphs.py`, appendix A2). Time only unmetered runs: the live-storage counter
adds Python work to every operator, more for some designs.
"""

from __future__ import annotations

import time
from typing import Callable, Hashable

import torch

# The speed benchmark's contenders: kvlab's designs under today's loop, and transformers' own generate().
CONTENDERS = ("dynamic", "prealloc", "static", "transformers")


def interleaved(
    contenders: dict[Hashable, Callable[[], float]],
    repeats: int = 3,
    warmup: dict[Hashable, Callable[[], object]] | None = None,
) -> dict[Hashable, list[float]]:
    """Seconds of every repeat of each contender (each callable runs once and returns its seconds), after one
    warm-up call each (first calls pay for lazy initialisation and graph optimisation)."""
    for run in (warmup or contenders).values():
        run()
    seconds = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, run in contenders.items():
            seconds[name].append(run())
    return seconds


def decode_seconds(model, prompt: torch.Tensor, new: int, contender: str) -> float:
    """Seconds to decode `new` tokens after `prompt` (its forward included, as generate() times it): a kvlab cache
    design under the v5 loop, or `transformers` for the model's own greedy generate()."""
    from . import designs  # noqa: F401 (registers kvlab's own designs, list and prealloc, with make_cache)
    from .loops import generate

    if contender != "transformers":
        return generate(model, prompt, new, cache=contender, loop="v5").seconds
    start = time.perf_counter()
    model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new, do_sample=False
    )
    if prompt.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def speed_runs(model, prompt: torch.Tensor, lengths, contenders=CONTENDERS, repeats: int = 3) -> list[dict]:
    """Every timed run of the speed benchmark, one row each: for each length, the contenders interleaved
    `repeats` times after a 4-token warm-up each; `repeat` numbers the round, so that ratios can pair the
    runs of one round."""
    rows = []
    batch = prompt.shape[0]
    for new in lengths:
        seconds = interleaved(
            {c: (lambda c=c, new=new: decode_seconds(model, prompt, new, c)) for c in contenders},
            repeats,
            warmup={c: (lambda c=c: decode_seconds(model, prompt, 4, c)) for c in contenders},
        )
        rows += [
            dict(new=new, contender=c, repeat=i + 1, seconds=s, tokens_per_s=batch * new / s)
            for c, runs in seconds.items()
            for i, s in enumerate(runs)
        ]
    return rows


def with_ratios(runs, baseline: str = "dynamic"):
    """`runs` (speed_runs' rows as a DataFrame) with `ratio`: each run's tokens/s ÷ the baseline's run of the same
    length and round, so that a slow moment of the machine, which hits both, cancels."""
    base = runs[runs["contender"] == baseline].set_index(["new", "repeat"])["tokens_per_s"]
    same_round = base.loc[list(zip(runs["new"], runs["repeat"]))].to_numpy()
    return runs.assign(ratio=runs["tokens_per_s"].to_numpy() / same_round)


def spread(runs, baseline: str = "dynamic"):
    """Per length and contender (`runs`: speed_runs' rows as a DataFrame): the median, slowest and fastest
    tokens/s, the spread (fastest - slowest) / median, and the ratio to `baseline` round by round (its median,
    smallest and largest), so a lead is read against the noise of the same machine."""
    table = (
        with_ratios(runs, baseline)
        .groupby(["new", "contender"], sort=False)
        .agg(
            median=("tokens_per_s", "median"),
            slowest=("tokens_per_s", "min"),
            fastest=("tokens_per_s", "max"),
            ratio_median=("ratio", "median"),
            ratio_min=("ratio", "min"),
            ratio_max=("ratio", "max"),
        )
    )
    table.insert(3, "spread_pct", 100 * (table["fastest"] - table["slowest"]) / table["median"])
    return table
