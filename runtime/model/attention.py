"""Paged attention in pure torch: write K/V by slot mapping, attend through block tables.

Two paths:

- **Uniform decode** (``meta.max_query_len == 1``): one batched computation, graph-safe. It reads
  the block table and sequence lengths only as device tensors; every shape depends only on the
  token count T, the request count R and the block-table width W, so a CUDA graph captured for
  (T, R, W) replays correctly for any contents. Its cost is proportional to W * block_size
  (every block-table entry is gathered and masked), so eager callers should pass a block table
  no wider than the batch needs.
- **General** (prefill, chunked prefill, mixed batches): eager. Requests with a query of one token
  go through the batched decode computation. Longer queries of all requests gather their keys by
  slot from the paged cache and then share one call:

  - on CUDA in float16/bfloat16, PyTorch's variable-length FlashAttention (the operator behind
    ``torch.nn.attention.varlen.varlen_attn``, called directly), causal with the bottom-right
    alignment that chunked prefill needs (a query at the end of a request's keys sees them all);
  - elsewhere (CPU, float32) one masked ``scaled_dot_product_attention`` call on the math backend
    (a block-diagonal mask, causal within each query and offset by the context already cached),
    split into a few calls only when the mask would exceed :data:`PREFILL_PAIRS_PER_CALL`.

  Host lengths come from ``meta.query_lens_cpu`` / ``meta.seq_lens_cpu``; the index tensors are
  built by the first layer and reused by the others.

GQA maps query head ``h`` to KV head ``h // (Hq // Hkv)`` (the Hugging Face ``repeat_kv`` order).

On CUDA with Triton (``kernels.available``), both paths send their single-query rows to the
fused paged decode kernel (``kernels.paged_decode_attention``: cost proportional to each row's
context, not to W); :func:`decode_attention` below stays the reference (CPU, and
``GRAPHSERVING_KERNELS=torch``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import kernels
from .forward_metadata import ForwardMetadata, to_device
from .kv_layout import NULL_BLOCK


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
    defer_combine: bool = False,
) -> torch.Tensor | kernels.DecodePartials:
    """Attention of every token row over its request's cached keys and values.

    The current step's K/V must already be in the cache (:func:`write_kv`). A uniform-decode batch
    (``meta.max_query_len == 1``) on the kernels prefetches (``kernels.paged_decode_attention``
    ``prefetch=True``): each row must have written only its newest key and value in this forward
    pass, and ``meta``'s block table and sequence lengths must not be written by a kernel of it;
    a verification batch goes through ``verify_attention`` instead.

    Args:
        q: [T, Hq, D] queries (RoPE applied).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D].
        meta: the step's metadata (block_table, seq_lens, query lengths).
        scale: softmax scale, normally ``D ** -0.5``.
        defer_combine: a uniform-decode batch on the kernels may return its split partials
            uncombined (``kernels.paged_decode_attention``'s ``defer_combine``).

    Returns:
        [T, Hq * D] in ``q.dtype``; rows of padded requests (``seq_lens == 0``) and padded token
        rows are exactly zero. With ``defer_combine``, possibly ``kernels.DecodePartials``.

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
        out = _decode(q, k_cache, v_cache, meta.block_table[:num_tokens], meta.seq_lens[:num_tokens], scale,
                      prefetch=True, defer_combine=defer_combine)
        return out if isinstance(out, tuple) else out.reshape(num_tokens, -1)  # a tuple: DecodePartials
    return _general_attention(q, k_cache, v_cache, meta, scale)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    prefetch: bool = False,
    defer_combine: bool = False,
) -> torch.Tensor | kernels.DecodePartials:
    """Single-query rows: the fused kernel where available (``prefetch`` and ``defer_combine`` as
    ``kernels.paged_decode_attention`` says), else the reference below."""
    if kernels.available(q.device):
        return kernels.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale, prefetch=prefetch,
                                              defer_combine=defer_combine)
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


MASKED_SDPA_BACKENDS = [SDPBackend.MATH]
"""Backends the masked prefill call (CPU, float32) may use: the math reference only, so the
reference path is one well-understood computation everywhere. Math materialises ``Hq x Tq x L``
scores, hence the bound below. Half-precision batches on CUDA take the varlen FlashAttention path
instead (:func:`varlen_available`)."""

VARLEN_DTYPES = (torch.float16, torch.bfloat16)
"""Dtypes of the FlashAttention varlen kernel (FlashAttention-2 supports fp16 and bf16 only)."""

PREFILL_PAIRS_PER_CALL = 1 << 22
"""Most (query token, key) pairs one batched prefill attention call may mask: 4 Mi pairs (e.g. 2048
query tokens over 2048 keys; a 4 MiB boolean mask and ``Hq x 4 Mi`` scores). Prompts are grouped, in batch order,
into calls under this bound; a prompt above it on its own gets a call to itself."""


@dataclass(frozen=True)
class PrefillSpan:
    """One request's multi-token query in a batch: request row ``req``, token rows
    ``first .. first + query_len - 1``, keys at positions ``0 .. seq_len - 1``."""

    req: int
    first: int
    query_len: int
    seq_len: int

    @property
    def pairs(self) -> int:
        return self.query_len * self.seq_len


def group_prefill_spans(spans: list[PrefillSpan], max_pairs: int | None = None) -> list[list[PrefillSpan]]:
    """Split spans, in order, into groups whose (all queries) x (all keys) mask stays <= ``max_pairs``
    (default :data:`PREFILL_PAIRS_PER_CALL`).

    Pure. A span that alone exceeds the bound forms its own group.
    """
    max_pairs = PREFILL_PAIRS_PER_CALL if max_pairs is None else max_pairs
    groups: list[list[PrefillSpan]] = []
    queries = keys = 0
    for span in spans:
        if groups and (queries + span.query_len) * (keys + span.seq_len) <= max_pairs:
            groups[-1].append(span)
            queries += span.query_len
            keys += span.seq_len
        else:
            groups.append([span])
            queries, keys = span.query_len, span.seq_len
    return groups


@dataclass(frozen=True)
class PrefillPlan:
    """Device index tensors of one batched prefill call (shared by every layer of a forward pass).

    Attributes:
        rows: int64 [Tq], the token rows of the group's queries.
        slots: int64 [L], KV-cache slot of each key (request after request, positions ascending).
        mask: bool [Tq, L], True where a query may attend a key: same request, key position <=
            query position (causal, offset by the context already cached).
    """

    rows: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor


def _offsets_within(lens: torch.Tensor) -> torch.Tensor:
    """For runs of ``lens`` elements laid end to end (int64 [N]): each element's index within its run."""
    return torch.arange(int(lens.sum())) - (lens.cumsum(0) - lens).repeat_interleave(lens)


def _key_slots(block_table: torch.Tensor, k_req: torch.Tensor, k_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """KV-cache slot (int64) of the key at position ``k_pos`` of request row ``k_req`` (device)."""
    blocks = block_table[k_req, torch.div(k_pos, block_size, rounding_mode="floor")].to(torch.int64)
    return blocks * block_size + k_pos % block_size


def prefill_plan(spans: list[PrefillSpan], block_table: torch.Tensor, block_size: int) -> PrefillPlan:
    """Build the index tensors of one group on ``block_table``'s device (one host-to-device copy).

    Args:
        spans: the group's requests.
        block_table: int32/int64 [R, W] (device).
        block_size: tokens per KV block.
    """
    device = block_table.device
    query_lens = torch.tensor([s.query_len for s in spans])
    seq_lens = torch.tensor([s.seq_len for s in spans])
    index = torch.arange(len(spans))
    q_group = index.repeat_interleave(query_lens)
    k_group = index.repeat_interleave(seq_lens)
    q_starts = torch.tensor([s.first for s in spans]).repeat_interleave(query_lens)
    q_offsets = _offsets_within(query_lens)
    q_pos = (seq_lens - query_lens).repeat_interleave(query_lens) + q_offsets
    k_pos = _offsets_within(seq_lens)
    k_req = torch.tensor([s.req for s in spans]).repeat_interleave(seq_lens)
    packed = torch.cat([q_starts + q_offsets, q_group, q_pos, k_group, k_pos, k_req]).to(device, non_blocking=True)
    rows, q_group, q_pos, k_group, k_pos, k_req = packed.split([len(q_group)] * 3 + [len(k_group)] * 3)
    mask = (q_group[:, None] == k_group[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    return PrefillPlan(rows=rows, slots=_key_slots(block_table, k_req, k_pos, block_size), mask=mask)


def varlen_available(q: torch.Tensor) -> bool:
    """Whether prefill queries ``q`` [T, Hq, D] may take the varlen FlashAttention path: PyTorch
    has the operator with the expected schema (:data:`DIRECT_FLASH`), ``q`` is a CUDA tensor in
    :data:`VARLEN_DTYPES` with ``D`` a multiple of 8 up to 256 (FlashAttention-2's head sizes) on a
    compute capability >= 8.0 device, and the flash SDPA backend is enabled
    (``torch.backends.cuda.enable_flash_sdp``)."""
    head_dim = q.shape[-1]
    return (
        DIRECT_FLASH
        and q.is_cuda
        and q.dtype in VARLEN_DTYPES
        and head_dim % 8 == 0
        and head_dim <= 256
        and torch.cuda.get_device_capability(q.device) >= (8, 0)
        and torch.backends.cuda.flash_sdp_enabled()
    )


@dataclass(frozen=True)
class VarlenPlan:
    """Device index tensors of one varlen prefill call (shared by every layer of a forward pass).

    Attributes:
        rows: int64 [Tq], the token rows of every span's queries, span after span.
        slots: int64 [L], KV-cache slot of each key (span after span, positions ascending).
        cu_seq_q: int32 [N + 1], prefix sums of the spans' query lengths.
        cu_seq_k: int32 [N + 1], prefix sums of the spans' key counts (``seq_len``).
        max_q / max_k: the longest query / key run (host ints, as the kernel needs them).
    """

    rows: torch.Tensor
    slots: torch.Tensor
    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor
    max_q: int
    max_k: int


def varlen_plan(spans: list[PrefillSpan], block_table: torch.Tensor, block_size: int) -> VarlenPlan:
    """Build the index tensors of a varlen call on ``block_table``'s device (one host-to-device copy).

    Args:
        spans: the batch's multi-token queries (at least one).
        block_table: int32/int64 [R, W] (device).
        block_size: tokens per KV block.
    """
    query_lens = torch.tensor([s.query_len for s in spans])
    seq_lens = torch.tensor([s.seq_len for s in spans])
    zero = torch.zeros(1, dtype=torch.int64)
    cu_q = torch.cat([zero, query_lens.cumsum(0)])
    cu_k = torch.cat([zero, seq_lens.cumsum(0)])
    rows = torch.tensor([s.first for s in spans]).repeat_interleave(query_lens) + _offsets_within(query_lens)
    k_pos = _offsets_within(seq_lens)
    k_req = torch.tensor([s.req for s in spans]).repeat_interleave(seq_lens)
    packed = torch.cat([rows, k_pos, k_req, cu_q, cu_k]).to(block_table.device, non_blocking=True)
    rows, k_pos, k_req, cu_q, cu_k = packed.split([len(rows), len(k_pos), len(k_pos), len(cu_q), len(cu_k)])
    return VarlenPlan(
        rows=rows,
        slots=_key_slots(block_table, k_req, k_pos, block_size),
        cu_seq_q=cu_q.to(torch.int32),
        cu_seq_k=cu_k.to(torch.int32),
        max_q=int(query_lens.max()),
        max_k=int(seq_lens.max()),
    )


_FLASH_FORWARD_ARGS = ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                       "is_causal", "return_debug_mask")


def flash_forward_direct() -> bool:
    """Whether ``torch.ops.aten._flash_attention_forward`` (the kernel behind ``varlen_attn``) has
    the schema this module calls: the positional arguments of :data:`_FLASH_FORWARD_ARGS` and a
    ``scale`` keyword. Pure (reads the installed PyTorch's operator schema)."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    try:
        names = tuple(a.name for a in op.default._schema.arguments)
    except (AttributeError, RuntimeError):
        return False
    return names[: len(_FLASH_FORWARD_ARGS)] == _FLASH_FORWARD_ARGS and "scale" in names


DIRECT_FLASH = flash_forward_direct()
"""Whether the varlen path may call the FlashAttention operator (else every batch takes the masked
math path). Called directly rather than through ``varlen_attn``, whose Python custom-op wrapper
(dispatch, an extra ``rng_state`` allocation, and in PyTorch < 2.12 a copy of the KV heads for
GQA, which the kernel handles natively) cost more host time per layer than the kernel's device
time for short prompts (``bench/engine_profile.py``: 30 calls took 15 ms under cProfile for a
32-token prompt)."""


def varlen_causal_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: VarlenPlan, scale: float
) -> torch.Tensor:
    """Causal attention of packed variable-length queries over their packed keys (FlashAttention).

    Causality is aligned bottom-right: the last query of a span sees all of its span's keys, so a
    chunk whose earlier tokens are already cached attends them (FlashAttention-2's convention for
    ``max_q < max_k``). Calls the FlashAttention operator directly; only where its schema is the
    expected one (:data:`DIRECT_FLASH`, checked by :func:`varlen_available`).

    Args:
        query: [Tq, Hq, D], float16/bfloat16, CUDA.
        keys, values: [L, Hkv, D], same dtype; ``Hq`` a multiple of ``Hkv`` (GQA).
        plan: the spans' prefix sums and maxima.
        scale: softmax scale.

    Returns:
        [Tq, Hq, D] in ``query.dtype``.
    """
    # is_causal with max_q < max_k masks bottom-right; Hkv dividing Hq is GQA in the kernel
    return torch.ops.aten._flash_attention_forward(
        query, keys, values, plan.cu_seq_q, plan.cu_seq_k, plan.max_q, plan.max_k, 0.0, True, False, scale=scale
    )[0]


@dataclass(frozen=True)
class BatchLayout:
    """How the token rows of a general batch split between prefill spans and single-token decode
    rows, and the index tensors of its prefill call(s); built once per forward pass (by the first
    layer) and cached on the metadata.

    Attributes:
        spans: the multi-token queries, in batch order.
        decode_rows / decode_reqs: int64 [Nd] on the device, the token rows and request rows of the
            single-token queries (None when there are none).
        decode_blocks: block-table columns the decode rows read (their longest context).
        prefill_only: the spans are every token row, 0 .. T-1 in order (no decode or padded rows),
            so the prefill call's output is the layer's output as it is.
        varlen: the spans' varlen FlashAttention call, where :func:`varlen_available`; else None.
        masked: else the spans' masked calls, one per :func:`group_prefill_spans` group (empty
            without spans).
    """

    spans: list[PrefillSpan]
    decode_rows: torch.Tensor | None
    decode_reqs: torch.Tensor | None
    decode_blocks: int
    prefill_only: bool
    varlen: VarlenPlan | None
    masked: list[PrefillPlan]


def batch_layout(meta: ForwardMetadata, q: torch.Tensor, block_size: int) -> BatchLayout:
    """Classify the token rows of ``meta`` (host lengths from ``meta.query_lens_cpu`` /
    ``meta.seq_lens_cpu``, else one read of the device tensors) and plan the prefill call(s) for
    queries like ``q`` [T, Hq, D]. Requests with no keys (padded rows) belong to neither group. The
    index tensors travel without a stream synchronisation."""
    query_lens = meta.query_lens_cpu if meta.query_lens_cpu is not None else meta.query_lens.tolist()
    seq_lens = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.tolist()
    num_reqs = min(meta.num_actual_reqs, len(query_lens))
    decode_rows: list[int] = []
    decode_reqs: list[int] = []
    spans: list[PrefillSpan] = []
    start = 0
    for r in range(num_reqs):
        query_len, seq_len = int(query_lens[r]), int(seq_lens[r])
        if query_len == 1 and seq_len > 0:
            decode_rows.append(start)
            decode_reqs.append(r)
        elif query_len > 1 and seq_len > 0:
            spans.append(PrefillSpan(r, start, query_len, seq_len))
        start += query_len
    rows = reqs = None
    blocks = 0
    if decode_rows:
        both = to_device([decode_rows, decode_reqs], torch.int64, q.device)
        rows, reqs = both[0], both[1]
        blocks = -(-max(int(seq_lens[r]) for r in decode_reqs) // block_size)
    prefill_only = not decode_rows and sum(s.query_len for s in spans) == q.shape[0]
    varlen = varlen_plan(spans, meta.block_table, block_size) if spans and varlen_available(q) else None
    masked = [] if varlen is not None else [
        prefill_plan(g, meta.block_table, block_size) for g in group_prefill_spans(spans)
    ]
    return BatchLayout(spans, rows, reqs, blocks, prefill_only, varlen, masked)


def _general_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: ForwardMetadata, scale: float
) -> torch.Tensor:
    """Eager attention for batches with multi-token queries (prefill / chunked prefill / mixed).

    Multi-token queries of all requests go through one varlen FlashAttention call
    (:func:`varlen_causal_attention`, where :func:`varlen_available`) or one masked
    ``scaled_dot_product_attention`` call per group (:func:`group_prefill_spans`): keys gathered
    by slot from the paged cache, each query kept to its own request. Single-token queries go
    through the batched decode path. The layout and index tensors are built once per forward pass
    (:func:`batch_layout`) and cached on ``meta`` for the other layers.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    layout = getattr(meta, "_batch_layout", None)
    if layout is None:  # not a field: replace()d copies of meta start without it
        layout = meta._batch_layout = batch_layout(meta, q, block_size)
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)

    plan = layout.varlen
    if plan is not None:
        keys, values = k_flat.index_select(0, plan.slots), v_flat.index_select(0, plan.slots)
        if layout.prefill_only:  # every row is a prefill query, in order: no gather, no scatter
            attn = varlen_causal_attention(q.contiguous(), keys, values, plan, scale)
            return attn.reshape(num_tokens, num_heads * head_dim)
        out = torch.zeros_like(q)
        out.index_copy_(0, plan.rows, varlen_causal_attention(q.index_select(0, plan.rows), keys, values, plan, scale))
    else:
        out = torch.zeros_like(q)
        group = num_heads // num_kv_heads
        for masked in layout.masked:
            # [1, Hq, L, D] and [1, Hq, Tq, D]
            keys = k_flat.index_select(0, masked.slots).repeat_interleave(group, dim=1).transpose(0, 1)[None]
            values = v_flat.index_select(0, masked.slots).repeat_interleave(group, dim=1).transpose(0, 1)[None]
            query = q.index_select(0, masked.rows).transpose(0, 1)[None]
            with sdpa_kernel(MASKED_SDPA_BACKENDS):
                attn = F.scaled_dot_product_attention(
                    query, keys, values, attn_mask=masked.mask[None, None], scale=scale
                )
            out.index_copy_(0, masked.rows, attn[0].transpose(0, 1))

    if layout.decode_rows is not None:
        rows, reqs = layout.decode_rows, layout.decode_reqs
        out[rows] = _decode(
            q[rows], k_cache, v_cache, meta.block_table[reqs, : layout.decode_blocks], meta.seq_lens[reqs], scale
        )
    return out.reshape(num_tokens, num_heads * head_dim)
