"""Attention of a speculative-decoding verification batch, computed as a uniform-decode batch.

Verifying ``k`` draft tokens of a request whose KV cache holds ``c`` tokens runs ``q = k + 1``
query rows at positions ``c .. c + k``, causal: row ``j`` sees keys ``0 .. c + j``. Once the K/V
of all ``q`` rows are in the cache, row ``j`` is exactly a *decode* row with ``seq_len = c + j + 1``
over its request's block table. So a verification batch of ``R`` requests is a uniform-decode
batch of ``T = R * q`` rows whose block-table rows repeat per request
(:func:`expand_for_verification`), and the graph-safe decode attention computes it
(``attention.decode_attention``, the reference; ``kernels.paged_decode_attention`` on CUDA): every
shape depends on ``R``, ``q`` and the block-table width only, so it can be captured in the FULL
graph of the key ``(T = R * q, R, q)`` (runtime/graphs/key.py). It equals the general prefill path
(``attention.paged_attention`` with query length ``q`` per request, which handles chunked prefill
with context) on the same inputs (tests/runtime/model/test_verify_attention.py).

Write first, then attend: the fused ``kernels.rope_write_and_decode_attention`` writes each row's
K/V from inside the attention program that reads the context, so rows of one request, which read
each other's keys, would race. :func:`verify_attention` writes every row's K/V
(``kernels.rope_and_write_kv``, or ``attention.write_kv``) and then attends, a second launch that
the stream orders after the first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from .attention import decode_attention, write_kv


@dataclass(frozen=True)
class VerificationRows:
    """The decode rows of a verification batch: one per token row.

    Attributes:
        seq_lens: int32 [R * q], keys visible to each row (its own included); 0 for the rows of
            a padded request.
        req_index: int64 [R * q], the request row (block-table row) of each token row:
            ``r`` for rows ``r * q .. r * q + q - 1``.
        block_table: [R * q, W], the request's block-table row repeated for each of its rows
            (the input's dtype).
    """

    seq_lens: torch.Tensor
    req_index: torch.Tensor
    block_table: torch.Tensor


def expand_for_verification(seq_lens: torch.Tensor, block_table: torch.Tensor, query_len: int) -> VerificationRows:
    """Per-row sequence lengths and block-table rows of a verification batch (pure, graph-safe).

    Row ``j`` (``0 <= j < query_len``) of request ``r`` sees ``seq_lens[r] - (query_len - 1 - j)``
    keys, i.e. its context ``c`` plus ``j + 1``; rows of a padded request (``seq_lens == 0``) see
    none. Only device tensor ops whose shapes depend on ``R``, ``query_len`` and ``W``: no host
    read, so it can run inside a captured graph, or once per forward pass outside it.

    Args:
        seq_lens: int [R], tokens in each request's KV cache after this step (context plus its
            ``query_len`` rows), 0 for padded requests (``ForwardMetadata.seq_lens``). A real
            request has ``seq_lens >= query_len`` (not checked: that would read the device).
        block_table: int32/int64 [R, W] (``ForwardMetadata.block_table``).
        query_len: rows per request, ``k + 1`` for ``k`` draft tokens.

    Returns:
        :class:`VerificationRows` of ``R * query_len`` rows on ``seq_lens``'s device.

    Raises:
        ValueError: ``query_len < 1``, or ``seq_lens`` and ``block_table`` disagree on ``R``.
    """
    if query_len < 1:
        raise ValueError(f"query_len must be >= 1 (k + 1 for k draft tokens), got {query_len}")
    if seq_lens.dim() != 1 or block_table.dim() != 2 or block_table.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"seq_lens {tuple(seq_lens.shape)} must be [R] and block_table "
                         f"{tuple(block_table.shape)} [R, W]")
    num_reqs = seq_lens.shape[0]
    device = seq_lens.device
    # offsets -(q-1) .. 0: the last row sees every key, the first its context and itself
    offsets = torch.arange(1 - query_len, 1, device=device, dtype=torch.int32)
    lens = seq_lens.to(torch.int32)[:, None]
    rows = torch.where(lens > 0, (lens + offsets[None, :]).clamp(min=0), torch.zeros_like(lens))
    req_index = torch.arange(num_reqs, device=device, dtype=torch.int64).repeat_interleave(query_len)
    return VerificationRows(
        seq_lens=rows.reshape(-1),
        req_index=req_index,
        block_table=block_table.repeat_interleave(query_len, dim=0),
    )


def verify_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    rows: VerificationRows,
    scale: float,
    *,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Write the K/V of every row of a verification batch into the paged cache, then attend.

    Graph-safe: two launches (the write, then the decode attention) with shapes fixed by ``T``,
    ``R`` and ``W``. Equal to ``attention.paged_attention`` over the same batch laid out as ``R``
    requests of ``q`` query rows each (the module docstring says why).

    Args:
        q: [T, Hq, D] queries, T = R * q; after RoPE, or before it when ``rope`` is given.
        k, v: [T, Hkv, D], this step's keys (after RoPE, or before it with ``rope``) and values.
        kv_cache_layer: [2, num_blocks, block_size, Hkv, D], keys at index 0, values at 1.
        slot_mapping: int64 [T], each row's slot; ``PAD_SLOT_ID`` rows write to the null block.
        rows: :func:`expand_for_verification` of the batch (once per forward pass, shared by
            every layer).
        scale: softmax scale, normally ``D ** -0.5``.
        rope: ``(positions int64 [T], cos_cache, sin_cache [max_positions, D])``: rotate q and k
            as they are written (``kernels.rope_and_write_kv``, the fused-kernel path of
            ``LlamaForCausalLM.run_attention``); None: q and k are rotated already and the write
            is ``attention.write_kv``.
        qk_norm: with ``rope``, Qwen3's q/k norm folded into the RoPE kernel
            (``kernels.rope_and_write_kv``'s argument); None: q and k are normed already.

    Returns:
        [T, Hq * D] in ``q.dtype``; rows of padded requests are exactly zero.

    Raises:
        ValueError: ``q`` does not have one row per row of ``rows``.
    """
    num_tokens = q.shape[0]
    if rows.seq_lens.shape[0] != num_tokens:
        raise ValueError(f"q has {num_tokens} rows but the verification rows number {rows.seq_lens.shape[0]}; "
                         "build them with expand_for_verification over this batch")
    if rope is not None:
        positions, cos_cache, sin_cache = rope
        q, _ = kernels.rope_and_write_kv(q, k, v, positions, cos_cache, sin_cache, kv_cache_layer, slot_mapping,
                                         return_k=False, qk_norm=qk_norm)
    else:
        write_kv(kv_cache_layer, k, v, slot_mapping)
    k_cache, v_cache = kv_cache_layer[0], kv_cache_layer[1]
    if kernels.available(q.device):
        out = kernels.paged_decode_attention(q, k_cache, v_cache, rows.block_table, rows.seq_lens, scale)
    else:
        out = decode_attention(q, k_cache, v_cache, rows.block_table, rows.seq_lens, scale)
    return out.reshape(num_tokens, -1)
