"""A config read without transformers, for the model types kvlab.theory walks: a preset's values or a config.json's,
with the defaults and derived fields transformers' config class would give them, and the weights' bytes in closed
form. Why: importing transformers takes seconds (more than importing torch), and a prediction from a config file
needs nothing of it but these numbers. Anything this module does not know (another model type, a hub id, a key
that could change a size it does not model, an override it does not read) is left to transformers
(`config_for`). tests/test_plain_config.py holds every field and the weights against transformers' own config and a
model built on the meta device.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..configs import DERIVED, check_sizes, parse_overrides
from ..counts import element_size, head_dim
from ..presets import DECODERS
from .sources import load_config

# transformers 5.x's class defaults of the fields the theory and the weights read (its config classes' signatures).
_DENSE = dict(tie_word_embeddings=False, head_dim=None, attention_bias=False, mlp_bias=False)
_QWEN = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=22016,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=32768,
    use_sliding_window=False,
    sliding_window=4096,
    max_window_layers=28,
)
FAMILIES = {
    "llama": dict(
        _DENSE,
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=None,
        max_position_embeddings=2048,
    ),
    "mistral": dict(
        _DENSE,
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        sliding_window=4096,
    ),
    "qwen2": dict(_DENSE, **_QWEN),
    "qwen3": dict(_DENSE, **_QWEN, head_dim=128),
    "gemma3_text": dict(
        _DENSE,
        vocab_size=262208,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        sliding_window=4096,
        sliding_window_pattern=6,
    ),
    "gpt_oss": dict(
        _DENSE,
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=36,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        sliding_window=128,
        attention_bias=True,
        num_local_experts=128,
        num_experts_per_tok=4,
    ),
}
# Keys of a config.json that change no byte a prediction counts (values, names, token ids, the rope's base and
# scaling: its inverse frequencies keep head_dim / 2 entries); a key outside these and the family's is left to
# transformers.
VALUES_ONLY = frozenset(
    """model_type architectures torch_dtype dtype transformers_version use_cache bos_token_id eos_token_id
    pad_token_id rms_norm_eps hidden_act initializer_range rope_theta rope_scaling rope_parameters
    rope_local_base_freq attention_dropout pretraining_tp query_pre_attn_scalar final_logit_softcapping
    attn_logit_softcapping hidden_activation layer_types sliding_window_pattern router_aux_loss_coef
    output_router_logits swiglu_limit experts_per_token num_experts""".split()
)
# Of VALUES_ONLY, the keys that shape the layers: kept.
SHAPES = ("layer_types", "sliding_window_pattern")


class PlainConfig:
    """A decoder's sizes as attributes, as transformers' config class of its `model_type` would hold them (the
    fields kvlab.theory and kvlab.counts read): the family's defaults under the given values, head_dim and the KV
    heads derived where not given, each layer's type spelled out."""

    def __init__(self, model_type: str, values: dict):
        self.__dict__.update({**FAMILIES[model_type], **values, "model_type": model_type})
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and model_type != "qwen2":  # qwen2's class has no head_dim: counts derives it
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.layer_types = values.get("layer_types") or self._layer_types()
        if model_type == "gemma3_text":  # one rotary embedding per layer type (5.x: rope_parameters by layer type)
            self.rope_parameters = {kind: {} for kind in ("sliding_attention", "full_attention")}

    def _layer_types(self) -> list[str]:
        """transformers' rule for each family: Qwen's sliding layers from max_window_layers on (when enabled),
        Gemma-3's every layer but each sliding_window_pattern-th, GPT-OSS's every other one, Mistral's all (a
        window given), Llama's none."""
        layers, kind = range(self.num_hidden_layers), self.model_type
        if kind in ("qwen2", "qwen3"):
            self.sliding_window = self.sliding_window if self.use_sliding_window else None
            sliding = [self.sliding_window is not None and i >= self.max_window_layers for i in layers]
        elif kind == "gemma3_text":
            sliding = [bool((i + 1) % self.sliding_window_pattern) for i in layers]
        elif kind == "gpt_oss":
            sliding = [bool((i + 1) % 2) for i in layers]
        else:
            sliding = [getattr(self, "sliding_window", None) is not None for _ in layers]
        return ["sliding_attention" if s else "full_attention" for s in sliding]


def plain_config(source: str, overrides="") -> PlainConfig | None:
    """The PlainConfig of a preset or a local config.json of a family kvlab.theory walks, overrides applied; None
    for anything else (transformers reads it then)."""
    found = _values(source)
    if found is None:
        return None
    model_type, values = found
    overrides = parse_overrides(overrides)
    if model_type not in FAMILIES or not set(overrides) <= set(FAMILIES[model_type]) | {"layer_types"}:
        return None
    for derived, sources in DERIVED.items():  # re-derived from the new sizes unless overridden too (kvlab.configs)
        if derived not in overrides and any(key in overrides for key in sources):
            values.pop(derived, None)
    values.update(overrides)
    check_sizes(values)
    return PlainConfig(model_type, values)


def _values(source: str) -> tuple[str, dict] | None:
    """(model_type, values) of a preset, or of a config.json whose every key this module reads or can ignore."""
    if source in DECODERS:
        model_type, values = DECODERS[source]
        return model_type, dict(values)
    path = Path(source).expanduser()
    file = path / "config.json" if path.is_dir() else path
    if not (source.endswith(".json") or path.is_dir()) or not file.is_file():
        return None
    try:
        values = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # transformers' reading names what is wrong
    model_type = values.get("model_type") if isinstance(values, dict) else None
    if model_type not in FAMILIES or not set(values) <= set(FAMILIES[model_type]) | VALUES_ONLY:
        return None
    values.pop("model_type")
    return model_type, {key: value for key, value in values.items() if key in FAMILIES[model_type] or key in SHAPES}


def config_for(source: str, overrides=""):
    """A PlainConfig where one answers (kvlab.theory's families, from a preset or a config.json), else transformers'
    config (kvlab.planner.sources.load_config): a prediction imports transformers only for what it needs it for."""
    return plain_config(source, overrides) or load_config(source, overrides)


def weight_bytes(config, dtype: str) -> int:
    """Bytes of the weights and buffers a model of kvlab.theory's families holds (as kvlab.meter.weight_bytes counts
    a model built on meta): the embeddings (shared with the LM head when tied), each layer's attention, MLP or
    experts and norms, the final norm, and the rotary inverse frequencies (fp32, two buffers per rotary embedding)."""
    h, v, e = config.hidden_size, config.vocab_size, element_size(dtype)
    layer = _attention(config) + _mlp(config) + _norms(config)
    elements = v * h * (1 if config.tie_word_embeddings else 2) + config.num_hidden_layers * layer + h
    rotary = 2 * len(getattr(config, "rope_parameters", None) or [None]) if config.model_type == "gemma3_text" else 2
    scale = 1 if config.model_type == "gemma3_text" else 0  # Gemma-3's embed_scale, in the model's dtype
    return (elements + scale) * e + rotary * ((head_dim(config) + 1) // 2) * 4


def _attention(c) -> int:
    """q, k, v and o projections with their biases (Qwen2: q, k and v only), Qwen3's and Gemma-3's q and k norms,
    GPT-OSS's sinks (one per head)."""
    q, kv = c.num_attention_heads * head_dim(c), c.num_key_value_heads * head_dim(c)
    weights = 2 * c.hidden_size * q + 2 * c.hidden_size * kv
    with_bias = getattr(c, "attention_bias", False)  # (Mistral's and Qwen2's config classes have no such field)
    bias = q + 2 * kv + (c.hidden_size if with_bias else 0) if with_bias or c.model_type == "qwen2" else 0
    norms = 2 * head_dim(c) if c.model_type in ("qwen3", "gemma3_text") else 0
    sinks = c.num_attention_heads if c.model_type == "gpt_oss" else 0
    return weights + bias + norms + sinks


def _mlp(c) -> int:
    """The gated MLP (gate, up, down, their biases where mlp_bias), or GPT-OSS's router and experts (each a fused
    gate-up of 2 x intermediate and a down projection, with biases)."""
    h, i = c.hidden_size, c.intermediate_size
    if c.model_type == "gpt_oss":
        experts = c.num_local_experts
        return experts * (h * 2 * i + 2 * i + i * h + h) + experts * (h + 1)
    return 3 * h * i + ((2 * i + h) if getattr(c, "mlp_bias", False) else 0)


def _norms(c) -> int:
    """RMSNorm weights of a layer: two, Gemma-3's four (before and after attention and the MLP)."""
    return (4 if c.model_type == "gemma3_text" else 2) * c.hidden_size
