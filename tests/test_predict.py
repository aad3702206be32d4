"""Predict before you run: the peak of every design from a config alone, and points that cannot fit refused."""

import json
import re

import pytest

import kvlab.configs
import kvlab.lab.point
import kvlab.models
import kvlab.planner.plan
from kvlab.cli import main
from kvlab.configs import build_config
from kvlab.lab.point import measure
from kvlab.planner import theory
from kvlab.planner.params import normalize
from kvlab.planner.plan import GIB, TooBig, largest_batch, parse_bytes
from kvlab.planner.sources import load_config
from kvlab.schema import DESIGNS

LLAMA_PR_POINT = ["--preset", "llama2-7b", "--dtype", "bfloat16", "--batch", "8", "--prompt", "300", "--new", "500"]
TINY = dict(preset="toy", overrides="num_hidden_layers=1", batch=1, prompt=4, new=2, device="cpu", timing=False)


@pytest.fixture
def no_model(monkeypatch):
    """Building a model (or predicting with a real one) fails the test: prediction works from the config."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(kvlab.models, "build_model", refuse)
    monkeypatch.setattr(kvlab.lab.point, "build_model", refuse)  # the name measure calls


def predict_output(capsys, *args):
    main(["predict", *args])
    return capsys.readouterr().out


def test_predict_a_preset_prints_every_design_and_whether_it_fits(capsys, no_model):
    out = predict_output(capsys, *LLAMA_PR_POINT, "--memory", "17GiB")  # planned for cuda: none named
    for cache, loop in DESIGNS:
        assert f"{cache}/{loop} " in out
    assert "weights 12.551 GiB" in out and "fits in 17.000 GiB" in out
    assert "planned for: cuda (the default: no device named)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if "/v" in line}
    assert rows["tuple/v4.40"][5] == "NO"  # 12.55 GiB of weights + 2 x KV (6.25 GiB) + the context > 17 GiB
    assert rows["dynamic/v5"][5] == "yes"  # + 1.01 x KV (3.17 GiB) + the context (0.67 GiB) fits


def test_predict_a_config_json_in_a_folder_or_as_a_file(tmp_path, capsys, no_model):
    build_config("mistral-7b").to_json_file(tmp_path / "config.json")
    for source in (tmp_path, tmp_path / "config.json"):
        out = predict_output(capsys, "--preset", str(source), "--dtype", "bf16", "--memory", "14GB")
        assert "mistral, 32 layers, hidden 4096, 32 heads / 8 KV heads" in out
        assert all(f"{cache}/{loop} " in out for cache, loop in DESIGNS)
        assert "NO" in out and "yes" not in out  # 13.5 GiB of weights do not fit in 14 GB (13.04 GiB)


def test_predict_json_for_one_design(capsys, no_model):
    result = json.loads(
        predict_output(capsys, *LLAMA_PR_POINT, "--cache", "static", "--loop", "v5", "--json", "--memory", "24GiB")
    )
    [row] = result["designs"]
    assert (row["cache"], row["loop"]) == ("static", "v5") and row["fits"] is True
    assert row["peak_bytes"] == result["weights_bytes"] + row["predicted_overhead_bytes"]


def test_prediction_matches_the_h200_measurement_of_transformers_4_40():
    """DESIGN §2: transformers 4.40.1 on an H200, Llama-2-7B bf16, batch 8, prompt 300, 500 new: 6.248 GiB."""
    config = build_config("llama2-7b")
    overhead = theory.predict_overhead(
        config, cache="tuple", loop="v4.40", batch=8, prompt=300, new=500, dtype="bfloat16"
    )
    assert overhead / GIB == pytest.approx(6.248, rel=0.03)


def test_a_model_type_theory_does_not_model_gets_a_dry_run(tmp_path, capsys):
    """The CLI answers for GPT-2 by a dry run on meta (tests/test_dry_run.py holds it against CPU runs)."""
    from transformers import GPT2Config

    GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512).to_json_file(tmp_path / "config.json")
    point = ["--batch", "1", "--prompt", "16", "--new", "4", "--cache", "dynamic", "--loop", "v5"]
    main(["predict", "--preset", str(tmp_path), *point, "--device", "cpu"])  # as the run it is held against
    table = capsys.readouterr().out
    assert "gpt2, 2 layers" in table and "(dry run on meta)" in table
    record, _ = measure(preset=str(tmp_path), batch=1, prompt=16, new=4, timing=False)
    assert f"{(record['peak_bytes']) / GIB:.3f}" in table


@pytest.mark.parametrize("model_type", ["gpt2", "opt"])
def test_a_model_type_theory_does_not_model_is_measured_without_a_prediction(tmp_path, model_type):
    """GPT-2 and OPT configs have no num_key_value_heads: one KV head per query head, counted by hand here."""
    from transformers import AutoConfig

    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=512)
    extra = dict(ffn_dim=128, word_embed_proj_dim=64, max_position_embeddings=64) if model_type == "opt" else {}
    AutoConfig.for_model(model_type, **sizes, **extra).to_json_file(tmp_path / "config.json")
    record, _ = measure(preset=str(tmp_path), batch=1, prompt=16, new=4, timing=False)
    assert record["kv_final_bytes"] == 2 * 2 * 4 * (64 // 4) * 4 * (16 + 4)  # K and V, layers, heads, head_dim, fp32
    assert record["predicted_overhead_bytes"] is None and record["prediction_error"] is None
    assert record["overhead_bytes"] > record["kv_final_bytes"]


@pytest.mark.parametrize(
    "model_type, cache, why",
    [("minimax", "dynamic", "takes only its own MiniMaxCache"), ("qwen3_next", "tuple", "3 linear_attention of its")],
)
def test_what_kvlab_cannot_run_is_refused_before_allocation(tmp_path, monkeypatch, model_type, cache, why):
    from transformers import AutoConfig

    sizes = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    AutoConfig.for_model(model_type, **sizes, intermediate_size=64).to_json_file(tmp_path / "config.json")
    monkeypatch.setattr(kvlab.lab.point, "build_model", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(ValueError, match=why) as refusal:
        measure(preset=str(tmp_path), cache=cache, prompt=8, new=2)
    assert "\n" not in str(refusal.value)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("24GiB", 24 * GIB),
        ("24 GB", 24 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", 3 * GIB // 2),
        ("1000", 1000),
        ("64 bytes", 64),
    ],
)
def test_memory_sizes(text, expected):
    assert parse_bytes(text) == expected


def test_bad_memory_size():
    with pytest.raises(ValueError, match="GiB, GB, MiB, MB, bytes"):
        parse_bytes("24 XB")


def test_a_hub_id_without_network_or_local_copy(monkeypatch):
    monkeypatch.setattr("kvlab.planner.sources.hub_reachable", lambda: False)
    with pytest.raises(ValueError, match="cannot be downloaded here .*mistral-7b-twin, tinyllama-1.1b"):
        load_config("nobody/no-such-model")


# -- refusing points that cannot fit ---------------------------------------------------------------
def test_a_point_too_big_for_free_memory_is_refused_before_any_model_is_built(monkeypatch, no_model):
    monkeypatch.setattr(kvlab.planner.plan, "free_bytes", lambda device: 2**20)  # 1 MiB free
    with pytest.raises(TooBig) as refused:
        measure(**TINY)
    message = str(refused.value)
    assert message.startswith("predicted peak ") and "exceeds the 1.0 MiB free on cpu" in message
    assert re.search(r"\(weights [0-9.]+ MiB \+ overhead [0-9.]+ MiB\)", message) and "--force" in message


def test_the_command_line_refuses_with_one_line(monkeypatch, no_model, capsys):
    monkeypatch.setattr(kvlab.planner.plan, "free_bytes", lambda device: 2**20)
    with pytest.raises(SystemExit) as exit_info:
        main(["measure", "--override", "num_hidden_layers=1", "--batch", "1", "--prompt", "4", "--new", "2"])
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("kvlab measure: error: predicted peak") and "free on cpu" in line


def test_force_runs_it_anyway(monkeypatch):
    monkeypatch.setattr(kvlab.planner.plan, "free_bytes", lambda device: 2**20)
    record, _ = measure(**TINY, force=True)
    assert record["overhead_bytes"] > 0


def test_a_point_that_fits_runs(monkeypatch):
    monkeypatch.setattr(kvlab.planner.plan, "free_bytes", lambda device: 2**30)
    record, _ = measure(**TINY)
    assert record["overhead_bytes"] > 0


def test_with_a_model_given_only_the_overhead_has_to_fit(toy, monkeypatch):
    point = normalize(**dict(TINY, overrides=""))
    monkeypatch.setattr(kvlab.planner.plan, "free_bytes", lambda device: 2**20)  # less than the toy's 6 MiB of weights
    kvlab.planner.plan.check_fits(point, toy)  # but they are already resident, and the overhead fits
    monkeypatch.setattr(kvlab.planner.plan, "free_bytes", lambda device: 1000)
    with pytest.raises(TooBig, match=r"weights already loaded \+ overhead"):
        kvlab.planner.plan.check_fits(point, toy)


def test_meta_is_never_refused(no_model):
    point = normalize(**dict(TINY, device="meta", overrides="vocab_size=1000000000000"))  # 4 TB of weights
    kvlab.planner.plan.check_fits(point)


def test_predict_json_reports_the_points_own_values(capsys):
    """A greedy point decodes one sequence per prompt: num_beams 1, as its measured record says (not the default 4)."""
    greedy = json.loads(predict_output(capsys, *LLAMA_PR_POINT, "--json", "--device", "meta"))
    assert (greedy["strategy"], greedy["num_beams"]) == ("greedy", 1)
    assert measure(**dict(TINY, device="meta"))[0]["num_beams"] == 1
    beam = json.loads(
        predict_output(capsys, *LLAMA_PR_POINT, "--json", "--device", "meta", "--strategy", "beam", "--num-beams", "3")
    )
    assert (beam["strategy"], beam["num_beams"]) == ("beam", 3)


MISTRAL_V01 = ["--preset", "mistral-7b-v0.1", "--dtype", "bfloat16", "--batch", "1", "--prompt", "300", "--new", "8000"]


def test_a_sliding_cache_plateaus_at_the_window_where_the_4x_loops_grow_it_in_full(capsys, no_model):
    """The issue (checked on 5.24): prompt 300 + 8000 new keeps 4095 tokens per layer (storage 4096), ≈ 512 MiB at
    7B bf16 batch 1 instead of ≈ 1.01 GiB; 4.40.1's SDPA path grew the cache in full."""
    out = predict_output(capsys, *MISTRAL_V01)
    rows = {line.split()[0]: line for line in out.splitlines() if "/v" in line}
    assert "4096 x 32" in rows["dynamic/v5"]
    for design in ("tuple/v4.40", "dynamic/v4.42"):
        assert "8299 x 32" in rows[design]
    result = json.loads(predict_output(capsys, *MISTRAL_V01, "--json"))
    cache = {(d["cache"], d["loop"]): d["terms_bytes"]["cache after the update"] for d in result["designs"]}
    assert cache["dynamic", "v5"] == 512 * 2**20
    assert cache["tuple", "v4.40"] / GIB == pytest.approx(1.01, abs=0.005)


def test_max_batch_is_the_largest_where_a_term_is_shared_by_every_sequence(no_model):
    """--max-batch's first guess divides the room by batch 1's overhead. A mask 5.x builds once for every sequence
    (Mistral's sliding mask at a prompt past its window, live at the prompt's peak) makes the overhead grow slower
    than the batch: the search must still land on the largest batch that fits, checked here batch by batch."""
    point = dict(dtype="bfloat16", prompt=6000, new=2, cache="dynamic", loop="v5")
    config = build_config("mistral-7b-v0.1")
    overhead = lambda batch: theory.predict_overhead(config, batch=batch, **point)  # noqa: E731
    assert overhead(7) < 7 * overhead(1)  # not a multiple of the batch
    result = kvlab.predict("mistral-7b-v0.1", memory="40GiB", max_batch=True, batch=1, **point)
    largest, room = result["designs"][0]["max_batch"], parse_bytes("40GiB") - result["weights_bytes"]
    assert largest > 1 and overhead(largest) <= room < overhead(largest + 1)


def test_max_batch_and_max_new_are_the_largest_that_fit(no_model):
    memory = parse_bytes("14.5GiB")
    point = dict(dtype="bfloat16", batch=1, prompt=300, new=8000, device="cpu")
    p = normalize(preset="mistral-7b-v0.1", **point)
    rows = {}
    for cache, loop in [("dynamic", "v5"), ("tuple", "v4.40")]:
        result = kvlab.predict(
            "mistral-7b-v0.1", cache=cache, loop=loop, memory="14.5GiB", max_batch=True, max_new=True, **point
        )
        rows[cache, loop] = result["designs"][0]
    config, weights = build_config("mistral-7b-v0.1"), result["weights_bytes"]
    fits = lambda cache, loop, **change: (
        weights
        + theory.predict_overhead(  # noqa: E731
            config, **kvlab.planner.plan.point_of(p, cache=cache, loop=loop, **change)
        )
        <= memory
    )
    for (cache, loop), row in rows.items():
        assert row["max_batch"] == 0 or fits(cache, loop, batch=row["max_batch"])
        assert not fits(cache, loop, batch=row["max_batch"] + 1)
    assert rows["dynamic", "v5"]["max_batch"] == 1 and rows["tuple", "v4.40"]["max_batch"] == 0  # at 8000 new
    # The sliding cache plateaus: the model's whole context fits. The full one does not: 2 x KV grows per token.
    assert rows["dynamic", "v5"]["max_new"] == 32768 - 300 and rows["dynamic", "v5"]["max_new_is_context"]
    longest = rows["tuple", "v4.40"]["max_new"]
    assert 1000 < longest < 8000 and fits("tuple", "v4.40", new=longest) and not fits("tuple", "v4.40", new=longest + 1)


def test_a_prompt_past_the_context_leaves_no_new_token(no_model):
    # Llama-2-7B has 4096 positions: a 5000-token prompt leaves none, whatever the memory.
    row = kvlab.predict("llama2-7b", cache="dynamic", loop="v5", memory="1TiB", max_new=True, prompt=5000, new=8)
    assert (row["designs"][0]["max_new"], row["designs"][0]["max_new_is_context"]) == (0, True)


def test_the_inverse_questions_need_a_memory_size(capsys, no_model):
    with pytest.raises(SystemExit) as exit_info:
        main(["predict", *MISTRAL_V01, "--max-batch"])
    assert exit_info.value.code == 2 and "give --memory too" in capsys.readouterr().err


@pytest.mark.parametrize("preset, held", [("gemma-3-4b", "1024 x 29 + 8299 x 5"), ("qwen3-8b", "8299 x 36")])
def test_a_local_config_json_of_todays_layouts(tmp_path, capsys, no_model, preset, held):
    build_config(preset).to_json_file(tmp_path / "config.json")
    out = predict_output(capsys, "--preset", str(tmp_path), *MISTRAL_V01[2:], "--cache", "dynamic", "--loop", "v5")
    assert held in out


def test_a_kv_only_planner_counts_the_weights_and_the_textbook_kv():
    """Lesson 06's comparison: Llama-3-8B's KV by hand, 2 x 32 layers x 8 KV heads x 128 x 2 bytes per token."""
    from kvlab.notebook.figures.will_it_fit import kv_only_plan

    plan = kvlab.planner.plan.predict("llama3-8b", cache="dynamic", loop="v5", batch=8, prompt=4096, new=2048,
                                     dtype="bfloat16", memory="40GiB")  # fmt: skip
    per_token = 2 * 32 * 8 * 128 * 2
    kv_only = kv_only_plan(plan, context=8192)
    assert kv_only["peak_bytes"] == plan["weights_bytes"] + per_token * 8 * (4096 + 2048)
    room = 40 * GIB - plan["weights_bytes"]
    assert kv_only["max_batch"] == room // (per_token * (4096 + 2048))
    assert kv_only["max_new"] == 8192 - 4096  # memory would allow more: the context ends first


@pytest.mark.parametrize("shared", [0, 5_000, 250_000])
def test_largest_batch_is_the_largest_that_fits_with_bytes_shared_by_every_sequence(shared):
    """A term built once for every sequence (5.x's sliding mask) makes the batch-1 quotient a guess: the search
    still lands on the largest batch that fits, checked against every batch in turn."""
    overhead = lambda design: 1_000 * design["batch"] + shared * (design["batch"] > 0)  # noqa: E731
    for room in (999, 1_000 + shared, 37_123 + shared, 10**6):
        fits = [batch for batch in range(0, 2_000) if overhead(dict(batch=batch)) <= room]
        assert largest_batch(overhead, {}, room) == max(fits), room
