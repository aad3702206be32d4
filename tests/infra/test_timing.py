"""kvlab.lab.timing.interleaved runs the contenders in turn, after one warm-up each, and keeps every repeat."""

from kvlab.lab.timing import interleaved, median


def test_contenders_run_in_turn_after_one_warm_up_each():
    calls = []

    def contender(name, seconds):
        def run():
            calls.append(name)
            return seconds
        return run

    seconds = interleaved({"a": contender("a", 1.0), "b": contender("b", 2.0)}, repeats=3,
                          warmup={"a": lambda: calls.append("warm a"), "b": lambda: calls.append("warm b")})
    assert calls == ["warm a", "warm b", "a", "b", "a", "b", "a", "b"]
    assert seconds == {"a": [1.0, 1.0, 1.0], "b": [2.0, 2.0, 2.0]}


def test_without_a_warm_up_each_contender_runs_once_more_untimed():
    calls = []
    seconds = interleaved({"a": lambda: calls.append("a") or 0.5}, repeats=2)
    assert calls == ["a", "a", "a"] and seconds == {"a": [0.5, 0.5]}


def test_median_ignores_one_slow_run():
    assert median([1.0, 9.0, 1.1]) == 1.1 and median([3.0]) == 3.0
