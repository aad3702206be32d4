"""Decoders beyond the presets' families, each a tiny config keeping its layout: kvlab's dynamic/v5 measures what
transformers' own generate() of the installed release holds (greedy and beam, within 1 %), or kvlab refuses the
model in one line before allocating; no traceback. predict answers for the families kvlab.theory walks through
and refuses the others in one line (tests/test_predict.py)."""

import pytest
from transformers import AutoConfig

from kvlab.lab.point import run_point
from kvlab.lab.reference import measure_references
from kvlab.loops import generate
from kvlab.models import build_model, random_prompt
from kvlab.schema import DEFAULTS

SIZES = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    intermediate_size=96,
    max_position_embeddings=256,
    pad_token_id=0,
)
RUN = {  # model_type: what its config needs beyond SIZES to be tiny and valid
    "gemma2": {},
    "mixtral": {},
    "qwen2_moe": {},
    "olmo2": {},
    "starcoder2": {},
    "cohere": {},
    "granite": {},
    "stablelm": {},
    "falcon": {},
    "phi3": {},
    "gptj": dict(rotary_dim=8),
    "gpt2": {},
    "opt": dict(ffn_dim=96, word_embed_proj_dim=64),
}
REFUSED = {"qwen3_next": "2 linear_attention", "llama4_text": "2 chunked_attention", "deepseek_v3": "latent"}
POINT = dict(batch=2, prompt=24, new=6)
STRATEGIES = ("greedy", "beam")


def write_config(tmp_path, model_type: str, extra: dict | None = None) -> str:
    folder = tmp_path / model_type
    folder.mkdir()
    AutoConfig.for_model(model_type, **SIZES, **(extra or {})).to_json_file(folder / "config.json")
    return str(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("architectures")
    return {model_type: write_config(tmp_path, model_type, extra) for model_type, extra in RUN.items()}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_kvlab_measures_what_transformers_generate_holds(folders, strategy):
    points = [dict(preset=folder, strategy=strategy, **POINT) for folder in folders.values()]
    real = measure_references("installed", points)  # one process, the installed release's own generate()
    for (model_type, folder), reference in zip(folders.items(), real):
        model = build_model(folder)
        ours = run_point(model, preset=folder, strategy=strategy, timing=False, **POINT)
        assert ours["overhead_bytes"] == pytest.approx(reference["overhead_bytes"], rel=0.01), model_type
        # The same seeded prompt as both runs: the same tokens (beam search: the best beam, every row's first)
        prompt = random_prompt(model.config.vocab_size, POINT["batch"], POINT["prompt"], DEFAULTS["seed"])
        out = generate(model, prompt, POINT["new"], strategy=strategy, num_beams=reference["num_beams"])
        assert out.tokens[:: reference["num_beams"], POINT["prompt"] :].tolist() == reference["tokens"], model_type


@pytest.mark.parametrize("model_type", REFUSED)
def test_what_kvlab_cannot_hold_is_refused_in_one_line(tmp_path, model_type):
    folder = write_config(tmp_path, model_type)
    with pytest.raises(ValueError, match=REFUSED[model_type]) as refusal:
        run_point(preset=folder, timing=False, **POINT)
    assert "\n" not in str(refusal.value)
