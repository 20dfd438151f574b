"""Paged decode attention: one query token per request over its cached keys and values.

Flash-decoding (Dao et al., "Flash-Decoding for long-context inference", 2023): the context of
each request is split into ``num_splits`` contiguous ranges; one program per (request, KV head,
split) walks its range through the block table with an online softmax in float32 and writes a
partial result and its log-sum-exp; a second kernel combines the partials of each (request,
query head). When the split count is 1 (enough rows to fill the device without splitting) the
first kernel writes the normalised output itself and the combine is skipped: one kernel. With
``defer_combine`` the partials come back uncombined (:class:`DecodePartials`) for the next kernel
to merge (the O projection at batch 1: ``o_proj.py``).

Compiled variants: the split count is a runtime argument, so one variant of each kernel serves
every split count above 1 and every batch size, plus the single-split variant (a constexpr) of
the first kernel. Which one a call takes depends only on shapes (or the ``num_splits``
override), and a graph capture is always preceded by eager warmup calls of the same shapes, so
each variant is compiled by the warmup and nothing compiles during a capture.

Cost is proportional to each row's ``seq_len``, never to the block-table width W: programs stop
at ``seq_len`` and read only the block-table entries below it. The number of splits depends
only on shapes (batch rows, KV heads, W * block_size and the device's SM count), so a graph
captured for a batch size replays for any contents.

GQA: the program for KV head ``h`` serves query heads ``h * G .. h * G + G - 1`` (the Hugging
Face ``repeat_kv`` order), so every K/V tile is loaded once per group; the group is padded to 16
rows for ``tl.dot``.

:func:`rope_write_and_decode_attention` folds ``rope.rope_and_write_kv`` into the first kernel
(one graph node fewer per layer): each program rotates its query heads itself (after Qwen3's
per-head q/k RMSNorm, given ``qk_norm``), and the program whose range holds the row's newest
position rotates that token's key and writes it and its value into the cache before reading its
range (a CTA barrier orders the write before the reads; no other program reads that slot).
Whether the model takes it is :func:`use_fused_rope_decode`.

Prefetch (a uniform-decode batch, ``prefetch=True``, :data:`PREFETCH_FIRST_TILE`): every key and
value a decode row reads but its newest was written by an earlier forward pass, and its metadata
before this one, so each program loads its range and the first context tile before the PDL wait
(runtime/model/kernels/pdl.py), overlapping the kernels before it; after the wait it puts the newest
key and value into that tile (from registers when it wrote them itself, else one row from the
cache). The same values in the same order: the results are those without the prefetch, bit for bit.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton.language as tl

from ..kv_layout import NULL_BLOCK
from .backend import (DeviceKernel, device_function, env_count, next_power_of_2, num_programs_target,
                      require_last_dim_contiguous)
from .decode_loop import attend_range, load_kv, online_softmax_step, tile_blocks
from .decode_splits import MAX_SPLITS, choose_num_splits
from .pdl import pdl_enter
from .rope import check_qk_norm, check_rope_inputs, rope_rotate

SMALL_HEAD_DIM = 64
"""Head dimensions up to this take the prefetch (:data:`PREFETCH_FIRST_TILE`) by default: measured
faster for head dimension 64 (SmolLM2-135M, Llama-3.2-1B) at batch 1, 8 and 64, slower for 128
(Llama-3-8B at batch 1 and 64), where the prefetched tile doubles (bench/RESULTS.md, "Decode
attention: the first tile before the PDL wait")."""

FUSED_ROPE_MAX_HEAD_DIM = 128
"""Head dimensions up to this take the fused RoPE-write-attend kernel by default: measured faster
for 64 (the section above) and, without the prefetch, for 128 (Llama-3-8B and Qwen3-30B-A3B at
batch 1, 8 and 64, Qwen3-8B at batch 1; bench/RESULTS.md, "RoPE and Qwen3's q/k norm inside the
decode attention for heads of 128")."""

FUSE_ROPE_ENV = "GRAPHSERVING_FUSE_ROPE_DECODE"
FUSE_ROPE_DECODE = os.environ.get(FUSE_ROPE_ENV, "auto")
"""``GRAPHSERVING_FUSE_ROPE_DECODE`` as read at import (so warmup, capture and replay agree): ``auto``
(the default) decides by shape, ``1`` always fuses, ``0`` never (:func:`use_fused_rope_decode`)."""


def use_fused_rope_decode(head_dim: int) -> bool:
    """Whether the model runs uniform-decode attention as :func:`rope_write_and_decode_attention`
    (RoPE, Qwen3's q/k norm and the KV write folded in, one kernel fewer per layer) instead of
    ``rope_and_write_kv`` then :func:`paged_decode_attention`: with :data:`FUSE_ROPE_DECODE`
    ``auto``, for head dimensions up to :data:`FUSED_ROPE_MAX_HEAD_DIM`.

    Raises:
        ValueError: ``GRAPHSERVING_FUSE_ROPE_DECODE`` is set to anything but ``auto``, ``1`` or ``0``.
    """
    if FUSE_ROPE_DECODE not in ("auto", "1", "0"):
        raise ValueError(f"{FUSE_ROPE_ENV}={FUSE_ROPE_DECODE!r}: expected auto, 1 or 0")
    return FUSE_ROPE_DECODE == "1" or (FUSE_ROPE_DECODE == "auto" and head_dim <= FUSED_ROPE_MAX_HEAD_DIM)


PREFETCH_FIRST_TILE = os.environ.get("GRAPHSERVING_DECODE_PREFETCH", "1") != "0"
"""Default policy: whether a uniform-decode batch's attention (``prefetch=True``) of head dimension
up to :data:`SMALL_HEAD_DIM` loads its metadata and its first context tile before the PDL wait.
``GRAPHSERVING_DECODE_PREFETCH=0`` turns it off (for an A/B measurement). Read once at import, so
warmup, capture and replay agree."""

BLOCK_N = 64
"""Context tokens per inner-loop tile on CUDA (4 blocks of 16): one K and one V tile of
64 x D per iteration."""

def _stages_from_env() -> int:
    """``GRAPHSERVING_DECODE_STAGES`` (default 2). Raises ValueError unless a whole number 1-8."""
    return env_count("GRAPHSERVING_DECODE_STAGES", "a whole number of pipeline stages, 1 to 8", highest=8) or 2


DECODE_LAUNCH = {"num_warps": 4, "num_stages": _stages_from_env(),
                 "PIPELINE": os.environ.get("GRAPHSERVING_DECODE_PIPELINE", "0") == "1"}
"""The decode kernel's launch meta-parameters on CUDA (read per call; ``bench/kernel_bench.py
--attention-grid`` sweeps them): warps, software-pipelining stages (``GRAPHSERVING_DECODE_STAGES``)
and ``PIPELINE``, the context loop's explicit prefetch of the next tile (``attend_range``;
``GRAPHSERVING_DECODE_PIPELINE=1`` at import turns it on, for A/B measurements). Compiled offline
for sm_90 (bench/RESULTS.md), the plain loop waits for every copy at the top of each tile at any
stage count; loading the block-table entries a tile ahead keeps the copies in flight but measured
slower at batch 64 (removed)."""


@device_function
def split_range(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Context tokens per split (whole ``BLOCK_N`` tiles) and how many splits hold keys: the first
    ``cdiv(seq_len, per_split)`` (0 for ``seq_len == 0``)."""
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    return per_split, tl.cdiv(seq_len, tl.maximum(per_split, 1))


@device_function
def _row_metadata(seq_lens_ptr, positions_ptr, cos_ptr, sin_ptr, slot_mapping_ptr, n, split, num_splits, d, d_mask,
                  stride_cos, stride_sin, BLOCK_N: tl.constexpr, ROPE: tl.constexpr):
    """Row ``n``'s keys, this split's context range ``[start, end)`` and, with ``ROPE``, its new
    token's cos/sin (float32 [BLOCK_D]) and slot: ``(seq_len, start, end, cos, sin, slot)``."""
    seq_len = tl.load(seq_lens_ptr + n).to(tl.int32)
    per_split, _ = split_range(seq_len, num_splits, BLOCK_N)
    start = split * per_split
    end = tl.minimum(seq_len, start + per_split)
    if ROPE:
        pos = tl.load(positions_ptr + n).to(tl.int64)
        cos = tl.load(cos_ptr + pos * stride_cos + d, mask=d_mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + pos * stride_sin + d, mask=d_mask, other=0.0).to(tl.float32)
        slot = tl.load(slot_mapping_ptr + n).to(tl.int64)
    else:
        cos = tl.zeros(d.shape, tl.float32)
        sin = cos
        slot = n * 0
    return seq_len, start, end, cos, sin, slot


@device_function
def _head_norm_pair(x, partner_x, w_ptr, d, partner, d_mask, eps, HEAD_DIM: tl.constexpr):
    """Qwen3's per-head RMSNorm (``rope.head_rms_norm``'s roundings) of heads ``x`` [heads, BLOCK_D]
    and of their RoPE partners ``partner_x`` (the same heads' elements ``D/2`` away), with the
    weight [D] at ``w_ptr`` (``d``, ``partner``, ``d_mask`` [1, BLOCK_D]); the float32 sum of
    squares is over the whole head (padded columns 0), not its two halves apart. Returns both."""
    dt = x.dtype
    h = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(h * h, axis=1) / HEAD_DIM + eps)[:, None]
    w = tl.load(w_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    w_partner = tl.load(w_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)
    return ((w * (h * r).to(dt).to(tl.float32)).to(dt),
            (w_partner * (partner_x.to(tl.float32) * r).to(dt).to(tl.float32)).to(dt))


@device_function
def _rotate_and_write_newest(q, q_row_ptr, heads, g_mask, d, d_mask, cos, sin, slot, seq_len, start, end,
                             k_new_ptr, v_new_ptr, k_head_ptr, v_head_ptr, q_norm_ptr, k_norm_ptr, eps, stride_qh,
                             stride_kb, stride_kt, stride_vb, stride_vt,
                             HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, NULL_SLOT: tl.constexpr,
                             QK_NORM: tl.constexpr):
    """Rotate-half RoPE of the program's queries ``q`` [BLOCK_G, BLOCK_D] with the roundings of
    ``rope_and_write_kv`` (rotate_half(x)[d] is -x[d + D/2] in the first half and x[d - D/2] in the
    second), after Qwen3's per-head q/k RMSNorm with ``QK_NORM``; the program whose range
    ``[start, end)`` holds the row's newest position also normalises and rotates that token's key
    and writes it and its value at ``slot`` (a negative slot: the null block). Returns
    ``(q, k_rot, v_new)``, the last two [BLOCK_D] in the activation dtype (in the other programs
    zero, or with the q/k norm undefined, and never read there). A CTA barrier ends it: the write
    is visible to the program's threads."""
    partner = (d + HEAD_DIM // 2) % HEAD_DIM
    sign = tl.where(d < HEAD_DIM // 2, -1.0, 1.0)
    q_partner = tl.load(q_row_ptr + heads[:, None] * stride_qh + partner[None, :],
                        mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if QK_NORM:
        q, q_partner = _head_norm_pair(q, q_partner, q_norm_ptr, d[None, :], partner[None, :], d_mask[None, :], eps,
                                       HEAD_DIM)
    q = rope_rotate(q, q_partner, cos[None, :], sin[None, :], sign[None, :])
    newest = seq_len - 1
    owner = (seq_len > 0) & (start <= newest) & (newest < end)
    owned = tl.where(owner, d_mask, False)  # (a vector mask: the interpreter takes no scalar in one)
    k_new = tl.load(k_new_ptr + d, mask=owned, other=0.0)
    k_partner = tl.load(k_new_ptr + partner, mask=owned, other=0.0)
    if QK_NORM:
        k_new, k_partner = _head_norm_pair(k_new[None, :], k_partner[None, :], k_norm_ptr, d[None, :], partner[None, :],
                                           d_mask[None, :], eps, HEAD_DIM)
        k_new, k_partner = tl.reshape(k_new, d.shape), tl.reshape(k_partner, d.shape)
    k_rot = rope_rotate(k_new, k_partner, cos, sin, sign)
    v_new = tl.load(v_new_ptr + d, mask=owned, other=0.0)
    if owner:
        slot = tl.where(slot < 0, NULL_SLOT, slot)
        tl.store(k_head_ptr + (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt + d,
                 k_rot.to(k_head_ptr.dtype.element_ty), mask=d_mask)
        tl.store(v_head_ptr + (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vt + d,
                 v_new.to(v_head_ptr.dtype.element_ty), mask=d_mask)
    tl.debug_barrier()
    return q, k_rot, v_new


@device_function
def _store_output(acc, m_i, l_i, out_row_ptr, part_out_ptr, part_lse_ptr, part, heads, g_mask, d, d_mask, stride_oh,
                  HEAD_DIM: tl.constexpr, DIRECT: tl.constexpr):
    """The program's result: normalised into the output row (``DIRECT``: one split), else the
    float32 partial and its log-sum-exp (base 2) at index ``part`` [BLOCK_G] for the combine. An
    empty range (seq_len 0, or a split past the end) leaves ``l_i == 0``: partial 0, weight 0."""
    has_keys = l_i > 0
    safe_l = tl.where(has_keys, l_i, 1.0)
    mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT:
        # One split: the partial is the answer (the combine would multiply it by exp2(0) = 1).
        tl.store(out_row_ptr + heads[:, None] * stride_oh + d[None, :],
                 (acc / safe_l[:, None]).to(out_row_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], acc / safe_l[:, None], mask=mask)
        tl.store(part_lse_ptr + part, tl.where(has_keys, m_i + tl.log2(safe_l), float("-inf")), mask=g_mask)


def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr, out_ptr,
    scale_log2, num_splits,
    stride_qn, stride_qh, stride_on, stride_oh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_btn,
    k_new_ptr, v_new_ptr, positions_ptr, cos_ptr, sin_ptr, slot_mapping_ptr,
    stride_kn, stride_knh, stride_vn, stride_vnh, stride_cos, stride_sin, q_norm_ptr, k_norm_ptr, eps,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MAX_SPLITS: tl.constexpr, UPCAST: tl.constexpr, DIRECT: tl.constexpr, ROPE: tl.constexpr,
    PREFETCH: tl.constexpr, NULL_SLOT: tl.constexpr, USE_PDL: tl.constexpr, PIPELINE: tl.constexpr,
    QK_NORM: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    table_row = block_table_ptr + n * stride_btn
    if PREFETCH:
        # A uniform-decode batch: the step's metadata, the RoPE tables and every key and value but
        # each row's newest were written before this forward pass (pdl.py), so they load before the
        # PDL wait, overlapping the kernels before this one: here the metadata and the first tile.
        seq_len, start, end, cos, sin, slot = _row_metadata(
            seq_lens_ptr, positions_ptr, cos_ptr, sin_ptr, slot_mapping_ptr, n, split, num_splits, d, d_mask,
            stride_cos, stride_sin, BLOCK_N, ROPE)
        tokens0 = start + tl.arange(0, BLOCK_N)
        first_end = tl.minimum(end, start + BLOCK_N)
        cached0 = tokens0 < tl.minimum(first_end, seq_len - 1)
        k0, v0 = load_kv(k_head, v_head, tile_blocks(table_row, tokens0, cached0, BLOCK_SIZE), tokens0, cached0, d,
                         d_mask, stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE)
        newest_in_first = (seq_len - 1 >= start) & (seq_len - 1 < first_end)
        newest_block = tl.load(table_row + (seq_len - 1) // BLOCK_SIZE, mask=newest_in_first, other=0).to(tl.int64)
        pdl_enter(USE_PDL)
    else:
        pdl_enter(USE_PDL)
        seq_len, start, end, cos, sin, slot = _row_metadata(
            seq_lens_ptr, positions_ptr, cos_ptr, sin_ptr, slot_mapping_ptr, n, split, num_splits, d, d_mask,
            stride_cos, stride_sin, BLOCK_N, ROPE)
    newest = seq_len - 1
    q = tl.load(q_ptr + n * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if ROPE:
        q, k_rot, v_new = _rotate_and_write_newest(
            q, q_ptr + n * stride_qn, heads, g_mask, d, d_mask, cos, sin, slot, seq_len, start, end,
            k_new_ptr + n * stride_kn + kv_head * stride_knh, v_new_ptr + n * stride_vn + kv_head * stride_vnh,
            k_head, v_head, q_norm_ptr, k_norm_ptr, eps, stride_qh, stride_kb, stride_kt, stride_vb, stride_vt,
            HEAD_DIM, BLOCK_SIZE, NULL_SLOT, QK_NORM)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if PREFETCH:
        # The first tile, its newest key (if there) put in: from registers where this kernel wrote
        # it (ROPE), else from the cache, where the kernel before this one wrote it.
        if ROPE:
            k_newest = k_rot.to(k_cache_ptr.dtype.element_ty)
            v_newest = v_new.to(v_cache_ptr.dtype.element_ty)
        else:
            offset = (newest % BLOCK_SIZE).to(tl.int64)
            in_first = tl.where(newest_in_first, d_mask, False)
            k_newest = tl.load(k_head + newest_block * stride_kb + offset * stride_kt + d, mask=in_first, other=0.0)
            v_newest = tl.load(v_head + newest_block * stride_vb + offset * stride_vt + d, mask=in_first, other=0.0)
        is_newest = (tokens0 == newest) & newest_in_first
        k0 = tl.where(is_newest[:, None], k_newest[None, :], k0)
        v0 = tl.where(is_newest[:, None], v_newest[None, :], v0)
        if start < end:
            m_i, l_i, acc = online_softmax_step(q, k0, v0, tokens0 < first_end, m_i, l_i, acc, scale_log2, UPCAST)
        start = start + BLOCK_N
    m_i, l_i, acc = attend_range(q, k_head, v_head, table_row, start, end, m_i, l_i, acc, d, d_mask, scale_log2,
                                 stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE, BLOCK_N, UPCAST, PIPELINE)

    _store_output(acc, m_i, l_i, out_ptr + n * stride_on, part_out_ptr, part_lse_ptr, (n * NUM_HEADS + heads) * num_splits
                  + split, heads, g_mask, d, d_mask, stride_oh, HEAD_DIM, DIRECT)


def _combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits, stride_on, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MAX_SPLITS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    n = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, MAX_SPLITS)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < HEAD_DIM
    base = (n * NUM_HEADS + head) * num_splits
    lse = tl.load(part_lse_ptr + base + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    # Empty splits have lse = -inf and weight exp2(-inf) = 0 (m is 0 when every split is empty).
    weight = tl.exp2(lse - tl.where(m > float("-inf"), m, 0.0))
    total = tl.sum(weight, axis=0)
    parts = tl.load(part_out_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(weight[:, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)
    # total == 0 only for a row without keys (seq_len 0): every weight is 0, so out is exactly 0.
    tl.store(out_ptr + n * stride_on + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


# Neither the split count nor the block-table row stride gains from specialisation; leaving them
# generic keeps one compiled variant for every batch size and table width (plus the DIRECT one
# for a single split), so the kernel the warmup compiled is the one every graph capture finds
# (nothing compiles during a capture).
_DECODE = DeviceKernel(_paged_decode_kernel, pdl=True, do_not_specialize=["num_splits", "stride_btn"])
_COMBINE = DeviceKernel(_combine_kernel, pdl=True, do_not_specialize=["num_splits"])


class DecodePartials(NamedTuple):
    """Flash-decoding partials left uncombined (``paged_decode_attention(defer_combine=True)``): the
    consumer combines them, e.g. ``o_proj.combine_gemv`` in the prologue of the O projection
    (the combine kernel's launch saved), or :meth:`combine`.

    ``part_out``: float32 [N, Hq, S, D], each split's normalised output (0 for a split without
    keys); ``part_lse``: float32 [N, Hq, S], its log-sum-exp in base 2 (``-inf`` without keys);
    ``seq_lens``: int [N], the attention's sequence lengths; ``block_n``: its context tile. The
    splits with keys are the first ``ceil(seq_len / per_split)`` (``split_range``: contiguous
    context ranges of whole tiles from position 0).
    """

    part_out: torch.Tensor
    part_lse: torch.Tensor
    seq_lens: torch.Tensor
    block_n: int

    def combine(self, dtype: torch.dtype) -> torch.Tensor:
        """The attention output [N, Hq * D] in ``dtype``: the combine kernel, as without deferral."""
        num_rows, num_heads, num_splits, head_dim = self.part_out.shape
        out = torch.empty((num_rows, num_heads, head_dim), dtype=dtype, device=self.part_out.device)
        _launch_combine(self.part_out, self.part_lse, out, num_splits)
        return out.reshape(num_rows, -1)


def _launch_combine(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, num_splits: int) -> None:
    num_rows, num_heads, head_dim = out.shape
    _COMBINE.on(out.device, tokens=num_rows)[(num_rows, num_heads)](
        part_out, part_lse, out, num_splits, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), MAX_SPLITS=MAX_SPLITS,
        num_warps=4,
    )


def _prefetches(head_dim: int, element_size: int) -> bool:
    """Whether a batch allowed to prefetch does: :data:`PREFETCH_FIRST_TILE`, a head dimension up to
    :data:`SMALL_HEAD_DIM`, and one token's key (or value) of one head filling whole 128-byte cache
    lines, so the line of a row's newest key, loaded after the wait, never also holds a key loaded
    before it (a stale copy of that line could then be read)."""
    return PREFETCH_FIRST_TILE and head_dim <= SMALL_HEAD_DIM and head_dim * element_size % 128 == 0


def _check_decode_inputs(q, k_cache, v_cache, block_table, seq_lens) -> None:
    """Raise ValueError unless the arguments fit :func:`paged_decode_attention`'s shapes and dtypes."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q must be [N, Hq, D] and k_cache/v_cache [num_blocks, block_size, Hkv, D]; got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    num_rows, num_heads, head_dim = q.shape
    _, _, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"q head dim {head_dim} != cache head dim {cache_dim}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q ({q.dtype}) and the KV cache ({k_cache.dtype}, {v_cache.dtype}) must share a dtype")
    if num_heads % num_kv_heads:
        raise ValueError(f"Hq={num_heads} is not a multiple of Hkv={num_kv_heads}")
    if block_table.dim() != 2 or block_table.shape[0] != num_rows or tuple(seq_lens.shape) != (num_rows,):
        raise ValueError(f"block_table {tuple(block_table.shape)} must be [N={num_rows}, W] and seq_lens "
                         f"{tuple(seq_lens.shape)} [N={num_rows}]")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table)):
        require_last_dim_contiguous(name, t)


def _rope_launch_args(rope: tuple | None, q: torch.Tensor, seq_lens: torch.Tensor) -> tuple:
    """The decode kernel's RoPE arguments (pointers, strides, then the q/k norm's weights and
    eps); without ``rope`` (or its ``qk_norm``) they are unused, and any pointers and strides will do."""
    if rope is None:
        return (q, q, seq_lens, q, q, seq_lens, 0, 0, 0, 0, 0, 0, q, q, 0.0)
    k_new, v_new, positions, cos_cache, sin_cache, slot_mapping, qk_norm = rope
    return (k_new, v_new, positions, cos_cache, sin_cache, slot_mapping,
            k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
            cos_cache.stride(0), sin_cache.stride(0), *(qk_norm if qk_norm is not None else (q, q, 0.0)))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    rope: tuple[torch.Tensor, ...] | None = None,
    prefetch: bool = False,
    defer_combine: bool = False,
) -> torch.Tensor | DecodePartials:
    """Single-query attention of each row over its paged keys/values: two kernels (one when the
    split count is 1), graph-safe.

    Args:
        q: [N, Hq, D] queries (RoPE applied), float32/bfloat16/float16, last dim contiguous.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] (``kv_cache_layer[0]`` / ``[1]``).
        block_table: int32/int64 [N, W]; entries below ``ceil(seq_len / block_size)`` are read.
        seq_lens: int [N], keys visible to each row (its own included), at most
            ``W * block_size`` (not checked: that would read the device). 0 gives a zero row.
        scale: softmax scale, normally ``D ** -0.5``.
        num_splits: override the context split count (1..:data:`MAX_SPLITS`; ``decode_splits.choose_num_splits``).
        block_n: override the context tile (a power of two >= 16); default :data:`BLOCK_N`
            (16 in the interpreter, so that small tests cross tiles and blocks).
        rope: internal; see :func:`rope_write_and_decode_attention`.
        prefetch: the batch is a uniform decode whose rows each wrote only their newest key and
            value in this forward pass (by the kernel just before, or by this one with ``rope``), and
            whose ``block_table`` and ``seq_lens`` no kernel of the pass writes: the metadata and
            the first context tile then load before the PDL wait (where :func:`_prefetches` says so).
            Never for a verification batch (its rows read keys other rows wrote in the same pass) or
            for metadata gathered just before the call.
        defer_combine: with more than one split, return :class:`DecodePartials` (``seq_lens`` unchanged until merged).

    Returns:
        [N, Hq, D] in ``q.dtype`` (rows with ``seq_lens == 0`` exactly 0), or ``defer_combine``'s partials.

    Raises:
        ValueError: shapes that do not fit together, ``Hq`` not a multiple of ``Hkv``, or an
            out-of-range override.
    """
    _check_decode_inputs(q, k_cache, v_cache, block_table, seq_lens)
    num_rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_rows == 0:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)

    interpreted = DeviceKernel.is_interpreted(_DECODE.on(q.device, tokens=num_rows))
    tile = block_n if block_n is not None else (16 if interpreted else BLOCK_N)
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {tile}")
    if num_splits is None:
        num_splits = choose_num_splits(num_rows, num_kv_heads, block_table.shape[1] * block_size, tile,
                                       num_programs_target(q.device))
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")

    group = num_heads // num_kv_heads
    block_d = next_power_of_2(head_dim)
    direct = num_splits == 1  # no combine: the decode kernel writes the normalised output itself
    deferred = defer_combine and not direct  # the partials are the result: q stands in for the unused output
    out = q if deferred else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if direct:
        part_out = part_lse = out  # unused by the kernel
    else:
        part_out = torch.empty((num_rows, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_rows, num_heads, num_splits), dtype=torch.float32, device=q.device)
    rope_args = _rope_launch_args(rope, q, seq_lens)
    _DECODE.on(q.device, tokens=num_rows)[(num_rows, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, part_out, part_lse, out,
        scale * math.log2(math.e), num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        *rope_args,
        NUM_HEADS=num_heads, GROUP=group, BLOCK_G=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=tile,
        MAX_SPLITS=MAX_SPLITS, UPCAST=interpreted or q.dtype == torch.float32, DIRECT=direct,
        ROPE=rope is not None, PREFETCH=prefetch and _prefetches(head_dim, k_cache.element_size()),
        NULL_SLOT=NULL_BLOCK * block_size, QK_NORM=rope is not None and rope[-1] is not None,
        **DECODE_LAUNCH,
    )
    if deferred:
        return DecodePartials(part_out, part_lse, seq_lens, tile)
    if not direct:
        _launch_combine(part_out, part_lse, out, num_splits)
    return out


def rope_write_and_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    defer_combine: bool = False,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor | DecodePartials:
    """``rope.rope_and_write_kv`` then :func:`paged_decode_attention` for a uniform-decode batch
    (one query token per row), with the rotation and the cache write folded into the attention
    kernel: one kernel fewer, the same results (the same roundings, bit for bit).

    Row ``n``'s new token sits at position ``positions[n]``, the last of its ``seq_lens[n]``
    keys; its rotated key and its value are written at ``slot_mapping[n]`` (a negative slot goes
    to the null block, as in ``rope_and_write_kv``) by the one program whose context range holds
    that position. Rows with ``seq_lens == 0`` (padding) write nothing and give zeros.

    Args:
        q: [N, Hq, D] before RoPE; k, v: [N, Hkv, D] (the new token's key before RoPE, and its
            value); strided views of the QKV projection are fine (last dimension contiguous).
        positions: int [N]; cos_cache, sin_cache: [max_positions, D] (the half-width table twice).
        kv_cache_layer: [2, num_blocks, block_size, Hkv, D].
        slot_mapping: int [N]; block_table: int [N, W]; seq_lens: int [N] (the new token included).
        scale, num_splits, block_n, defer_combine: as :func:`paged_decode_attention`.
        qk_norm: ``(q_weight [D], k_weight [D], eps)``: Qwen3's per-head RMSNorm of every query head
            and of the new key before the rotation, as ``rope_and_write_kv``'s ``qk_norm`` (its
            numerics up to the order of the float32 sum of squares); None: q and k as given.

    Returns:
        [N, Hq, D] in ``q.dtype`` (or :class:`DecodePartials`, as :func:`paged_decode_attention`).

    Raises:
        ValueError: shapes that do not fit together, an odd head dimension, a non-contiguous
            last dimension, or ``qk_norm`` weights that are not [D].
    """
    check_rope_inputs(q, k, v, positions, cos_cache, sin_cache, kv_cache_layer, slot_mapping)
    norm = check_qk_norm(qk_norm, q.shape[-1]) if qk_norm is not None else None
    return paged_decode_attention(
        q, kv_cache_layer[0], kv_cache_layer[1], block_table, seq_lens, scale, num_splits=num_splits,
        block_n=block_n, rope=(k, v, positions, cos_cache, sin_cache, slot_mapping, norm), prefetch=True,
        defer_combine=defer_combine,
    )
