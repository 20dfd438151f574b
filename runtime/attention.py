"""Paged attention in pure torch: write K/V by slot mapping, attend through block tables.

Two paths:

- **Uniform decode** (``meta.max_query_len == 1``): one batched computation, graph-safe. It reads
  the block table and sequence lengths only as device tensors; every shape depends only on the
  token count T, the request count R and the block-table width W, so a CUDA graph captured for
  (T, R, W) replays correctly for any contents. Its cost is proportional to W * block_size
  (every block-table entry is gathered and masked), so eager callers should pass a block table
  no wider than the batch needs.
- **General** (prefill, chunked prefill, mixed batches): eager. Requests with a query of one token
  go through the batched decode computation; longer queries loop over requests with host lengths
  (``meta.query_lens_cpu`` / ``meta.seq_lens_cpu``) and use ``scaled_dot_product_attention``,
  causal within the query and offset by the context already in the cache.

GQA maps query head ``h`` to KV head ``h // (Hq // Hkv)`` (the Hugging Face ``repeat_kv`` order).

On CUDA with Triton (``kernels.available``), both paths send their single-query rows to the
fused paged decode kernel (``kernels.paged_decode_attention``: cost proportional to each row's
context, not to W); :func:`decode_attention` below stays the reference (CPU, and
``GRAPHSERVING_KERNELS=torch``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernels
from .forward_metadata import NULL_BLOCK, ForwardMetadata


def write_kv(kv_cache_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token row's key and value into its slot of the paged cache (in place, graph-safe).

    Args:
        kv_cache_layer: [2, num_blocks, block_size, Hkv, D], keys at index 0, values at 1.
        k, v: [T, Hkv, D] (cast to the cache dtype).
        slot_mapping: int64 [T], flat slot ``block * block_size + offset``; a negative slot
            (``PAD_SLOT_ID``) is redirected to the first slot of ``NULL_BLOCK``, never to a slot
            of a real sequence.
    """
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache_layer.shape
    k_flat = kv_cache_layer[0].view(num_blocks * block_size, num_kv_heads, head_dim)
    v_flat = kv_cache_layer[1].view(num_blocks * block_size, num_kv_heads, head_dim)
    slots = torch.where(slot_mapping < 0, NULL_BLOCK * block_size, slot_mapping).to(torch.int64)
    k_flat.index_copy_(0, slots, k.to(kv_cache_layer.dtype))
    v_flat.index_copy_(0, slots, v.to(kv_cache_layer.dtype))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: ForwardMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of every token row over its request's cached keys and values.

    The current step's K/V must already be in the cache (:func:`write_kv`).

    Args:
        q: [T, Hq, D] queries (RoPE applied).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D].
        meta: the step's metadata (block_table, seq_lens, query lengths).
        scale: softmax scale, normally ``D ** -0.5``.

    Returns:
        [T, Hq * D] in ``q.dtype``; rows of padded requests (``seq_lens == 0``) and padded token
        rows are exactly zero.

    Raises:
        ValueError: a uniform-decode batch with more token rows than request rows.
    """
    if meta.max_query_len == 1:
        num_tokens = q.shape[0]
        if num_tokens > meta.block_table.shape[0]:
            raise ValueError(
                f"uniform decode needs one request row per token row: T={num_tokens}, "
                f"R={meta.block_table.shape[0]}"
            )
        out = _decode(q, k_cache, v_cache, meta.block_table[:num_tokens], meta.seq_lens[:num_tokens], scale)
        return out.reshape(num_tokens, -1)
    return _general_attention(q, k_cache, v_cache, meta, scale)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Single-query rows: the fused kernel where available, else the reference below."""
    if kernels.available(q.device):
        return kernels.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale)
    return decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Batched single-query attention through block tables; graph-safe (no host reads).

    Gathers all W blocks of each row, masks slots at or beyond ``seq_lens`` and normalises in
    float32. Masked slots contribute nothing, whatever they hold (even NaN). A row with
    ``seq_lens == 0`` sees only masked slots; its output is forced to zero.

    Args:
        q: [N, Hq, D], one query row per request.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D].
        block_table: int32/int64 [N, W].
        seq_lens: int [N], keys visible to each row (its own included).
        scale: softmax scale.

    Returns:
        [N, Hq, D] in ``q.dtype``.
    """
    num_rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    width = block_table.shape[1]
    group = num_heads // num_kv_heads
    flat = block_table.reshape(-1)
    # [N, W * block_size, Hkv, D] -> [N, Hkv, L, D]
    keys = k_cache.index_select(0, flat).view(num_rows, width * block_size, num_kv_heads, head_dim).transpose(1, 2)
    values = v_cache.index_select(0, flat).view(num_rows, width * block_size, num_kv_heads, head_dim).transpose(1, 2)
    query = q.view(num_rows, num_kv_heads, group, head_dim)
    scores = torch.matmul(query, keys.transpose(-1, -2)).float() * scale  # [N, Hkv, G, L]
    positions = torch.arange(width * block_size, device=q.device)
    visible = positions.view(1, -1) < seq_lens.view(-1, 1)  # [N, L]
    hidden = ~visible.view(num_rows, 1, -1, 1)
    scores = scores.masked_fill(hidden.transpose(-1, -2), torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    # Masked slots get probability exactly 0, but 0 * NaN is NaN: zero the values they hold too, so
    # garbage in the null block or in stale slots can never reach a real row.
    out = torch.matmul(probs, values.masked_fill(hidden, 0))  # [N, Hkv, G, D]
    out = torch.where((seq_lens > 0).view(-1, 1, 1, 1), out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out.reshape(num_rows, num_heads, head_dim).to(q.dtype)


def _general_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: ForwardMetadata, scale: float
) -> torch.Tensor:
    """Eager attention for batches with multi-token queries (prefill / chunked prefill / mixed)."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    query_lens = meta.query_lens_cpu if meta.query_lens_cpu is not None else meta.query_lens.tolist()
    seq_lens = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.tolist()
    num_reqs = min(meta.num_actual_reqs, len(query_lens))
    out = torch.zeros_like(q)

    decode_rows: list[int] = []
    decode_reqs: list[int] = []
    start = 0
    for r in range(num_reqs):
        query_len, seq_len = int(query_lens[r]), int(seq_lens[r])
        if query_len == 0 or seq_len == 0:
            start += query_len
            continue
        if query_len == 1:
            decode_rows.append(start)
            decode_reqs.append(r)
            start += 1
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = meta.block_table[r, :num_blocks]
        keys = k_cache.index_select(0, blocks).reshape(num_blocks * block_size, num_kv_heads, head_dim)[:seq_len]
        values = v_cache.index_select(0, blocks).reshape(num_blocks * block_size, num_kv_heads, head_dim)[:seq_len]
        query = q[start:start + query_len].transpose(0, 1)  # [Hq, ql, D]
        context_len = seq_len - query_len
        if context_len == 0:
            mask, causal = None, True
        else:
            rows = torch.arange(query_len, device=q.device).view(-1, 1) + context_len
            mask, causal = torch.arange(seq_len, device=q.device).view(1, -1) <= rows, False
        attn = F.scaled_dot_product_attention(
            query, keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=num_heads != num_kv_heads,
        )
        out[start:start + query_len] = attn.transpose(0, 1)
        start += query_len

    if decode_rows:
        device = q.device
        rows = torch.tensor(decode_rows, device=device)
        reqs = torch.tensor(decode_reqs, device=device)
        max_blocks = -(-max(int(seq_lens[r]) for r in decode_reqs) // block_size)
        out[rows] = _decode(
            q[rows], k_cache, v_cache, meta.block_table[reqs, :max_blocks], meta.seq_lens[reqs], scale
        )
    return out.reshape(num_tokens, num_heads * head_dim)
