"""The decode attention's context loop (``decode_attention.py``): one program's query group over a
range of its row's cached keys and values, ``BLOCK_N`` tokens a tile through the block table, with an
online softmax in float32 (base 2).

Two forms of the loop, both giving the same values in the same order (results bit for bit equal):
the plain loop, whose tile loads the compiler software-pipelines (``num_stages``), and ``PIPELINE``,
an explicit prefetch of the next tile's keys and values. ``decode_attention.DECODE_LAUNCH`` picks one
per launch. (A third form, the next tile's block-table entries loaded a tile ahead so that the
compiler's copies stay in flight through the current tile, was measured slower and removed:
bench/RESULTS.md, "Three leads measured and dropped".)
"""

from __future__ import annotations

import triton.language as tl

from .backend import device_function


@device_function
def tile_blocks(table_row_ptr, tokens, valid, BLOCK_SIZE: tl.constexpr):
    """The cache block of each context token in ``tokens`` [BLOCK_N] (int64; 0 where not ``valid``)."""
    return tl.load(table_row_ptr + tokens // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)


@device_function
def load_kv(k_head_ptr, v_head_ptr, blocks, tokens, valid, d, d_mask,
            stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE: tl.constexpr):
    """The keys and values of context ``tokens`` [BLOCK_N] in cache ``blocks`` (:func:`tile_blocks`),
    [BLOCK_N, BLOCK_D] each in the cache dtype; rows not ``valid`` are 0 and never loaded (whatever
    such a slot holds, even NaN, cannot leak)."""
    offsets = (tokens % BLOCK_SIZE).to(tl.int64)
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(k_head_ptr + blocks[:, None] * stride_kb + offsets[:, None] * stride_kt + d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(v_head_ptr + blocks[:, None] * stride_vb + offsets[:, None] * stride_vt + d[None, :],
                mask=kv_mask, other=0.0)
    return k, v


@device_function
def online_softmax_step(q, k, v, valid, m_i, l_i, acc, scale_log2, UPCAST: tl.constexpr):
    """One tile of the online softmax (base 2): ``(m, l, acc)`` after the keys ``k`` and values ``v``
    [BLOCK_N, BLOCK_D] whose rows are ``valid`` (a tile needs at least one)."""
    if UPCAST:
        scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(v.dtype)  # probabilities in the value dtype, as the reference's matmul
    if UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v)
    return m_new, l_i, acc


@device_function
def attend_range(
    q, k_head_ptr, v_head_ptr, table_row_ptr, start, end, m_i, l_i, acc, d, d_mask, scale_log2,
    stride_kb, stride_kt, stride_vb, stride_vt,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PIPELINE: tl.constexpr,
):
    """The online softmax of one program's query group continued over the context tokens
    ``[start, end)``, ``BLOCK_N`` at a time through the block table, from the running max ``m`` and
    sum ``l`` (float32 [BLOCK_G], base 2) and the unnormalised output ``acc`` (float32
    [BLOCK_G, BLOCK_D]); returns the three. With ``PIPELINE`` the next tile's keys and values and
    the block-table entries of the tile after it are loaded before a tile's softmax step (the same
    values in the same order: the results are bit for bit those without it)."""
    if PIPELINE:
        r = tl.arange(0, BLOCK_N)
        first, second = start + r, start + BLOCK_N + r
        k, v = load_kv(k_head_ptr, v_head_ptr, tile_blocks(table_row_ptr, first, first < end, BLOCK_SIZE), first,
                       first < end, d, d_mask, stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE)
        blocks_next = tile_blocks(table_row_ptr, second, second < end, BLOCK_SIZE)
        for tile in range(start, end, BLOCK_N):
            upcoming = tile + BLOCK_N + r
            k_next, v_next = load_kv(k_head_ptr, v_head_ptr, blocks_next, upcoming, upcoming < end, d, d_mask,
                                     stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE)
            blocks_next = tile_blocks(table_row_ptr, upcoming + BLOCK_N, upcoming + BLOCK_N < end, BLOCK_SIZE)
            m_i, l_i, acc = online_softmax_step(q, k, v, tile + r < end, m_i, l_i, acc, scale_log2, UPCAST)
            k, v = k_next, v_next
    else:
        for tile in range(start, end, BLOCK_N):
            tokens = tile + tl.arange(0, BLOCK_N)
            valid = tokens < end
            blocks = tile_blocks(table_row_ptr, tokens, valid, BLOCK_SIZE)
            k, v = load_kv(k_head_ptr, v_head_ptr, blocks, tokens, valid, d, d_mask,
                           stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE)
            m_i, l_i, acc = online_softmax_step(q, k, v, valid, m_i, l_i, acc, scale_log2, UPCAST)
    return m_i, l_i, acc
