"""One registry: decoders and encoder-decoders built by one build_model; local paths told apart from hub ids."""

import pytest
import torch
from transformers import (
    BartForConditionalGeneration,
    LlamaForCausalLM,
    T5ForConditionalGeneration,
    WhisperForConditionalGeneration,
)

from kvlab.configs import build_config
from kvlab.encdec.presets import vary_decoder
from kvlab.models import build_model
from kvlab.planner.sources import is_hub_id, load_config
from kvlab.presets import ENCODER_DECODERS

SMALL = {
    "t5-small": (
        "num_layers=1,num_decoder_layers=1,d_model=32,d_ff=64,num_heads=2,d_kv=16,vocab_size=100",
        T5ForConditionalGeneration,
    ),
    "whisper-tiny": (
        "d_model=32,encoder_layers=1,decoder_layers=1,encoder_attention_heads=2,decoder_attention_heads=2,"
        "encoder_ffn_dim=64,decoder_ffn_dim=64,vocab_size=100,max_source_positions=16,num_mel_bins=8",
        WhisperForConditionalGeneration,
    ),
    "bart-base": (
        "d_model=32,encoder_layers=1,decoder_layers=1,encoder_attention_heads=2,decoder_attention_heads=2,"
        "encoder_ffn_dim=64,decoder_ffn_dim=64,vocab_size=100",
        BartForConditionalGeneration,
    ),
    "toy": ("num_hidden_layers=1", LlamaForCausalLM),
}


@pytest.mark.parametrize("preset", list(SMALL))
def test_build_model_builds_each_preset_with_its_own_class(preset):
    """The Auto class chosen for the config builds the checkpoint's own class, with the weights that class gives."""
    overrides, model_class = SMALL[preset]
    model = build_model(preset, overrides)
    assert type(model) is model_class and not model.training
    config = build_config(preset, overrides)
    torch.manual_seed(0)
    direct = model_class(config)
    if preset in ENCODER_DECODERS:
        vary_decoder(direct)  # the presets' documented post-init scaling (kvlab.encdec.presets)
    assert model.state_dict().keys() == direct.state_dict().keys()
    assert all(torch.equal(tensor, direct.state_dict()[name]) for name, tensor in model.state_dict().items())
    assert model.generation_config.eos_token_id is None  # decoding never stops early


def test_a_local_path_is_never_taken_for_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("Qwen/Qwen2.5-0.5B") and is_hub_id("owner/name")
    assert not any(is_hub_id(path) for path in ("./owner/name", "owner/config.json", "/abs/path", "a/b/c", "toy"))
    (tmp_path / "owner" / "name").mkdir(parents=True)  # now a folder of that name exists here: it is the one meant
    build_config("toy", "num_hidden_layers=3").to_json_file(tmp_path / "owner" / "name" / "config.json")
    assert not is_hub_id("owner/name") and load_config("owner/name").num_hidden_layers == 3
    for missing in ("./nonexistent/config.json", "nonexistent/config.json", "owner/other/config.json"):
        with pytest.raises(ValueError, match=f"^{missing}: no such file or folder; choose one of: toy, "):
            load_config(missing)
