"""ModelConfig from Hugging Face config dicts, and RoPE frequencies against the transformers formulas."""

from __future__ import annotations

import pytest
import torch

from graphserving.runtime.model.config import (
    ConfigError,
    ModelConfig,
    UnsupportedConfigError,
    rope_inv_freq,
)

BASE = {
    "model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "eos_token_id": [2, 7], "bos_token_id": 1,
}


def test_transformers_4_and_5_rope_layouts_give_the_same_config():
    legacy = ModelConfig.from_hf_config({**BASE, "rope_theta": 500000.0, "rope_scaling": {
        "type": "linear", "factor": 2.0}})
    current = ModelConfig.from_hf_config({**BASE, "rope_parameters": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}})
    assert legacy == current
    assert current.rope_theta == 500000.0 and current.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_head_dim_defaults_to_hidden_over_heads_and_eos_list_is_kept():
    config = ModelConfig.from_hf_config(BASE)
    assert config.head_dim == 16 and config.eos_token_ids == (2, 7) and config.rope_scaling is None


def test_qwen2_has_qkv_bias_and_no_output_bias():
    config = ModelConfig.from_hf_config({**BASE, "model_type": "qwen2"})
    assert config.attention_bias and not config.o_proj_bias


MOE = {**BASE, "model_type": "qwen3_moe", "num_hidden_layers": 4, "moe_intermediate_size": 32,
       "num_experts_per_tok": 2, "norm_topk_prob": True}


def test_qwen3_has_qk_norm_and_no_bias():
    config = ModelConfig.from_hf_config({**BASE, "model_type": "qwen3"})
    assert config.qk_norm and not config.attention_bias and config.moe_layout == "none"


@pytest.mark.parametrize("experts_key", ["num_experts", "num_local_experts"])
def test_qwen3_moe_layers_follow_sparse_step_and_mlp_only_layers(experts_key):
    config = ModelConfig.from_hf_config({**MOE, experts_key: 8, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    # (i + 1) % 2 == 0 -> layers 1 and 3; layer 3 is dense by mlp_only_layers
    assert config.moe_layers == (1,)
    assert config.num_experts == 8 and config.num_experts_per_tok == 2 and config.norm_topk_prob
    assert config.moe_layout == "e8-top2-ep1"
    assert config.mlp_activation_width == max(128, 2 * (32 + 64))


def test_qwen3_moe_without_experts_is_dense():
    config = ModelConfig.from_hf_config({**MOE, "num_experts": 0})
    assert config.moe_layers == () and config.moe_layout == "none"


@pytest.mark.parametrize("change, error, message", [
    ({"num_experts": 8, "num_experts_per_tok": 9}, ConfigError, r"num_experts_per_tok \(9\) must be in 1..num_experts \(8\)"),
    ({"num_experts": 8, "shared_expert_intermediate_size": 64}, UnsupportedConfigError, "shared experts"),
    ({"num_experts": 8, "moe_intermediate_size": None}, ConfigError, "moe_intermediate_size"),
])
def test_bad_moe_configs_are_named(change, error, message):
    with pytest.raises(error, match=message):
        ModelConfig.from_hf_config({**MOE, **change})


def test_mistral_sliding_window_caps_the_served_length():
    config = ModelConfig.from_hf_config({**BASE, "model_type": "mistral", "sliding_window": 128})
    assert config.max_model_len == 128


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_type 'longrope'"),
])
def test_unsupported_features_are_named(change, message):
    with pytest.raises(UnsupportedConfigError, match=message):
        ModelConfig.from_hf_config({**BASE, **change})


def test_gqa_heads_must_divide():
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"):
        ModelConfig.from_hf_config({**BASE, "num_key_value_heads": 3})


def test_missing_required_field_is_named():
    config = dict(BASE)
    del config["hidden_size"]
    with pytest.raises(ConfigError, match="'hidden_size'"):
        ModelConfig.from_hf_config(config)


@pytest.mark.parametrize("rope", [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "beta_fast": 16,
     "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5},
], ids=lambda r: r["rope_type"] + ("-mscale" if "mscale" in r else ""))
def test_rope_frequencies_equal_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                     rope_parameters={**rope, "rope_theta": 10000.0})
    ours = ModelConfig.from_hf_config({**hf.to_dict()})
    inv_freq, scaling = rope_inv_freq(ours)
    if rope["rope_type"] == "default":
        expected = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, dtype=torch.int64).float() / 32))
        expected_scaling = 1.0
    else:
        # dynamic equals default up to max_position_embeddings, the only range we serve.
        expected, expected_scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu", seq_len=None)
    assert torch.equal(inv_freq, expected)
    assert scaling == pytest.approx(expected_scaling)


def test_llama_cpp_freq_factors_reproduce_llama3_frequencies():
    llama3 = ModelConfig.from_hf_config({**BASE, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}})
    plain = ModelConfig.from_hf_config(BASE)
    base, _ = rope_inv_freq(plain)
    target, _ = rope_inv_freq(llama3)
    factors = base / target  # what llama.cpp stores as rope_freqs.weight
    freq_config = ModelConfig.from_hf_config({**BASE, "rope_scaling": {"rope_type": "freq_factors"}})
    got, _ = rope_inv_freq(freq_config, factors)
    torch.testing.assert_close(got, target, rtol=1e-6, atol=0)
