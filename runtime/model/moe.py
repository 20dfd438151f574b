"""The mixture-of-experts layer's compute: top-k routing and the routed experts (Qwen3-MoE).

Two functions the model calls, each dispatching per call on the device (``kernels.available``):

- :func:`route_topk`: router logits -> (routing weights, expert ids) per token;
- :func:`moe_experts`: the weighted sum of each token's chosen experts' SwiGLU MLPs.

On CUDA with Triton both run the fused kernels of ``kernels/moe.py`` (one kernel for the
routing, five for the experts; fixed shapes, counts on device, no host synchronisation, so a CUDA
graph captured for a token count replays for any routing). Elsewhere (CPU, and
``GRAPHSERVING_KERNELS=torch``) they run :func:`route_topk_reference` and
:func:`moe_experts_reference`, pure torch and capturable as well.

Padding: rows whose KV slot is negative (``PAD_SLOT_ID``: the padding of a graph's capture size; the
model passes its ``slot_mapping``) get the sentinel expert id E and weight 0; the sentinel routes to
no expert, so a padding row's output is exactly 0 and no padding row changes another row's output or
reads any expert's weights.

The numerics are transformers' ``Qwen3MoeTopKRouter`` and ``Qwen3MoeExperts``
(``transformers.models.qwen3_moe.modeling_qwen3_moe``); see each function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernels


def route_topk(router_logits: torch.Tensor, top_k: int, normalize: bool,
               slot_mapping: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: ``(topk_weights, topk_ids)`` for router logits [T, E].

    Softmax over the E experts in float32, the k largest probabilities (ids in descending order
    of probability), renormalised to sum 1 when ``normalize`` (Qwen3-MoE's ``norm_topk_prob``):
    transformers' ``Qwen3MoeTopKRouter`` before its final cast to the logits' dtype (the experts
    cast the weight to the activation dtype themselves).

    Args:
        router_logits: [T, E] in the model dtype (float32/bfloat16/float16).
        top_k: experts per token, ``1 <= top_k <= E`` (the config's ``num_experts_per_tok``).
        normalize: renormalise the k weights to sum 1.
        slot_mapping: integer [>= T], the step's KV slots (row t is padding when
            ``slot_mapping[t] < 0``), or ``None`` (every row real). Padding rows get id E (the
            sentinel: routed to no expert) and weight 0. Read on device: no synchronisation.

    Returns:
        ``topk_weights`` float32 [T, k], ``topk_ids`` int32 [T, k]; fresh tensors.

    Raises:
        ValueError: logits not 2-D, ``top_k`` out of range, or ``slot_mapping`` not an integer
            tensor of at least T entries on the logits' device.
    """
    _check_route_inputs(router_logits, top_k, slot_mapping)
    if kernels.available(router_logits.device):
        return kernels.fused_route_topk(router_logits, top_k, normalize, slot_mapping)
    return route_topk_reference(router_logits, top_k, normalize, slot_mapping)


def route_topk_reference(router_logits: torch.Tensor, top_k: int, normalize: bool,
                         slot_mapping: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`route_topk` in pure torch (capturable: no host synchronisation, fixed shapes)."""
    _check_route_inputs(router_logits, top_k, slot_mapping)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ids = ids.to(torch.int32)
    if slot_mapping is not None:
        valid = slot_mapping[: router_logits.shape[0], None] >= 0
        weights = torch.where(valid, weights, 0.0)
        ids = torch.where(valid, ids, router_logits.shape[1])
    return weights, ids


def moe_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e = topk_ids[t, j]``.

    Fused Triton kernels when ``kernels.available(x.device)`` (``kernels.fused_moe``: the sum over
    the k slots in float32, rounded once), else :func:`moe_experts_reference`. An id of E (the
    sentinel) contributes nothing.

    Args:
        x: [T, H], float32/bfloat16/float16.
        w_gate_up: [E, 2I, H] in ``x.dtype``: gate rows 0..I-1, up rows I..2I-1 (Hugging Face's
            ``gate_proj`` and ``up_proj`` stacked; transformers' ``Qwen3MoeExperts.gate_up_proj``).
        w_down: [E, H, I] in ``x.dtype`` (``Qwen3MoeExperts.down_proj``).
        topk_weights: float32 [T, k] (:func:`route_topk`).
        topk_ids: int32 [T, k], values in ``[0, E]``, distinct within a row (E may repeat).

    Returns:
        [T, H] in ``x.dtype``, a fresh tensor.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit together (the message names them).
    """
    check_expert_inputs(x, w_gate_up, w_down, topk_weights, topk_ids)
    if kernels.available(x.device):
        return kernels.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    return moe_experts_reference(x, w_gate_up, w_down, topk_weights, topk_ids)


def moe_experts_reference(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """:func:`moe_experts` in pure torch, dense over the experts; capturable (no host
    synchronisation, no shape that depends on the routing).

    For each expert e in ascending order, every row runs the expert: ``gate, up =
    F.linear(x, w_gate_up[e]).chunk(2)`` (rounded to ``x.dtype``), ``h = F.silu(gate) * up``
    (each rounded), ``y = F.linear(h, w_down[e])`` (rounded), times the row's routing weight for
    e cast to ``x.dtype`` (rounded); rows that did not choose e add exactly 0 (``torch.where``, so
    an inf or NaN of an unchosen expert cannot leak), and the output accumulates in ``x.dtype``,
    rounding after every expert. That is transformers' ``Qwen3MoeExperts`` (its ``index_add_``
    over the hit experts in ascending order) with its router's weights in the model dtype.

    Cost: E expert MLPs over all T rows (the CPU path and tiny models; CUDA takes the kernels).
    Same arguments, result and errors as :func:`moe_experts`.
    """
    check_expert_inputs(x, w_gate_up, w_down, topk_weights, topk_ids)
    weights = topk_weights.to(x.dtype)
    out = torch.zeros_like(x)
    for expert in range(w_gate_up.shape[0]):
        hit = topk_ids == expert  # [T, k]
        chosen = hit.any(dim=-1, keepdim=True)
        weight = torch.where(hit, weights, 0).sum(dim=-1, keepdim=True)  # one term: exact
        gate, up = F.linear(x, w_gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[expert])
        out += torch.where(chosen, y * weight, 0)
    return out


def check_expert_inputs(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """Raise ValueError unless the arguments fit :func:`moe_experts` (the message names them)."""
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"x must be [T, H], w_gate_up [E, 2I, H] and w_down [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w_gate_up.shape)}, {tuple(w_down.shape)}")
    num_tokens, hidden = x.shape
    num_experts, hidden_down, inter = w_down.shape
    if tuple(w_gate_up.shape) != (num_experts, 2 * inter, hidden) or hidden_down != hidden:
        raise ValueError(f"w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} do not fit x "
                         f"{tuple(x.shape)}: expected [E, 2I, H] and [E, H, I] with H={hidden}")
    if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(f"expert weights ({w_gate_up.dtype}, {w_down.dtype}) must have x's dtype {x.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} must both "
                         f"be [T={num_tokens}, k]")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor (int32), got {topk_ids.dtype}")
    for name, t in (("w_gate_up", w_gate_up), ("w_down", w_down), ("topk_weights", topk_weights),
                    ("topk_ids", topk_ids)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, expected {x.device} (x's device)")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride(-1)})")


def _check_route_inputs(router_logits: torch.Tensor, top_k: int, slot_mapping: torch.Tensor | None) -> None:
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, E={num_experts}], got {top_k}")
    if slot_mapping is not None and (
            slot_mapping.dtype.is_floating_point or slot_mapping.dtype == torch.bool or slot_mapping.dim() != 1
            or slot_mapping.shape[0] < num_tokens or slot_mapping.device != router_logits.device):
        raise ValueError(f"slot_mapping must be an integer [>= T={num_tokens}] tensor on {router_logits.device}; "
                         f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)} on {slot_mapping.device}")
