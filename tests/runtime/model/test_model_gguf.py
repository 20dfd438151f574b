"""GGUF loading of each architecture variant: a tiny random HF model written as GGUF the way
llama.cpp's converter writes it (Q/K rows permuted for the llama architecture, rope scaling keys,
``rope_freqs`` for Llama 3 scaling, the tokenizer metadata) loads to the same logits as the
Hugging Face directory it came from."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphserving.runtime.model.config import ModelConfig, rope_inv_freq
from graphserving.runtime.model.loader import compute_revision, load_model

HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
}
GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}


def _gguf_name(name: str) -> str:
    if name.startswith("gguf:"):
        return name.removeprefix("gguf:")
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, index, *rest = name.split(".")
    module, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{index}.{HF_TO_GGUF[module]}.{kind}"


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py's permute: rotate-half rows -> interleaved pairs, per head.
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


@pytest.fixture(scope="module")
def tokenizer_fields(smollm2_path):
    """SmolLM2's ``tokenizer.*`` GGUF metadata, reused as the tiny models' tokenizer."""
    import gguf

    source = gguf.GGUFReader(str(smollm2_path))
    return {name: f.contents() for name, f in source.fields.items() if name.startswith("tokenizer.")}


def write_gguf(hf_dir, out_path, fields, qtype_name: str = "F32"):
    """Write the HF model in ``hf_dir`` as a GGUF file (tokenizer from ``fields``), 2-D weights as ``qtype_name``."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from safetensors.torch import load_file

    config = ModelConfig.from_hf_config(__import__("json").loads((hf_dir / "config.json").read_text()))
    arch = GGUF_ARCH.get(config.architecture, "llama")
    writer = gguf.GGUFWriter(str(out_path), arch)
    writer.add_name(f"tiny {config.architecture}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_vocab_size(config.vocab_size)
    if config.moe_layers:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if config.rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_scaling["factor"])

    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    writer.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(fields["tokenizer.chat_template"])

    if config.rope_type == "llama3":  # llama.cpp bakes the Llama 3 scaling into a tensor
        plain = ModelConfig.from_hf_config({**config.__dict__, "model_type": "llama", "rope_scaling": None,
                                            "eos_token_id": list(config.eos_token_ids)})
        factors = rope_inv_freq(plain)[0] / rope_inv_freq(config)[0]
        writer.add_tensor("rope_freqs.weight", factors.numpy().astype(np.float32))

    for name, tensor in _stack_experts(load_file(str(hf_dir / "model.safetensors")), config).items():
        array = tensor.numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            array = _llama_cpp_permute(array, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = _llama_cpp_permute(array, config.num_key_value_heads)
        if array.ndim == 2 and qtype_name != "F32":
            qtype = Q[qtype_name]
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _stack_experts(state: dict, config: ModelConfig) -> dict:
    """The checkpoint with each MoE layer's experts stacked the way llama.cpp stores them
    (``blk.{i}.ffn_{gate,up,down}_exps.weight``, [E, rows, cols])."""
    out = {n: t for n, t in state.items() if ".mlp.experts." not in n}
    for i in config.moe_layers:
        for part, gguf_name in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            out[f"gguf:blk.{i}.{gguf_name}.weight"] = torch.stack(
                [state[f"model.layers.{i}.mlp.experts.{e}.{part}.weight"] for e in range(config.num_experts)])
    return out


def _logits(model, paged_runner):
    prompt = [(i * 104729) % model.config.vocab_size for i in range(1, 80)]
    runner = paged_runner(model, block_size=8)
    first = runner.step([("s", prompt)])[0]
    second = runner.step([("s", [int(first.argmax())])])[0]
    return torch.stack([first, second])


@pytest.mark.parametrize("variant", ["mistral", "qwen2_bias", "tied_embeddings", "llama_linear_rope", "llama3_rope",
                                     "qwen3", "qwen3_moe"])
def test_float32_gguf_loads_to_the_same_logits_as_its_hf_directory(variant, tiny_model_dir, tokenizer_fields,
                                                                   tmp_path, paged_runner):
    hf_dir = tiny_model_dir(variant)
    path = write_gguf(hf_dir, tmp_path / f"{variant}.gguf", tokenizer_fields)
    from_gguf = load_model(path, compute_revision(path), torch.float32, "cpu")
    from_hf = load_model(hf_dir, None, torch.float32, "cpu")
    assert from_gguf.config.tie_word_embeddings == from_hf.config.tie_word_embeddings
    assert from_gguf.config.attention_bias == from_hf.config.attention_bias
    assert from_gguf.config.qk_norm == from_hf.config.qk_norm
    assert from_gguf.config.moe_layers == from_hf.config.moe_layers
    assert from_gguf.config.moe_layout == from_hf.config.moe_layout
    for (name, ours), (_, reference) in zip(from_gguf.model.named_parameters(), from_hf.model.named_parameters()):
        assert torch.equal(ours, reference), name
    torch.testing.assert_close(_logits(from_gguf.model, paged_runner), _logits(from_hf.model, paged_runner),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype, tolerance", [("F16", 2e-3), ("Q8_0", 3e-2)])
def test_quantised_gguf_dequantises_close_to_the_float_weights(qtype, tolerance, tiny_model_dir, tokenizer_fields,
                                                               tmp_path, paged_runner, rel_err):
    hf_dir = tiny_model_dir("qwen2_bias")
    path = write_gguf(hf_dir, tmp_path / f"tiny-{qtype}.gguf", tokenizer_fields, qtype)
    quantised = load_model(path, None, torch.float32, "cpu")
    reference = load_model(hf_dir, None, torch.float32, "cpu")
    assert rel_err(_logits(quantised.model, paged_runner), _logits(reference.model, paged_runner)) < tolerance
