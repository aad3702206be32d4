"""The preset registry: models by name, each a model type (kvlab.configs finds transformers' config class for it) and
the values copied from the model's public config.json on the Hugging Face hub, with the twins and the random
initialisation that make their tokens vary. Here: the lessons' presets. Catalogues above the lesson register the
others on import (`register`): kvlab.catalogue the other decoders, kvlab.encdec the encoder–decoders; the planner,
the lab and the command line import both. Plain values: a prediction reads them without importing transformers.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable

# Random weights at transformers' default std (initializer_range 0.02) decode one token over and over: in our
# measurement every position's logits share one dominant direction (cosine 0.4-0.5 with their mean on `toy` and
# the Llama-2 twin), so greedy and beam rows repeat 1-3 tokens and "same tokens" proves little. At 0.1 the
# context moves the argmax and rows are varied. Weights' values change no byte count.
RANDOM_INIT_STD = 0.1

DECODERS: dict[str, tuple[str, dict]] = {}
ENCODER_DECODERS: dict[str, tuple[str, dict]] = {}
PRESETS = ChainMap(DECODERS, ENCODER_DECODERS)  # every registered name, both kinds (a view: it follows `register`)
# A preset's own touch to its random weights after they are drawn (kvlab.models.random_model calls it).
AFTER_INIT: dict[str, Callable] = {}
CATALOGUES = "import kvlab.catalogue for more decoders, kvlab.encdec for the encoder-decoders"


def register(name: str, model_type: str, values: dict, encoder_decoder: bool = False, after_init=None) -> None:
    """Add a preset. A decoder draws its random weights at RANDOM_INIT_STD unless its values give an
    initializer_range; `after_init(model)` runs on its model once the weights are drawn."""
    if name in PRESETS:
        raise ValueError(f"preset {name!r} is registered already")
    if not encoder_decoder:
        values = {**values, "initializer_range": values.get("initializer_range", RANDOM_INIT_STD)}
    (ENCODER_DECODERS if encoder_decoder else DECODERS)[name] = (model_type, values)
    if after_init is not None:
        AFTER_INIT[name] = after_init


# Twins: a real model's layers, heads and KV heads, every width divided by TWIN_SCALE (head_dim too where the
# config spells it out; elsewhere it follows hidden_size). The peak's ratios (logits, activations and MLP bytes
# per KV byte) stay the same, and a point at the PR's shape runs on a 2-core CPU in a minute or two instead of
# needing a GPU. Sliding windows and the layer pattern are kept: how far a prompt reaches past the window is
# what a sliding layer's bytes depend on.
TWIN_SCALE = 32
TWIN_WIDTHS = ("hidden_size", "intermediate_size", "vocab_size", "head_dim")


def twin(name: str, **widths) -> tuple[str, dict]:
    """(model type, values) of a registered decoder's twin; `widths`: those given instead of width / TWIN_SCALE
    (a kernel's constraint on a row's bytes)."""
    model_type, values = DECODERS[name]
    scaled = [key for key in TWIN_WIDTHS if key in values and key not in widths]
    for key in scaled:
        if values[key] % TWIN_SCALE:
            raise ValueError(f"{name}: {key} is not a multiple of {TWIN_SCALE}")
    return model_type, {**values, **{key: values[key] // TWIN_SCALE for key in scaled}, **widths}


# Values copied from each model's public config.json on the Hugging Face hub.
register(
    # Small enough that CPU decoding of hundreds of tokens takes seconds.
    "toy",
    "llama",
    dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=1000,
        max_position_embeddings=8192,
    ),
)
register(
    "llama2-7b",
    "llama",
    dict(  # meta-llama/Llama-2-7b-hf
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    ),
)
register(
    "smollm2-135m",
    "llama",
    dict(  # HuggingFaceTB/SmolLM2-135M-Instruct, as its GGUF file says (real weights: kvlab.weights)
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        rms_norm_eps=9.999999747378752e-06,  # 1e-5 as the file's float32
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
)
register(
    "mistral-7b",
    "mistral",
    dict(  # mistralai/Mistral-7B-v0.1, sliding window off (as v0.2+)
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        sliding_window=None,
    ),
)
for _name in ("llama2-7b", "mistral-7b"):
    register(f"{_name}-twin", *twin(_name))
