"""Every bad input of the command line: exit 2, one line on stderr (`kvlab VERB: error: ...`), no traceback.

Each case runs `python -m kvlab ...` in its own process. Importing torch and transformers costs seconds, so
one driver process imports kvlab once and forks a child per case that runs `kvlab.__main__` as
`python -m kvlab` would (its own exit status, stdout and stderr, an uncaught exception's traceback).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

LOCAL = "no such file or folder"


def cases(tmp: Path) -> list[tuple[list[str], str]]:
    """(arguments, a fragment the one line must contain)."""
    return (
        [
            # argparse's own errors, one line as every other
            ([], "kvlab: error: the following arguments are required: command"),
            (["bogus"], "invalid choice: 'bogus'"),
            (["measure", "--batch", "x"], "kvlab measure: error: argument --batch: invalid int value: 'x'"),
            (["predict", "--new"], "argument --new: expected one argument"),
            (["sweep", "--engine"], "kvlab sweep: error: argument --engine: expected one argument"),
            # values
            (["measure", "--cache", "paged"], "tuple, dynamic, list, static, prealloc"),
            (["measure", "--device", "tpu"], "cpu, cuda, meta"),
            (
                ["measure", "--kind", "reference", "--device", "meta"],
                "the meta device cannot; choose one of: cpu, cuda",
            ),
            (["compare", "--preset", "nope", "--out", str(tmp / "never")], "unknown preset 'nope'; choose one of: toy"),
            (["predict", "--memory", "0"], "memory size '0' is not positive"),
            (["predict", "--memory", "0GiB"], "is not positive"),
            (["predict", "--memory", "lots"], "GiB, GB, MiB, MB, bytes"),
            # a preset a verb cannot run names the verb that can
            (
                ["measure", "--preset", "t5-small"],
                "t5-small is an encoder-decoder model: measure, predict, compare and "
                "sweep run decoders; appendix A10 serves them",
            ),
            (["predict", "--preset", "whisper-tiny"], "appendix A10 serves them"),
            (["compare", "--preset", "bart-base", "--out", str(tmp / "never")], "appendix A10 serves them"),
            (["sweep", "--grid", "preset=t5-small", "--dry-run"], "appendix A10 serves them"),
            # local paths, hub ids, configs
            (["measure", "--preset", "./nonexistent/config.json"], f"./nonexistent/config.json: {LOCAL}"),
            (["predict", "--preset", "nonexistent/config.json"], f"nonexistent/config.json: {LOCAL}"),
            (["predict", "--preset", str(tmp / "no" / "such" / "folder")], LOCAL),
            (["predict", "--preset", "nobody/no-such-model"], "not in the local Hugging Face cache"),
            (
                ["measure", "--preset", str(tmp / "rejected" / "config.json")],
                "config.json: transformers refuses this config (Class validation error",
            ),
            (
                ["predict", "--preset", str(tmp / "rejected")],
                "hidden size (64) is not a multiple of the number of attention",
            ),
            (["measure", "--preset", str(tmp / "torn.json")], "torn.json: not a JSON file (Unterminated string"),
            (["measure", "--preset", str(tmp / "empty")], "a folder without a config.json"),
            (
                ["measure", "--preset", str(tmp / "good"), "--override", "tie_word_embeddings=7"],
                "refuses the overrides {'tie_word_embeddings': 7}",
            ),
            (["measure", "--override", "rms_norm_eps=abc"], "refuses the overrides {'rms_norm_eps': 'abc'}"),
            (["measure", "--override", "hidden_act=nope"], "transformers cannot build a llama model from this config"),
            # sizes: integers within bounds that say why, before anything is allocated or walked
            (["predict", "--memory", "1e400"], "memory size '1e400' is more than 1 EiB"),
            (["predict", "--new", "1000000000"], "new must be at most 65,536: kvlab walks every decoding step"),
            (["explain", "--batch", "0"], "batch must be a positive integer, got 0"),
            (["explain", "--batch", "1000000000"], "batch must be at most 16,777,216"),
            (["explain", "--step", "-1"], "--step must be 0 (the prompt's forward) or more"),
            (["sweep", "--grid", "batch=inf", "--dry-run"], "batch must be a positive integer, got inf (float)"),
            (["sweep", "--grid", "batch=1.5", "--dry-run"], "batch must be a positive integer, got 1.5 (float)"),
            (["sweep", str(tmp / "infinite.yaml"), "--dry-run"], "batch must be a positive integer, got inf (float)"),
            (["sweep", "/nonexistent/dir/cpu-default.yaml"], "not found (no such file); give an existing path"),
            (
                ["sweep", "--kernel", "nope", "--grid", "preset=toy", "--out", str(tmp / "never")],
                "unknown Jupyter kernel",
            ),
            # models that generate no text: refused in one line by every verb that builds or plans one
            (["measure", "--preset", str(tmp / "bert")], "is an encoder-only model (bert): it reads text"),
            (["predict", "--preset", str(tmp / "bert")], "is an encoder-only model (bert)"),
            (["explain", "--preset", str(tmp / "bert")], "is an encoder-only model (bert)"),
            (["predict", "--preset", str(tmp / "vit")], "is not a text decoder (vit"),
            # a config transformers' layers cannot read (a routing the meta device cannot follow is bounded instead:
            # tests/test_moe_bound.py)
            (["predict", "--preset", str(tmp / "dbrx-unbuildable")], "transformers cannot build a dbrx model"),
            # waste: its points, then its folder, both before anything runs
            (["waste", "7b-nope"], "unknown waste point '7b-nope'; choose from: 7b-greedy"),
            (["waste", "growth", "7b-greedy"], "growth writes its own table; run it alone"),
            (["waste", "--out", str(tmp / "torn.json")], "is a file; give a folder for the results"),
            (["waste", "--out", str(tmp / "torn.json" / "below")], "below: Not a directory"),
        ]
        + ([(["waste", "--out", str(tmp / "read-only" / "below")], "below: Permission denied")] if os.geteuid() else [])
        + (  # root writes anywhere
            [] if torch.cuda.is_available() else [(["measure", "--device", "cuda"], "no CUDA GPU is available")]
        )
    )


def write_inputs(tmp: Path) -> None:
    from kvlab.configs import build_config

    good = build_config("toy")
    (tmp / "good").mkdir()
    good.to_json_file(tmp / "good" / "config.json")
    rejected = dict(good.to_dict(), num_attention_heads=3, num_key_value_heads=3, hidden_size=64, head_dim=None)
    (tmp / "rejected").mkdir()
    (tmp / "rejected" / "config.json").write_text(json.dumps(rejected))
    (tmp / "torn.json").write_text('{"model_type": "llama", "hidden_si')  # cut half-way
    (tmp / "empty").mkdir()
    from transformers import AutoConfig, BertConfig, ViTConfig

    moe = dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=256, pad_token_id=0)
    moe["ffn_config"] = dict(ffn_hidden_size=96, moe_num_experts=4, moe_top_k=2)
    attention = dict(kv_n_heads=2, clip_qkv=8.0)
    for name, config in (
        ("bert", BertConfig()),
        ("vit", ViTConfig()),
        ("dbrx-unbuildable", AutoConfig.for_model("dbrx", **moe, attn_config=attention)),  # no rope_theta
    ):
        (tmp / name).mkdir()
        config.to_json_file(tmp / name / "config.json")
    (tmp / "infinite.yaml").write_text("grid:\n  batch: [.inf]\n")
    (tmp / "read-only").mkdir(mode=0o555)


# Imports kvlab once, then per case forks a child that runs kvlab/__main__.py with that case's argv, its
# stdout and stderr in files; prints [(exit status, stdout, stderr)] as JSON.
DRIVER = r"""
import json, os, runpy, sys, tempfile, traceback
import kvlab.cli, kvlab.lab.waste_table
results = []
folder = tempfile.mkdtemp()
for index, argv in enumerate(json.loads(sys.argv[1])):
    out, err = (os.path.join(folder, f"{index}.{name}") for name in ("out", "err"))
    pid = os.fork()
    if pid == 0:
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = ["python -m kvlab", *argv]
        try:
            runpy.run_module("kvlab", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit:
            code = exit.code
            if not isinstance(code, int):  # sys.exit("message") prints it and exits 1; sys.exit() exits 0
                if code is not None:
                    print(code, file=sys.stderr)
                code = 0 if code is None else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    results.append((os.waitstatus_to_exitcode(status), open(out).read(), open(err).read()))
print(json.dumps(results))
"""


VERBS = ("measure", "predict", "explain", "compare", "sweep", "waste")


@pytest.fixture(scope="session")
def probed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-input")
    write_inputs(tmp)
    all_cases = cases(tmp)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")  # no network to wait for
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps([args for args, _ in all_cases])],
        env=env,
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return tmp, [(args, fragment, *outcome) for (args, fragment), outcome in zip(all_cases, json.loads(result.stdout))]


def test_every_bad_input_is_one_line_exit_2_no_traceback(probed):
    tmp, outcomes = probed
    wrong = []
    for args, fragment, code, out, err in outcomes:
        lines = err.strip().splitlines()
        prefix = f"kvlab {args[0]}: error: " if args and args[0] in VERBS else "kvlab: error: "
        if not (
            code == 2
            and not out
            and len(lines) == 1
            and lines[0].startswith(prefix)
            and fragment in lines[0]
            and "Traceback" not in err
        ):
            wrong.append(f"{args}: exit {code}, stdout {out[-200:]!r}, stderr {err[-600:]!r}")
    assert not wrong, "\n".join(wrong)
    assert not (tmp / "never").exists() and not (tmp / "results").exists()  # refused before any folder was made
