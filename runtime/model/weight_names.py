"""The Hugging Face weight names a Llama-family model of a given configuration loads.

Pure functions of :class:`~.config.ModelConfig`: which names a complete checkpoint holds (experts
in the checkpoint's one-by-one layout), and which of them one loaded tensor fills (a stacked
expert tensor fills every expert's). ``LlamaForCausalLM.load_weights`` uses both to report the
weights a checkpoint is missing.
"""

from __future__ import annotations

from .config import ModelConfig

EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")
"""An expert's projections, in the checkpoint's one-by-one names (``mlp.experts.{e}.{part}.weight``)."""

_STACKED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "gate_proj": ("gate_proj",),
                    "up_proj": ("up_proj",), "down_proj": ("down_proj",)}


def names_covered(name: str, num_experts: int) -> list[str]:
    """The :func:`expected_weight_names` entries one loaded weight ``name`` fills: itself, or for a
    stacked expert tensor (``model.layers.{i}.mlp.experts.gate_up_proj``, transformers 5's layout; the
    GGUF loader's ``...experts.gate_proj``) every one of the ``num_experts`` experts' parts."""
    prefix, _, stacked = name.rpartition(".mlp.experts.")
    parts = _STACKED_EXPERTS.get(stacked) if prefix else None
    if parts is None:
        return [name]
    return [f"{prefix}.mlp.experts.{e}.{part}.weight" for e in range(num_experts) for part in parts]


def expected_weight_names(config: ModelConfig) -> list[str]:
    """Every Hugging Face weight name a model of ``config`` needs (experts one by one; biases, q/k
    norms and the LM head only where the configuration has them)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    attention = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight"]
    if config.attention_bias:
        attention += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    if config.o_proj_bias:
        attention.append("self_attn.o_proj.bias")
    if config.qk_norm:
        attention += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    dense = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    moe = ["mlp.gate.weight"] + [f"mlp.experts.{e}.{part}.weight" for e in range(config.num_experts)
                                 for part in EXPERT_PARTS]
    for i in range(config.num_hidden_layers):
        names += [f"model.layers.{i}.{n}" for n in attention + (moe if config.is_moe_layer(i) else dense)]
    return names
