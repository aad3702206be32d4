"""The command line: one JSON record per point, and bad input refused before any model is built."""

import json
import re
import subprocess
import sys

import pytest

from kvlab.models import build_model

RECORD_FIELDS = {
    "preset",
    "overrides",
    "cache",
    "loop",
    "strategy",
    "batch",
    "prompt",
    "new",
    "device",
    "dtype",
    "baseline_bytes",
    "peak_bytes",
    "overhead_bytes",
    "reserved_peak_bytes",
    "kv_final_bytes",
    "predicted_overhead_bytes",
    "tokens_per_s",
    "torch_version",
    "transformers_version",
    "kvlab_version",
    "device_name",
    "git_commit",
}


def kvlab(*args):
    return subprocess.run([sys.executable, "-m", "kvlab", *args], capture_output=True, text=True, timeout=300)


def test_measure_prints_one_flat_json_record():
    result = kvlab(
        "measure",
        "--batch",
        "2",
        "--prompt",
        "8",
        "--new",
        "6",
        "--cache",
        "prealloc",
        "--json",
        "--override",
        "num_hidden_layers=2",
    )
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert RECORD_FIELDS <= set(record)
    assert all(not isinstance(value, (dict, list)) for value in record.values())
    assert record["overrides"] == "num_hidden_layers=2"
    # The baseline is the model's weights, counted here element by element; the peak holds at least the cache the run
    # ends with (prealloc's buffer holds every token fed).
    model = build_model("toy", "num_hidden_layers=2")
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    assert record["baseline_bytes"] == weights
    assert record["overhead_bytes"] >= 2 * 2 * 2 * 4 * 64 * 4 * (8 + 6 - 1)
    assert record["kv_final_bytes"] == 2 * 2 * 2 * 4 * 64 * 4 * (8 + 6)  # 2 layers x K,V x batch x heads x dim x fp32


BAD_INPUTS = [
    (["--preset", "gpt5"], "mistral-7b-twin, tinyllama-1.1b"),
    (["--cache", "paged"], "tuple, dynamic, list, static, prealloc"),
    (["--loop", "v4.41"], "v4.40, v4.42, v5"),
    (["--strategy", "topk"], "greedy, sample, beam"),
    (["--batch", "0"], "batch must be a positive integer"),
    (["--new", "-5"], "new must be a positive integer"),
    (["--prompt", "0"], "prompt must be a positive integer"),
    (["--override", "num_layers=2"], "valid keys:"),
    (["--override", "num_hidden_layers"], "key=value"),
    (["--dtype", "int3"], "float32"),
    (["--device", "tpu"], "cpu, cuda, meta"),
    (["--override", "hidden_size=-4"], "hidden_size must be a positive integer, got -4"),
    (["--override", "num_hidden_layers=0"], "num_hidden_layers must be a positive integer"),
    (["--override", "vocab_size=0"], "vocab_size must be a positive integer"),
    (["--override", "num_attention_heads=0"], "num_attention_heads must be a positive integer"),
    (["--override", "num_key_value_heads=3"], "must divide num_attention_heads=4; choose one of: 1, 2, 4"),
    (["--override", "hidden_size=250"], "choose a multiple of 4 or set head_dim"),
    (["--preset", "nobody/no-such-model"], "mistral-7b-twin, tinyllama-1.1b"),  # not cached locally, no network here
]


@pytest.mark.parametrize("args, names", BAD_INPUTS)
def test_bad_input_exits_with_one_line_naming_the_choices_before_any_model_is_built(args, names, monkeypatch, capsys):
    import kvlab.lab.point
    import kvlab.models
    from kvlab.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built for bad input")

    # Where it is defined and where measure calls it (imported here first, so its name is not bound to this stub).
    monkeypatch.setattr(kvlab.models, "build_model", no_model)
    monkeypatch.setattr(kvlab.lab.point, "build_model", no_model)
    with pytest.raises(SystemExit) as exit_info:
        main(["measure", *args])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and names in lines[0], lines


def test_predict_explains_the_peak(capsys):
    from kvlab.cli import main

    main(
        [
            "predict",
            "--preset",
            "llama2-7b",
            "--dtype",
            "bfloat16",
            "--cache",
            "tuple",
            "--loop",
            "v4.40",
            "--batch",
            "8",
            "--prompt",
            "300",
            "--new",
            "500",
            "--device",
            "meta",
            "--json",
        ]
    )
    [explained] = json.loads(capsys.readouterr().out)["designs"]
    assert explained["kv_final_bytes"] == 3.125 * 2**30
    assert 1.99 <= explained["overhead_over_kv"] <= 2.01


def test_help_states_the_defaults_a_point_gets(capsys):
    """`measure --help` says what an unset flag becomes, and normalize gives the point exactly that."""
    from kvlab.cli import main
    from kvlab.planner.params import normalize

    with pytest.raises(SystemExit):
        main(["measure", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    stated = dict(re.findall(r"--([a-z-]+) [A-Z_=]+ [^-]*?\(default: ([^)]+)\)", text))
    assert {"batch": "8", "prompt": "64", "new": "512"}.items() <= stated.items()  # issue 20's real defaults
    point = normalize(device="cpu", timing=False)
    flags = set(stated) - {"device"}  # auto: resolved to this machine's
    assert len(flags) >= 12 and all(str(point[flag.replace("-", "_")]) == stated[flag] for flag in flags), stated


def test_measure_prints_a_short_table_in_mib(capsys):
    from kvlab.cli import main

    point = [
        "measure",
        "--override",
        "num_hidden_layers=1",
        "--batch",
        "2",
        "--prompt",
        "8",
        "--new",
        "4",
        "--device",
        "cpu",
        "--no-timing",
    ]
    main(point)
    table = capsys.readouterr().out
    main([*point, "--json"])
    record = json.loads(capsys.readouterr().out)
    rows = dict(re.findall(r"^ *(\S.*?) {2,}([0-9.]+)$", table, re.M))
    assert "MiB" in [line.strip() for line in table.splitlines()] and "None" not in table and "_bytes" not in table
    for label, field in (
        ("peak", "peak_bytes"),
        ("overhead = peak - weights", "overhead_bytes"),
        ("final KV cache", "kv_final_bytes"),
        ("KV cache, at the peak", "kv_at_peak_bytes"),
    ):
        assert float(rows[label]) == pytest.approx(record[field] / 2**20, abs=5e-4)
    assert len(table.splitlines()) <= 16


def test_every_verb_takes_the_presets_it_runs_and_names_the_lesson_for_the_others():
    from kvlab.planner.params import normalize
    from kvlab.presets import DECODERS, ENCODER_DECODERS

    for preset in DECODERS:  # measure, predict, compare and sweep normalize their points
        assert normalize(preset=preset, device="meta")["preset"] == preset
    for preset in ENCODER_DECODERS:
        with pytest.raises(ValueError, match=f"^{preset} is an encoder-decoder model: .*appendix A10 serves them"):
            normalize(preset=preset, device="meta")


@pytest.mark.parametrize("module, function, what, shipped", [("kvlab.lab.grid", "sweep_file", "sweep", "cpu-default")])
def test_a_file_is_a_path_or_a_shipped_name_with_one_error_wording(tmp_path, module, function, what, shipped):
    import importlib
    from pathlib import Path

    find = getattr(importlib.import_module(module), function)
    mine = tmp_path / "mine.yaml"
    mine.write_text("{}")
    assert find(mine) == mine and find(shipped).name == f"{shipped}.yaml" and find(shipped).exists()
    with pytest.raises(ValueError) as elsewhere:  # a path into a folder is never swapped for the shipped file
        find(Path("somewhere/else") / f"{shipped}.yaml")
    assert str(elsewhere.value) == (
        f"{what} file 'somewhere/else/{shipped}.yaml' not found (no such file); give an existing path"
    )
    with pytest.raises(ValueError) as error:
        find("nowhere")
    assert str(error.value).startswith(f"{what} file 'nowhere' not found; give a path or one of: ")
    assert shipped in str(error.value) and len(str(error.value).splitlines()) == 1


def test_waste_stores_a_point_under_the_folder_given(tmp_path, monkeypatch):
    """`kvlab waste NAME --out DIR`: the point's rows in DIR/waste.csv (a rerun replaces them, the other points'
    rows kept), the run logged in DIR/provenance.json with its command; a toy point stands in for the 7B ones."""
    import pandas as pd

    from kvlab import waste
    from kvlab.cli import main

    toy = dict(preset="toy", overrides={}, prompt=16, new=6, generate={}, fix=["prealloc"])
    monkeypatch.setitem(waste.POINTS, "toy-greedy", toy)
    (tmp_path / "waste.csv").write_text("point,kind,term,bytes\n7b-greedy,check,peak,1\ntoy-greedy,check,peak,1\n")
    main(["waste", "toy-greedy", "--out", str(tmp_path)])
    table = pd.read_csv(tmp_path / "waste.csv", keep_default_na=False)
    assert list(table.loc[table["point"] == "7b-greedy", "bytes"]) == [1]  # another point's rows stay
    rows = table[table["point"] == "toy-greedy"]
    peak = rows.loc[rows["kind"] == "check", "bytes"].item()
    assert peak > 1 and rows.loc[rows["kind"].isin(["baseline", "term"]), "bytes"].sum() == pytest.approx(peak, 1e-3)
    runs = json.loads((tmp_path / "provenance.json").read_text())["runs"]
    assert [run["command"] for run in runs] == [f"python -m kvlab waste toy-greedy --out {tmp_path}"]
