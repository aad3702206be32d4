"""kvlab.timing.interleaved runs the contenders in turn, after one warm-up each, and keeps every repeat."""

from kvlab.timing import interleaved


def test_contenders_run_in_turn_after_one_warm_up_each():
    calls = []

    def contender(name, seconds):
        def run():
            calls.append(name)
            return seconds

        return run

    seconds = interleaved(
        {"a": contender("a", 1.0), "b": contender("b", 2.0)},
        repeats=3,
        warmup={"a": lambda: calls.append("warm a"), "b": lambda: calls.append("warm b")},
    )
    assert calls == ["warm a", "warm b", "a", "b", "a", "b", "a", "b"]
    assert seconds == {"a": [1.0, 1.0, 1.0], "b": [2.0, 2.0, 2.0]}


def test_without_a_warm_up_each_contender_runs_once_more_untimed():
    calls = []
    seconds = interleaved({"a": lambda: calls.append("a") or 0.5}, repeats=2)
    assert calls == ["a", "a", "a"] and seconds == {"a": [0.5, 0.5]}


def test_spread_pairs_each_run_with_the_baseline_of_its_own_round():
    import pandas as pd

    from kvlab.timing import spread

    # Round 2 is slow for both: the per-round ratio stays 1.25 while the medians alone would mix the rounds.
    runs = pd.DataFrame(
        [
            dict(new=8, contender=c, repeat=r, tokens_per_s=v)
            for c, r, v in [
                ("dynamic", 1, 100.0),
                ("prealloc", 1, 125.0),
                ("dynamic", 2, 40.0),
                ("prealloc", 2, 50.0),
                ("dynamic", 3, 80.0),
                ("prealloc", 3, 100.0),
            ]
        ]
    )
    table = spread(runs).loc[8]
    assert table.loc["prealloc", ["ratio_min", "ratio_median", "ratio_max"]].tolist() == [1.25, 1.25, 1.25]
    assert table.loc["dynamic", "ratio_median"] == 1.0
    assert table.loc["prealloc", ["median", "slowest", "fastest"]].tolist() == [100.0, 50.0, 125.0]
    assert table.loc["prealloc", "spread_pct"] == 75.0
