"""kvlab.explain names what holds each live storage at a peak, with no label given by hand.

Expected holders and bytes are worked out here from the shapes: (batch, KV heads, tokens, head_dim) x 4 bytes.
"""

import re

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from kvlab.decoding import Beams
from kvlab.explain import UNREFERENCED, explain, explain_generate, explain_point
from kvlab.loops import generate
from kvlab.meter import MemoryMeter
from kvlab.models import build_model
from kvlab.releases import ReferenceInstallError, install_reference

BATCH, PROMPT, NEW = 2, 16, 8
LAYERS, HEADS, HEAD_DIM = 4, 4, 64  # the toy preset: hidden 256 over 4 heads, 4 KV heads


def kv_tensor_bytes(tokens: int, batch=BATCH, heads=HEADS, head_dim=HEAD_DIM) -> int:
    return batch * heads * tokens * head_dim * 4


def held_by(explanation, pattern: str) -> dict[tuple, int]:
    """{the pattern's groups: storage bytes} for each storage whose holders include a full match."""
    found = {}
    for item in explanation.held:
        for name in item.holders:
            match = re.fullmatch(pattern, name)
            if match:
                found[match.groups()] = item.nbytes
    return found


def test_each_kind_of_holder_is_named():
    class Box:
        pass

    def run():
        box = Box()
        box.items = {"kept": [torch.ones(100)]}  # 400 bytes, two containers and an attribute down
        window = torch.ones(1000)[-10:]  # a view: the 1000-float storage stays, its base tensor is gone
        saved = torch.ones(50, requires_grad=True).exp().sum()  # exp's output: kept by autograd (C++) only
        return box, window, saved * 2  # the peak: the last op, everything above alive

    explanation = explain(run)
    assert explanation.op == "aten.mul.Tensor"
    rows = {item.holders[0]: item for item in explanation.held}
    assert rows["test_each_kind_of_holder_is_named.<locals>.run: box.items['kept'][0]"].nbytes == 400
    window = rows["test_each_kind_of_holder_is_named.<locals>.run: window"]
    assert (window.nbytes, window.tensor_bytes, window.tensor) == (4000, 40, "float32[10]")
    assert rows[UNREFERENCED].nbytes == 200
    assert sum(item.nbytes for item in explanation.held) == explanation.peak_bytes


def test_tuple_loop_peak_holds_the_old_tuple_and_the_new_cache(toy):
    ids = torch.randint(0, 1000, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0))
    run = lambda: generate(toy, ids, NEW, cache="tuple", loop="v4.40")
    explanation = explain(run)
    # The last step feeds token PROMPT + NEW - 2: the old tuple (the loop's `kv`, a TupleCache whose layers hold
    # the caller's tensors) holds one token less than the new cache its round trip builds.
    old = held_by(explanation, r"generate: kv\.layers\[(\d)\]\.(keys|values)")
    new = held_by(explanation, r"TupleCache\.round_trip: step_cache\.layers\[(\d)\]\.(keys|values)")
    assert sorted(old) == sorted((str(layer), kind) for layer in range(LAYERS) for kind in ("keys", "values"))
    assert set(old.values()) == {kv_tensor_bytes(PROMPT + NEW - 2)}
    assert sorted(new) == sorted((str(layer), kind) for layer in range(LAYERS) for kind in ("keys", "values"))
    assert set(new.values()) == {kv_tensor_bytes(PROMPT + NEW - 1)}
    # Every live byte is accounted for, and the peak is the meter's.
    assert sum(item.nbytes for item in explanation.held) == explanation.peak_bytes
    with torch.no_grad(), MemoryMeter("cpu") as meter:
        run()
    assert explanation.peak_bytes == meter.report().overhead_bytes
    assert "generate: kv.layers[i].keys" in explanation.format()
    # Small holders left out are counted, not dropped: the shown groups and the last line add up to the peak.
    short = explanation.format(min_share=0.01).splitlines()
    assert short[-1].startswith("and ") and len(short) < len(explanation.format().splitlines())
    assert all(float(line.split()[0]) >= 0.01 * explanation.peak_bytes / 2**20 for line in short[2:-1])


def test_one_cache_object_holds_one_cache(toy):
    """The fix, seen the same way: at the last step's peak, the cat of the last layer's values, one cache
    is alive plus the old values it is about to replace."""
    ids = torch.randint(0, 1000, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0))
    explanation = explain(lambda: generate(toy, ids, NEW, cache="dynamic", loop="v4.42"), model=toy, step=NEW - 1)
    assert explanation.op == "aten.cat.default"
    cache = held_by(explanation, r"generate: kv\.layers\[(\d)\]\.(keys|values)")
    old, new = kv_tensor_bytes(PROMPT + NEW - 2), kv_tensor_bytes(PROMPT + NEW - 1)
    assert cache.pop((str(LAYERS - 1), "values")) == old
    assert set(cache.values()) == {new} and len(cache) == 2 * LAYERS - 1
    assert held_by(explanation, r"aten\.cat\.default: (out)") == {("out",): new}
    assert not held_by(explanation, r".*step_cache.*")


@pytest.mark.slow  # a release install and a subprocess: make test-all
def test_release_4_40_1_generate_holds_two_caches():
    try:
        install_reference("4.40.1")
    except ReferenceInstallError as error:
        pytest.skip(str(error))
    explanation = explain_point(generate_of="4.40.1", preset="toy", batch=BATCH, prompt=PROMPT, new=NEW)
    old = held_by(explanation, r"GenerationMixin\._greedy_search: model_kwargs\['past_key_values'\]\[(\d)\]\[(\d)\]")
    new = held_by(explanation, r"LlamaModel\.forward: past_key_values\.(key|value)_cache\[(\d)\]")
    assert sorted(old) == [(str(layer), str(j)) for layer in range(LAYERS) for j in (0, 1)]
    assert set(old.values()) == {kv_tensor_bytes(PROMPT + NEW - 2)}
    assert sorted(new) == sorted((kind, str(layer)) for layer in range(LAYERS) for kind in ("key", "value"))
    assert set(new.values()) == {kv_tensor_bytes(PROMPT + NEW - 1)}


def test_sliding_layer_keeps_the_prefill_buffer_until_the_first_decode_step():
    window, prompt, kv_heads, head_dim = 16, 256, 2, 16
    config = MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        vocab_size=500,
        sliding_window=window,
        max_position_embeddings=1024,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    ids = torch.randint(0, 500, (1, prompt), generator=torch.Generator().manual_seed(0))
    pattern = r".*\.layers\[(\d)\]\.(keys|values)"
    first = explain_generate(model, ids, 3, step=1)
    held = {name: item for item in first.held for name in item.holders if re.fullmatch(pattern, name)}
    assert len(held) == 4  # keys and values of both layers, still the prefill's views
    for item in held.values():
        assert item.nbytes == kv_tensor_bytes(prompt, 1, kv_heads, head_dim)  # the whole prompt's buffer
        assert item.tensor_bytes == kv_tensor_bytes(window - 1, 1, kv_heads, head_dim)  # what the view shows
        assert item.tensor == f"float32[1, {kv_heads}, {window - 1}, {head_dim}]"
    second = explain_generate(model, ids, 3, step=2)
    sizes = set(held_by(second, pattern).values())
    assert sizes == {kv_tensor_bytes(window, 1, kv_heads, head_dim)}  # by then each view is of a W-token buffer


def test_bad_choices_fail_before_building_anything():
    with pytest.raises(ValueError, match="unknown generate_of 'v9'; choose one of: kvlab, installed, 4.40.1"):
        explain_point(generate_of="v9")
    with pytest.raises(ValueError, match="step needs the model"):
        explain(lambda: None, step=1)


def test_the_command_line_prints_the_holders_and_refuses_bad_input_in_one_line(capsys):
    from kvlab.cli import main

    main(["explain", "--new", "4"])  # the tuple design under v4.40 on the toy model
    table = capsys.readouterr().out
    assert table.startswith("peak ") and "generate: kv.layers[i].keys" in table
    assert "TupleCache.round_trip: step_cache.layers[i].keys" in table
    with pytest.raises(SystemExit) as exit_:
        main(["explain", "--generate-of", "4.41.0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "choose one of: kvlab, installed, 4.40.1, 4.42.4" in err


@pytest.mark.slow  # 5.24's generate() drops an all-ones mask; 5.17's (make test-all's rerun, quick tests only) does not
def test_v5_beam_on_a_sliding_layout_shares_one_mask_row_as_5x_generate_does():
    """From 5.18 generate() drops the attention mask of ones, so the sliding mask has one row for every beam; so
    does kvlab's v5 loop (it passed the mask and got a row per beam: (rows - 1) x prompt x prompt bytes more)."""
    model = build_model("mistral-7b-v0.1-twin", ["sliding_window=64"], dtype="bfloat16")
    rows, prompt = 3, 100
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    ours = explain(lambda: generate(model, ids, 4, cache="dynamic", loop="v5", strategy=Beams(rows)), model=model)
    theirs = explain_generate(model, ids, 4, num_beams=rows)
    mask = r"MistralModel\.forward: causal_mask"
    assert held_by(ours, mask) == held_by(theirs, mask) == {(): prompt * prompt}
    # The peaks agree to well within the extra rows' 20,000 bytes (each loop's own bookkeeping: 2.4 KB here).
    assert abs(ours.peak_bytes - theirs.peak_bytes) <= (rows - 1) * prompt * prompt / 4
