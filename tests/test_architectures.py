"""Decoders beyond the presets' families, each a tiny config keeping its layout (chunked, latent, linear and
recurrent, hybrid, KV-sharing, per-layer head sizes): kvlab's dynamic/v5 measures what transformers' own
generate() of the installed release holds and predict says so before allocating (greedy and beam, within 1 %), or
kvlab refuses the model in one line before allocating; no traceback."""

import pytest
import torch
from transformers import AutoConfig

from kvlab.caches import ATTENTION, CACHES
from kvlab.compat import cache_from_outputs
from kvlab.decoding import decoding
from kvlab.lab.point import run_point
from kvlab.loops import LOOPS, generate
from kvlab.models import assert_varied, final_kv_bytes, layer_kinds, random_prompt
from kvlab.planner.plan import predict
from kvlab.planner.sources import build_model, load_config
from kvlab.releases import measure_references
from kvlab.savers import TINY
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
MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16, mamba_n_groups=1)
RUN = {  # model_type: what its config needs beyond SIZES to be tiny, valid and keep its layout
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
    # chunked attention (a window that restarts) beside full attention, MoE
    "llama4_text": dict(
        layer_types=["chunked_attention", "full_attention"],
        attention_chunk_size=16,
        num_local_experts=4,
        intermediate_size_mlp=96,
        head_dim=16,
    ),
    # multi-head latent attention: 5.x caches the latent and the rotary key, one "head" each
    "deepseek_v3": TINY["deepseek_v3"],  # kvlab.savers' tiny MLA config (the same values)
    # linear attention (conv and recurrent state) beside full attention, MoE
    "qwen3_next": dict(
        layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    # linear attention beside latent attention
    "kimi_linear": dict(
        layer_types=["linear_attention", "full_attention"],
        num_key_value_heads=4,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        linear_head_dim=16,
        linear_num_heads=4,
        num_experts=4,
        num_experts_per_token=2,
        moe_intermediate_size=32,
        mlp_layer_types=["dense", "sparse"],
    ),
    "lfm2": dict(layer_types=["conv", "full_attention"]),  # a short convolution's state
    "falcon_h1": dict(  # hybrid: Mamba and attention in every layer
        mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=16, mamba_chunk_size=16, head_dim=16
    ),
    "granitemoehybrid": dict(
        layer_types=["linear_attention", "full_attention"], num_local_experts=4, shared_intermediate_size=32, **MAMBA
    ),
    "jamba": dict(
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        mamba_dt_rank=8,
        use_mamba_kernels=False,
    ),
    # Mamba, attention and an MoE layer that caches nothing
    "nemotron_h": dict(
        layers_block_type=["linear_attention", "full_attention", "moe"],
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_routed_experts=4,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
        use_mamba_kernels=False,
        n_groups=1,
        chunk_size=16,
    ),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], lru_width=64, attention_window_size=16),
    "mamba2": dict(num_heads=4, head_dim=32, state_size=16, n_groups=1, chunk_size=16),  # recurrent state only
    # KV sharing: the last two layers read the first two's keys and values and cache nothing
    "gemma3n_text": dict(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,
        vocab_size_per_layer_input=256,
        hidden_size_per_layer_input=8,
        sliding_window=16,
        head_dim=16,
        activation_sparsity_pattern=[0.0] * 4,
    ),
    # KV sharing and a head size per layer (the full-attention layers' is twice the sliding ones')
    "gemma4_text": dict(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,
        vocab_size_per_layer_input=256,
        hidden_size_per_layer_input=8,
        sliding_window=16,
        head_dim=16,
        per_layer_config={"1": {"head_dim": 32}, "3": {"head_dim": 32}},
    ),
}
REFUSED = {"minimax": "MiniMaxCache"}
POINT = dict(batch=2, prompt=24, new=6)
NEW = dict(max_new_tokens=POINT["new"], min_new_tokens=POINT["new"])
SHORT = dict(max_new_tokens=4, min_new_tokens=4)  # 8 + 4 - 1 tokens cached: below every window (16)
STRATEGIES = ("greedy", "beam")


def write_config(tmp_path, model_type: str, extra: dict | None = None) -> str:
    folder = tmp_path / model_type
    folder.mkdir()
    AutoConfig.for_model(model_type, **{**SIZES, **(extra or {})}).to_json_file(folder / "config.json")
    return str(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("architectures")
    return {model_type: write_config(tmp_path, model_type, extra) for model_type, extra in RUN.items()}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_kvlab_measures_what_transformers_generate_holds(folders, strategy):
    points = [dict(preset=folder, strategy=strategy, **POINT) for folder in folders.values()]
    real = measure_references(
        "installed", points, load_config=load_config
    )  # one process, the installed release's own generate()
    for (model_type, folder), reference in zip(folders.items(), real):
        model = build_model(folder)
        ours = run_point(model, preset=folder, strategy=strategy, timing=False, **POINT)
        assert ours["overhead_bytes"] == pytest.approx(reference["overhead_bytes"], rel=0.01), model_type
        # ...and predict, before anything is allocated (kvlab.theory, or a dry run on meta for the other types)
        (row,) = predict(folder, cache="dynamic", loop="v5", strategy=strategy, device="cpu", **POINT)["designs"]
        assert row["predicted_overhead_bytes"] == pytest.approx(reference["overhead_bytes"], rel=0.01), model_type
        # The same seeded prompt as both runs: the same tokens (beam search: the best beam, every row's first)
        prompt = random_prompt(model.config.vocab_size, POINT["batch"], POINT["prompt"], DEFAULTS["seed"])
        out = generate(model, prompt, POINT["new"], strategy=decoding(strategy, reference["num_beams"]))
        assert out.tokens[:: reference["num_beams"], POINT["prompt"] :].tolist() == reference["tokens"], model_type


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_in_bf16_too_under_the_allocator(folders, strategy):
    """bf16 kernels cast and allocate inside themselves what fp32 ones do not: measure and predict still hold what
    generate() holds under the CPU allocator, or, on a CPU whose bf16 matrix products allocate a oneDNN workspace
    (which predict names), predict holds the counter's tensors and scratch."""
    point = dict(POINT, dtype="bfloat16", strategy=strategy)
    real = measure_references(
        "installed", [dict(preset=folder, **point) for folder in folders.values()], load_config=load_config
    )
    wrong, uncounted = [], None
    for (model_type, folder), reference in zip(folders.items(), real):
        ours = run_point(preset=folder, timing=False, **point)
        if abs(ours["overhead_bytes"] / reference["overhead_bytes"] - 1) > 0.01:
            wrong.append(f"{model_type}: measured {ours['overhead_bytes']}, generate() {reference['overhead_bytes']}")
        prediction = predict(folder, cache="dynamic", loop="v5", device="cpu", **point)
        uncounted = prediction["uncounted"]
        truth = "storages_peak_bytes" if uncounted else "overhead_bytes"
        predicted = prediction["designs"][0]["predicted_overhead_bytes"]
        if abs(predicted / ours[truth] - 1) > 0.01:
            wrong.append(f"{model_type}: predicted {predicted}, {truth} {ours[truth]}")
    assert not wrong, "\n".join(wrong)
    if uncounted:
        pytest.skip(f"predict held against the tensors counted, not the allocator: {uncounted}")


@pytest.mark.parametrize("model_type", REFUSED)
def test_what_kvlab_cannot_hold_is_refused_in_one_line(tmp_path, model_type):
    folder = write_config(tmp_path, model_type)
    with pytest.raises(ValueError, match=REFUSED[model_type]) as refusal:
        run_point(preset=folder, timing=False, **POINT)
    assert "\n" not in str(refusal.value)


FEW = ("deepseek_v3", "qwen3_next", "gemma4_text", "nemotron_h")  # latent, linear, shared and per-layer, MoE-only


@pytest.mark.parametrize("model_type", FEW)
def test_every_design_decodes_what_transformers_generate_does(folders, model_type):
    """kvlab's designs on the attention layers, 5.x's own cache on the others: every design and loop decodes the
    installed generate()'s tokens, and the tuple cache is refused in one line where layers hold other state."""
    model = build_model(folders[model_type])
    prompt = random_prompt(model.config.vocab_size, POINT["batch"], POINT["prompt"], DEFAULTS["seed"])
    with torch.no_grad():
        real = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, **NEW)
    assert_varied(real[:, POINT["prompt"] :])
    for cache in CACHES:
        for loop in LOOPS:
            if cache == "tuple" and any(kind not in ATTENTION for kind, _ in layer_kinds(model.config)):
                with pytest.raises(ValueError, match="hold other state or none") as refusal:
                    generate(model, prompt, POINT["new"], cache=cache, loop=loop)
                assert "\n" not in str(refusal.value)
                continue
            out = generate(model, prompt, POINT["new"], cache=cache, loop=loop)
            assert torch.equal(out.tokens, real), (cache, loop)


@pytest.mark.parametrize("model_type", RUN)
def test_the_final_kv_is_what_transformers_cache_holds(folders, model_type):
    """kvlab.models.final_kv_bytes against the keys and values the installed generate()'s own cache holds after a
    run shorter than every window: latent for MLA, nothing for recurrent, MoE-only and KV-sharing layers, each
    layer's own head size."""
    model = build_model(folders[model_type])
    prompt = random_prompt(model.config.vocab_size, 1, 8, DEFAULTS["seed"])
    with torch.no_grad():
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, return_dict_in_generate=True, **SHORT
        )
    held = sum(
        tensor.nbytes
        for layer in cache_from_outputs(out).layers
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if tensor is not None and tensor.numel()
    )
    assert final_kv_bytes(model.config, 1, 8 + SHORT["max_new_tokens"] - 1, "float32") == held
