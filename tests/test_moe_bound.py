"""A mixture of experts whose expert loop sizes its tensors by the routing (DBRX's loop; OLMoE and Mixtral with
`experts_implementation="eager"`): which tokens each expert gets depends on the weights and the prompt, so no dry run
knows the peak. predict answers with a bound it names (every expert gets every token in every top-k slot), never below
the peak that transformers' own generate() holds, measured by the CPU allocator on two prompts; and on the same
prompt (`seed` draws it: kvlab.models.random_prompt) kvlab's loop holds what generate() holds, within 1 %.
"""

import json

import pytest
from test_architectures import SIZES
from transformers import AutoConfig

from kvlab.lab.point import run_point
from kvlab.planner.dry_run import ROUTING_BOUND
from kvlab.planner.plan import predict
from kvlab.planner.sources import load_config
from kvlab.releases import measure_references

FFN = 384  # experts wider than the rest of the model, so that the expert loop holds the peak
DBRX = dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=256, pad_token_id=0)
MOES = {
    "dbrx": dict(
        DBRX,
        ffn_config=dict(ffn_hidden_size=FFN, moe_num_experts=4, moe_top_k=2),
        attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
    ),
    "olmoe": dict(SIZES, intermediate_size=FFN, num_experts=4, num_experts_per_tok=2, experts_implementation="eager"),
    "mixtral": dict(
        SIZES, intermediate_size=FFN, num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager"
    ),
}
SEEDS = (0, 1)  # two prompts (and two sets of weights), so two routings


def write_config(folder, model_type: str, values: dict):
    values = dict(values)
    experts = values.pop("experts_implementation", None)
    config = AutoConfig.for_model(model_type, **values).to_dict()
    if experts:  # how the experts run is not written by to_dict; the config class reads it back from the file
        config["experts_implementation"] = experts
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(MOES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_bound_is_named_and_never_below_generate(tmp_path, model_type, dtype):
    preset = write_config(tmp_path, model_type, MOES[model_type])
    point = dict(batch=2, prompt=64, new=6, dtype=dtype)
    prediction = predict(preset, cache="dynamic", loop="v5", device="cpu", **point)
    (row,) = prediction["designs"]
    assert row["bound"] == ROUTING_BOUND and "routing bounded" in str(prediction)
    real = measure_references(
        "installed", [dict(preset=preset, seed=seed, **point) for seed in SEEDS], load_config=load_config
    )
    peaks = []
    for seed, reference in zip(SEEDS, real):
        ours = run_point(preset=preset, seed=seed, timing=False, **point)
        assert ours["overhead_bytes"] == pytest.approx(reference["overhead_bytes"], rel=0.01)
        peaks.append(reference["overhead_bytes"])
    assert row["predicted_overhead_bytes"] >= max(peaks), (row["predicted_overhead_bytes"], peaks)
    assert len(set(peaks)) == 2, "the two prompts should route differently and so peak differently"


def test_a_model_without_routing_is_not_bounded(tmp_path):
    """A dense model's dry run is exact, not a bound (its questions of values are about masks, not experts)."""
    preset = write_config(tmp_path, "olmo", SIZES)
    prediction = predict(preset, cache="dynamic", loop="v5", batch=2, prompt=16, new=3, device="cpu")
    assert "bound" not in prediction["designs"][0] and "routing bounded" not in str(prediction)
