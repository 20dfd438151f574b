"""Rotary embedding of q and k fused with the paged KV-cache write: one kernel per layer.

Replaces ``apply_rope(q)``, ``apply_rope(k)`` (two table gathers and about ten elementwise
kernels) and ``write_kv`` (a ``where`` and two ``index_copy_``) of the reference path; for Qwen3,
also the per-head q/k RMSNorm before the rotation (``qk_norm``), so that it needs no kernel of its own.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ..kv_layout import NULL_BLOCK
from .backend import DeviceKernel, device_function, next_power_of_2, require_last_dim_contiguous
from .pdl import pdl_enter


@device_function
def rope_rotate(x, partner, cos, sin, sign):
    """One half of rotate-half RoPE with the reference's roundings: ``x * cos + sign * partner *
    sin``, where each product rounds to ``x``'s dtype, then the sum (the reference's three torch
    ops). ``partner`` is the element ``D/2`` away (``sign`` -1 in the first half, +1 in the second);
    ``cos``, ``sin`` and ``sign`` are float32 and broadcast against ``x``. Returns ``x``'s dtype."""
    dt = x.dtype
    return ((x.to(tl.float32) * cos).to(dt).to(tl.float32)
            + (sign * partner.to(tl.float32) * sin).to(dt).to(tl.float32)).to(dt)


@device_function
def head_rms_norm(x1, x2, w1, w2, eps, HEAD_DIM: tl.constexpr):
    """Qwen3's per-head RMSNorm of heads held as two halves ``x1``, ``x2`` [heads, D/2] (padded
    columns 0), with the weight's halves ``w1``, ``w2`` [1, D/2] (float32), in the numerics of the
    reference's ``llama.rms_norm`` of each head (the normalised head rounds to ``x1``'s dtype, then
    the product with the weight); only the float32 sum of squares adds the two halves separately.
    Returns both halves."""
    dt = x1.dtype
    h1 = x1.to(tl.float32)
    h2 = x2.to(tl.float32)
    mean_square = (tl.sum(h1 * h1, axis=1) + tl.sum(h2 * h2, axis=1)) / HEAD_DIM
    r = tl.rsqrt(mean_square + eps)[:, None]
    return (w1 * (h1 * r).to(dt).to(tl.float32)).to(dt), (w2 * (h2 * r).to(dt).to(tl.float32)).to(dt)


def _rope_and_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_ptr, sin_ptr, slot_mapping_ptr,
    k_cache_ptr, v_cache_ptr, q_out_ptr, k_out_ptr, q_norm_ptr, k_norm_ptr, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cos, stride_sin,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KVH: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, NULL_SLOT: tl.constexpr,
    STORE_K: tl.constexpr, QK_NORM: tl.constexpr, USE_PDL: tl.constexpr,
):
    # The step's metadata (positions, slot mapping) and the tables are written before the forward
    # pass, never by a kernel of it: they load before the PDL wait, overlapping the previous kernel.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    j_mask = j < HALF
    # The tables hold the half-width frequencies twice; both halves are read so that any table
    # gives exactly the reference's x * cos + rotate_half(x) * sin.
    cos1 = tl.load(cos_ptr + pos * stride_cos + j, mask=j_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + pos * stride_cos + HALF + j, mask=j_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + pos * stride_sin + j, mask=j_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + pos * stride_sin + HALF + j, mask=j_mask, other=0.0).to(tl.float32)
    if QK_NORM:  # weights, like the tables, are never written by a kernel
        qw1 = tl.load(q_norm_ptr + j, mask=j_mask, other=0.0).to(tl.float32)[None, :]
        qw2 = tl.load(q_norm_ptr + HALF + j, mask=j_mask, other=0.0).to(tl.float32)[None, :]
        kw1 = tl.load(k_norm_ptr + j, mask=j_mask, other=0.0).to(tl.float32)[None, :]
        kw2 = tl.load(k_norm_ptr + HALF + j, mask=j_mask, other=0.0).to(tl.float32)[None, :]
    pdl_enter(USE_PDL)

    # Each product and the sum round to the activation dtype, as the reference's three torch ops do.
    hq = tl.arange(0, BLOCK_QH)
    q_mask = (hq < NUM_Q_HEADS)[:, None] & j_mask[None, :]
    q_src = q_ptr + t * stride_qt + hq[:, None] * stride_qh + j[None, :]
    x1 = tl.load(q_src, mask=q_mask, other=0.0)
    x2 = tl.load(q_src + HALF, mask=q_mask, other=0.0)
    if QK_NORM:
        x1, x2 = head_rms_norm(x1, x2, qw1, qw2, eps, 2 * HALF)
    q_dst = q_out_ptr + t * stride_qot + hq[:, None] * stride_qoh + j[None, :]
    tl.store(q_dst, rope_rotate(x1, x2, cos1[None, :], sin1[None, :], -1.0).to(q_out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_dst + HALF, rope_rotate(x2, x1, cos2[None, :], sin2[None, :], 1.0).to(q_out_ptr.dtype.element_ty),
             mask=q_mask)

    slot = tl.where(slot < 0, NULL_SLOT, slot)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    hk = tl.arange(0, BLOCK_KVH)
    kv_mask = (hk < NUM_KV_HEADS)[:, None] & j_mask[None, :]
    k_src = k_ptr + t * stride_kt + hk[:, None] * stride_kh + j[None, :]
    x1 = tl.load(k_src, mask=kv_mask, other=0.0)
    x2 = tl.load(k_src + HALF, mask=kv_mask, other=0.0)
    if QK_NORM:
        x1, x2 = head_rms_norm(x1, x2, kw1, kw2, eps, 2 * HALF)
    k1 = rope_rotate(x1, x2, cos1[None, :], sin1[None, :], -1.0)
    k2 = rope_rotate(x2, x1, cos2[None, :], sin2[None, :], 1.0)
    if STORE_K:
        k_dst = k_out_ptr + t * stride_kot + hk[:, None] * stride_koh + j[None, :]
        tl.store(k_dst, k1.to(k_out_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(k_dst + HALF, k2.to(k_out_ptr.dtype.element_ty), mask=kv_mask)
    kc_dst = k_cache_ptr + block * stride_kcb + offset * stride_kct + hk[:, None] * stride_kch + j[None, :]
    tl.store(kc_dst, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(kc_dst + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)

    v_src = v_ptr + t * stride_vt + hk[:, None] * stride_vh + j[None, :]
    v1 = tl.load(v_src, mask=kv_mask, other=0.0)
    v2 = tl.load(v_src + HALF, mask=kv_mask, other=0.0)
    vc_dst = v_cache_ptr + block * stride_vcb + offset * stride_vct + hk[:, None] * stride_vch + j[None, :]
    tl.store(vc_dst, v1.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(vc_dst + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


_KERNEL = DeviceKernel(_rope_and_write_kv_kernel, pdl=True)


def check_rope_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The checks of :func:`rope_and_write_kv`'s arguments (shapes as documented there), shared with
    ``decode_attention.rope_write_and_decode_attention``.

    Raises:
        ValueError: inconsistent shapes, an odd head dimension, or a non-contiguous last dimension.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [T, heads, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    num_tokens, _, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [T={num_tokens}, Hkv, D={head_dim}]")
    if head_dim % 2:
        raise ValueError(f"rotate-half RoPE needs an even head dimension, got D={head_dim}")
    if kv_cache_layer.dim() != 5 or kv_cache_layer.shape[0] != 2 or tuple(kv_cache_layer.shape[3:]) != tuple(k.shape[1:]):
        raise ValueError(f"kv_cache_layer {tuple(kv_cache_layer.shape)} must be [2, num_blocks, block_size, "
                         f"Hkv={k.shape[1]}, D={head_dim}]")
    for name, table in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if table.dim() != 2 or table.shape[1] != head_dim:
            raise ValueError(f"{name} {tuple(table.shape)} must be [max_positions, D={head_dim}]")
    for name, index in (("positions", positions), ("slot_mapping", slot_mapping)):
        if tuple(index.shape) != (num_tokens,):
            raise ValueError(f"{name} has shape {tuple(index.shape)}, expected ({num_tokens},)")
    for name, t in (("q", q), ("k", k), ("v", v), ("cos_cache", cos_cache), ("sin_cache", sin_cache),
                    ("kv_cache_layer", kv_cache_layer)):
        require_last_dim_contiguous(name, t)


def rope_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    return_k: bool = True,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Apply rotate-half RoPE to q and k and write the rotated k and v into the paged KV cache.

    One kernel, one program per token row; graph-safe (no host reads; the grid depends on T
    only). ``q``, ``k`` and ``v`` may be strided views of the fused QKV projection output
    ``[T, (Hq + 2 * Hkv) * D]`` (``qkv.split(...)`` then ``.view(T, heads, D)``): no copy is made.

    Args:
        q: [T, Hq, D]; k, v: [T, Hkv, D]; activation dtype, last dimension contiguous.
        positions: int [T], rows of the RoPE tables (must be below their length; not checked,
            that would read the device).
        cos_cache, sin_cache: [max_positions, D], the half-width table repeated twice (as
            ``LlamaForCausalLM.cos_cache``).
        kv_cache_layer: [2, num_blocks, block_size, Hkv, D], keys at index 0, values at 1.
        slot_mapping: int [T], flat slot ``block * block_size + offset``; a negative slot
            (``PAD_SLOT_ID``) writes to the first slot of ``NULL_BLOCK``, exactly as
            ``attention.write_kv``.
        return_k: also return the rotated keys (the model does not need them: attention reads
            the cache), else ``None`` in their place and one store fewer.
        qk_norm: ``(q_weight [D], k_weight [D], eps)``: Qwen3's per-head RMSNorm of every query
            and key head before the rotation (the reference's ``llama.rms_norm`` of each head, up to the order of
            the float32 sum of squares), one kernel fewer per layer; None: q and k as given.

    Returns:
        ``(q_rot [T, Hq, D], k_rot [T, Hkv, D] or None)``, fresh contiguous tensors in the input
        dtypes. K/V are cast to the cache dtype when written.

    Raises:
        ValueError: inconsistent shapes, an odd head dimension, or a non-contiguous last dimension.
    """
    check_rope_inputs(q, k, v, positions, cos_cache, sin_cache, kv_cache_layer, slot_mapping)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    block_size = kv_cache_layer.shape[2]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape if return_k else (0, 1, 1), dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, (k_out if return_k else None)
    k_cache, v_cache = kv_cache_layer[0], kv_cache_layer[1]
    half = head_dim // 2
    block_qh = next_power_of_2(num_q_heads)
    q_norm, k_norm, eps = check_qk_norm(qk_norm, head_dim) if qk_norm is not None else (q, q, 0.0)
    _KERNEL.on(q.device, tokens=num_tokens)[(num_tokens,)](
        q, k, v, positions, cos_cache, sin_cache, slot_mapping,
        k_cache, v_cache, q_out, k_out, q_norm, k_norm, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_cache.stride(0), sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads,
        BLOCK_QH=block_qh, BLOCK_KVH=next_power_of_2(num_kv_heads),
        HALF=half, BLOCK_HALF=next_power_of_2(half), BLOCK_SIZE=block_size, NULL_SLOT=NULL_BLOCK * block_size,
        STORE_K=return_k, QK_NORM=qk_norm is not None, num_warps=4 if block_qh * half <= 2048 else 8,
    )
    return q_out, (k_out if return_k else None)


def check_qk_norm(qk_norm: tuple, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A ``qk_norm`` argument (``rope_and_write_kv``'s, ``rope_write_and_decode_attention``'s) with its
    weights contiguous and eps a float; ValueError unless both weights are [D]."""
    q_weight, k_weight, eps = qk_norm
    if tuple(q_weight.shape) != (head_dim,) or tuple(k_weight.shape) != (head_dim,):
        raise ValueError(f"qk_norm weights must be [D={head_dim}]; got {tuple(q_weight.shape)}, {tuple(k_weight.shape)}")
    return q_weight.contiguous(), k_weight.contiguous(), float(eps)
