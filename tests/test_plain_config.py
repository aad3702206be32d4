"""kvlab.planner.plain reads a config without transformers: every field the theory reads, the theory's answer and
the weights' bytes are held here against transformers' own config class and a model it builds on the meta device;
and a prediction from a preset really runs without importing transformers."""

import json
import subprocess
import sys

import pytest
import torch

from kvlab.configs import config_class
from kvlab.counts import head_dim, kv_bytes_per_token, sliding_windows
from kvlab.meter import weight_bytes
from kvlab.models import instantiate, parse_dtype
from kvlab.planner import theory
from kvlab.planner.plain import FAMILIES, PlainConfig, plain_config
from kvlab.planner.sources import load_config
from kvlab.presets import DECODERS

PRESETS = [name for name, (model_type, _) in DECODERS.items() if model_type in FAMILIES]
FIELDS = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "tie_word_embeddings",
)


def _same_sizes(plain, config) -> None:
    for field in FIELDS:
        assert getattr(plain, field) == getattr(config, field), field
    assert head_dim(plain) == head_dim(config)
    assert sliding_windows(plain) == sliding_windows(config)
    assert kv_bytes_per_token(plain, 3, "bfloat16") == kv_bytes_per_token(config, 3, "bfloat16")
    for key in ("num_local_experts", "num_experts_per_tok"):
        assert getattr(plain, key, None) == getattr(config, key, None), key


def _meta_weights(config, dtype: str) -> int:
    with torch.device("meta"):
        return weight_bytes(instantiate(config, parse_dtype(dtype)))


def test_every_family_s_defaults_are_transformers():
    """A config.json that names only the model type gets transformers' class defaults (four layers: Gemma-3's and
    GPT-OSS's patterns need a few)."""
    for model_type in FAMILIES:
        _same_sizes(PlainConfig(model_type, {"num_hidden_layers": 8}), config_class(model_type)(num_hidden_layers=8))


@pytest.mark.parametrize("preset", PRESETS)
def test_a_preset_reads_as_transformers_reads_it(preset):
    plain, config = plain_config(preset), load_config(preset)
    _same_sizes(plain, config)
    for dtype in ("float32", "bfloat16"):
        assert theory.breakdown(plain, batch=2, prompt=40, new=6, dtype=dtype) == theory.breakdown(
            config, batch=2, prompt=40, new=6, dtype=dtype
        )
        assert theory.breakdown(plain, batch=1, prompt=300, new=3, dtype=dtype, strategy="beam") == theory.breakdown(
            config, batch=1, prompt=300, new=3, dtype=dtype, strategy="beam"
        )


@pytest.mark.parametrize("preset", [p for p in PRESETS if "twin" in p or p in ("toy", "qwen2.5-0.5b")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_in_closed_form_are_a_meta_model_s(preset, dtype):
    """The closed form against the model transformers builds (tied embeddings, biases, q/k norms, experts and the
    rotary buffers counted by storage)."""
    from kvlab.planner.plain import weight_bytes as closed_form

    config = load_config(preset)
    assert closed_form(plain_config(preset), dtype) == _meta_weights(config, dtype)
    assert closed_form(config, dtype) == _meta_weights(config, dtype)  # transformers' config counted the same way


@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("llama2-7b-twin", "hidden_size=256,num_hidden_layers=3"),  # head_dim re-derived from the new width
        ("gemma-3-4b-twin", "num_hidden_layers=7,sliding_window=16"),  # the pattern over a new layer count
        ("qwen3-8b-twin", "num_key_value_heads=2,intermediate_size=64"),
        ("llama3-8b-twin", "tie_word_embeddings=true,attention_bias=true,mlp_bias=true"),
        ("gpt-oss-20b-twin", "num_local_experts=8,num_experts_per_tok=2"),
    ],
)
def test_overrides_apply_as_transformers_applies_them(preset, overrides):
    plain, config = plain_config(preset, overrides), load_config(preset, overrides)
    _same_sizes(plain, config)
    from kvlab.planner.plain import weight_bytes as closed_form

    assert closed_form(plain, "bfloat16") == _meta_weights(config, "bfloat16")


QWEN_SLIDING = {  # Qwen2.5's published keys, with sliding layers switched on past layer 2 (as its config allows)
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 500,
    "max_position_embeddings": 4096,
    "max_window_layers": 2,
    "use_sliding_window": True,
    "sliding_window": 32,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}


def test_a_config_json_reads_as_transformers_reads_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_SLIDING))
    plain, config = plain_config(str(tmp_path)), load_config(str(tmp_path))
    assert isinstance(plain, PlainConfig) and sliding_windows(plain) == [None, None, 32, 32]
    _same_sizes(plain, config)
    assert theory.breakdown(plain, batch=2, prompt=50, new=4) == theory.breakdown(config, batch=2, prompt=50, new=4)


def test_what_it_does_not_know_is_left_to_transformers(tmp_path):
    unknown = tmp_path / "config.json"
    unknown.write_text(json.dumps({**QWEN_SLIDING, "partial_rotary_factor": 0.5}))  # a key that may change a size
    assert plain_config(str(unknown)) is None
    assert plain_config("llama2-7b-twin", "rope_theta=5") is None  # an override it does not read
    assert plain_config("t5-small") is None  # not a family the theory walks
    assert plain_config("Qwen/Qwen2.5-0.5B") is None  # a hub id
    with pytest.raises(ValueError, match="num_hidden_layers"):
        plain_config("toy", "num_hidden_layers=0")


def test_a_prediction_from_a_preset_never_imports_transformers():
    """What `kvlab predict` imports for a preset of the theory's families, in a fresh process: no transformers."""
    code = (
        "import sys\n"
        "from kvlab.cli import main\n"
        "try:\n"
        "    main(['predict', '--preset', 'llama2-7b', '--batch', '2', '--prompt', '30', '--new', '5', '--json'])\n"
        "finally:\n"
        "    print('transformers' in sys.modules, file=sys.stderr)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["designs"] and run.stderr.strip().splitlines()[-1] == "False"
