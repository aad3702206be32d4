"""The preset registry: the lessons' modules register the lessons' presets alone; a catalogue, once imported, adds its
models as their public config.json gives them; a name not registered is refused in one line that says where the
others are. Each check of what is registered runs in a fresh process: the tests' own imports register everything."""

import json
import subprocess
import sys

import pytest

from kvlab.presets import register, twin

LESSONS = ["toy", "llama2-7b", "smollm2-135m", "mistral-7b", "llama2-7b-twin", "mistral-7b-twin"]
# Qwen/Qwen3-8B's config.json on the Hugging Face hub
QWEN3_8B = dict(
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

FRESH = """
import json
import kvlab.caches, kvlab.configs, kvlab.loops, kvlab.meter, kvlab.models, kvlab.releases, kvlab.theory
from kvlab.configs import build_config
from kvlab.presets import PRESETS

def refusal(name):
    try:
        build_config(name)
    except ValueError as error:
        return str(error)

seen = dict(lessons=list(PRESETS), refusal=refusal("qwen3-8b"))
import kvlab.catalogue
import kvlab.encdec
keys = %r
seen.update(
    qwen=(lambda c: {key: getattr(c, key) for key in keys})(build_config("qwen3-8b")),
    t5=build_config("t5-small").d_model,
)
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def fresh():
    """What a process that imports the lessons' modules, then the catalogues, sees."""
    run = subprocess.run([sys.executable, "-c", FRESH % (list(QWEN3_8B),)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def test_the_lessons_modules_register_the_lessons_presets_alone(fresh):
    assert fresh["lessons"] == LESSONS


def test_a_catalogue_name_before_its_catalogue_is_one_line_naming_the_choices_and_the_catalogue(fresh):
    refusal = fresh["refusal"]
    assert "\n" not in refusal
    assert refusal.startswith(f"unknown preset 'qwen3-8b'; choose one of: {', '.join(LESSONS)} (decoders)")
    assert "import kvlab.catalogue" in refusal and "kvlab.encdec" in refusal


def test_the_catalogues_once_imported_give_the_public_configs(fresh):
    assert fresh["qwen"] == QWEN3_8B
    assert fresh["t5"] == 512  # google-t5/t5-small's d_model


def test_registering_the_catalogues_imports_no_transformers():
    """The planner imports both catalogues, and a prediction from a preset never imports transformers."""
    code = "import sys, kvlab.catalogue, kvlab.encdec; print('transformers' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.stdout.strip() == "False", run.stderr[-3000:]


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="^preset 'toy' is registered already$"):
        register("toy", "llama", dict(hidden_size=64))


def test_a_twin_needs_widths_that_divide():
    with pytest.raises(ValueError, match="^toy: vocab_size is not a multiple of 32$"):  # toy's vocabulary is 1000
        twin("toy")
    assert twin("toy", vocab_size=31)[1]["hidden_size"] == 256 // 32
