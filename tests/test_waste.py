"""kvlab.waste: the table's baseline and terms add up to the peak the meter measures in its own run; the final
cache and the retained prefill view are worked out here from the shapes, and the final cache also read from the
cache transformers' generate() returns."""

from pathlib import Path

import pandas as pd
import pytest
import torch

from kvlab import waste
from kvlab.explain import generate_call
from kvlab.models import build_model

SMALL = dict(preset="toy", overrides={}, prompt=16, new=6)
SLIDING = dict(preset="mistral-7b-twin", overrides={"sliding_window": 8}, prompt=24, new=4)  # prompt > window
POINTS = {
    "greedy": dict(SMALL, generate={}, fix=["prealloc"]),
    "static": dict(SMALL, generate=dict(cache_implementation="static"), fix=["chunked-prefill"]),
    "beam3": dict(SMALL, generate=dict(num_beams=3), fix=["beam-prefill-once"]),
    "sliding": dict(SLIDING, generate={}, fix=["prealloc"]),
}


def total(rows, kinds=("baseline", "term")) -> int:
    return sum(row["bytes"] for row in rows if row["kind"] in kinds)


# The sliding point (a 7B twin's layers) in make test-all; the three small ones in make test.
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] * (n == "sliding")) for n in POINTS])
def test_baseline_and_terms_add_up_to_the_meters_peak(name):
    rows = waste.measure_point(name, POINTS[name])
    peak = total(rows, ("check",))  # weights + the meter's peak in its own run, not explain's
    assert total(rows) == pytest.approx(peak, rel=1e-3)
    assert [row["term"] for row in rows if row["kind"] == "fix"] == POINTS[name]["fix"]


@pytest.mark.parametrize("name", ["greedy", "beam3", "sliding"])
def test_final_cache_is_what_generate_returns(name):
    point = POINTS[name]
    model = build_model(point["preset"], point["overrides"], dtype="bfloat16")
    ids = torch.randint(0, model.config.vocab_size, (1, point["prompt"]))
    with torch.inference_mode():
        out = generate_call(model, ids, point["new"], return_dict_in_generate=True, **point["generate"])()
    returned = sum(tensor.nbytes for layer in out.past_key_values.layers for tensor in (layer.keys, layer.values))
    beams = point["generate"].get("num_beams", 1)
    assert waste.final_cache_bytes(model.config, beams, point["prompt"], point["new"], "bfloat16") == returned


@pytest.mark.slow  # beyond the lesson's guarantees: make test-all
def test_retained_prefill_view_is_the_prompt_past_the_window():
    rows = {row["term"]: row["bytes"] for row in waste.measure_point("sliding", POINTS["sliding"])}
    layers, kv_heads, head_dim, window = 32, 8, 4, 8  # the Mistral-7B twin: 4096 / 32 / 32 wide heads
    per_layer_token = 2 * kv_heads * head_dim * 2  # keys and values, bf16
    past_window = SLIDING["prompt"] - (window - 1)  # what attention never reads again, kept by the views
    assert rows["storage the cache's tensors do not show"] == layers * past_window * per_layer_token


def test_stored_table_adds_up():
    path = Path(__file__).resolve().parent.parent / "data" / "today" / "waste.csv"  # python -m kvlab waste
    table = pd.read_csv(path, keep_default_na=False)
    for name, rows in table.groupby("point"):
        peak = rows.loc[rows["kind"] == "check", "bytes"].item()
        assert rows.loc[rows["kind"].isin(["baseline", "term"]), "bytes"].sum() == pytest.approx(peak, rel=1e-3), name
        assert set(table["point"]) == set(waste.POINTS)
