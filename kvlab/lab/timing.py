"""Side-by-side timing: contenders run in turn, `repeats` times, so a slow moment of a shared machine hits all alike
(notebooks 05 and 06, `benchmarks/speed.py`). Time only unmetered runs: the live-storage counter adds Python work
to every operator, more for some designs.
"""

from __future__ import annotations

from typing import Callable, Hashable


def interleaved(contenders: dict[Hashable, Callable[[], float]], repeats: int = 3,
                warmup: dict[Hashable, Callable[[], object]] | None = None) -> dict[Hashable, list[float]]:
    """Seconds of every repeat of each contender (each callable runs once and returns its seconds), after one
    warm-up call each (first calls pay for lazy initialisation and graph optimisation)."""
    for run in (warmup or contenders).values():
        run()
    seconds = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, run in contenders.items():
            seconds[name].append(run())
    return seconds


def median(values: list[float]) -> float:
    """The middle value (the upper one of an even count): a single slow run does not move it."""
    return sorted(values)[len(values) // 2]
