"""The mixture-of-experts layer's direct decode path (``moe.fused_moe`` at ``moe.DIRECT_MAX_PAIRS``
(token, slot) pairs or fewer): two kernels instead of the alignment, the grouped GEMMs and the slot
sum, streaming each chosen expert's weights as matrix-vector products.

- ``_gate_up_direct_kernel``, grid (T*k, I / BLOCK_N): each program a matrix-vector product of its
  pair's expert's gate and up rows with the token's row, SwiGLU in the epilogue (a sentinel pair's
  program exits at once);
- ``_down_direct_kernel``, grid (T, H / BLOCK_N): each program the token's k down projections in
  slot order, weighted and summed in float32 like the M-block path's down kernel and slot sum.

Numerics as ``moe.py``'s module docstring says for every path. Tiles: ``moe.DIRECT_GATE_UP_TILE``,
``moe.DIRECT_DOWN_TILE``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton.language as tl

from .backend import DeviceKernel, next_power_of_2
from .pdl import pdl_enter

if TYPE_CHECKING:
    from .moe import MoEConfig


def _gate_up_direct_kernel(
    x_ptr, w_ptr, ids_ptr, act_ptr, stride_xt, stride_we, stride_wn, stride_ap,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Program (pair, N tile): the pair's expert's gate and up rows against the token's row.
    pdl_enter(USE_PDL)
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair)
    if (expert < 0) | (expert >= NUM_EXPERTS):  # the sentinel: the pair's act row is never read
        return
    token = pair // TOP_K
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < INTER
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    gate_rows = w_expert + n.to(tl.int64)[:, None] * stride_wn
    up_rows = w_expert + (n + INTER).to(tl.int64)[:, None] * stride_wn
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        k_mask = cols < HIDDEN
        x = tl.load(x_ptr + token * stride_xt + cols, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        w_mask = n_mask[:, None] & k_mask[None, :]
        acc_gate += tl.load(gate_rows + cols[None, :], mask=w_mask, other=0.0).to(tl.float32) * x
        acc_up += tl.load(up_rows + cols[None, :], mask=w_mask, other=0.0).to(tl.float32) * x
    act_dtype = act_ptr.dtype.element_ty
    gate = tl.sum(acc_gate, axis=1).to(act_dtype).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(act_dtype)
    act = activated.to(tl.float32) * tl.sum(acc_up, axis=1).to(act_dtype).to(tl.float32)
    tl.store(act_ptr + pair * stride_ap + n, act.to(act_dtype), mask=n_mask)


def _down_direct_kernel(
    act_ptr, w_ptr, weights_ptr, ids_ptr, out_ptr, stride_ap, stride_we, stride_wn, stride_ot,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Program (token, N tile): the token's k slots at once, a [slots, N, K] tile of weights per
    # round of loads (one round when BLOCK_K >= INTER), so the k experts' rows stream together
    # instead of one slot's after another's. Each projection is rounded and weighted as the
    # M-block path's down kernel does, then summed over the slots in slot order in float32 and
    # rounded once.
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < HIDDEN
    out_dtype = out_ptr.dtype.element_ty
    slots = tl.arange(0, BLOCK_S)
    slot_ids = tl.load(ids_ptr + token * TOP_K + slots, mask=slots < TOP_K, other=-1)
    slot_weights = tl.load(weights_ptr + token * TOP_K + slots, mask=slots < TOP_K, other=0.0)
    routed = (slot_ids >= 0) & (slot_ids < NUM_EXPERTS)  # a sentinel slot loads nothing and adds 0
    width = tl.where(routed, INTER, 0)[:, None, None]
    experts = tl.where(routed, slot_ids, 0).to(tl.int64)
    w_rows = w_ptr + experts[:, None, None] * stride_we + n.to(tl.int64)[None, :, None] * stride_wn
    a_rows = act_ptr + (token * TOP_K + slots)[:, None, None] * stride_ap
    acc = tl.zeros([BLOCK_S, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.static_range(0, INTER, BLOCK_K):  # unrolled: no K tile's loads wait for the tile before
        cols = (k0 + tl.arange(0, BLOCK_K))[None, None, :]
        k_mask = cols < width
        a = tl.load(a_rows + cols, mask=k_mask, other=0.0).to(tl.float32)
        acc += tl.load(w_rows + cols, mask=n_mask[None, :, None] & k_mask, other=0.0).to(tl.float32) * a
    weight = tl.where(routed, slot_weights, 0.0).to(out_dtype).to(tl.float32)
    y = (tl.sum(acc, axis=2).to(out_dtype).to(tl.float32) * weight[:, None]).to(out_dtype).to(tl.float32)
    out = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        out += tl.sum(tl.where(slots[:, None] == j, y, 0.0), axis=0)
    tl.store(out_ptr + token * stride_ot + n, out.to(out_dtype), mask=n_mask)


_GATE_UP_DIRECT = DeviceKernel(_gate_up_direct_kernel, pdl=True)
_DOWN_DIRECT = DeviceKernel(_down_direct_kernel, pdl=True)


def fused_moe_direct(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, cfg: MoEConfig, out: torch.Tensor) -> torch.Tensor:
    """``moe.fused_moe``'s direct decode path (``moe.DIRECT_MAX_PAIRS``): two kernels, no alignment,
    no slot sum. Arguments as ``fused_moe``'s (checked there), ``cfg`` its config (``direct``),
    ``out`` [T, H] in ``x.dtype``, which it returns."""
    num_tokens, hidden = x.shape
    num_experts, _, inter = w_down.shape
    top_k = topk_ids.shape[1]
    act = torch.empty((num_tokens * top_k, inter), dtype=x.dtype, device=x.device)
    _GATE_UP_DIRECT.on(x.device, tokens=num_tokens)[(num_tokens * top_k, -(-inter // cfg.gate_up_block_n))](
        x, w_gate_up, topk_ids, act, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0),
        HIDDEN=hidden, INTER=inter, TOP_K=top_k, NUM_EXPERTS=num_experts,
        BLOCK_N=cfg.gate_up_block_n, BLOCK_K=cfg.gate_up_block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    _DOWN_DIRECT.on(x.device, tokens=num_tokens)[(num_tokens, -(-hidden // cfg.down_block_n))](
        act, w_down, topk_weights, topk_ids, out, act.stride(0), w_down.stride(0), w_down.stride(1), out.stride(0),
        HIDDEN=hidden, INTER=inter, TOP_K=top_k, NUM_EXPERTS=num_experts,
        BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.down_block_k, BLOCK_S=next_power_of_2(top_k),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
