"""Canary: prove every captured graph equal to eager execution before the worker takes traffic.

For each captured key the canary builds a fresh batch of random tokens over random KV-cache
contents (in blocks borrowed from the allocator, never a live sequence's; for a FULL key of query
length ``k + 1`` a speculative verification batch), runs it eagerly and by replay, and compares
the logits:

- relative logit error: ``max|graph - eager| / max|eager|`` over the compared rows;
- top-1 agreement: over rows whose eager top-1/top-2 margin exceeds ``min_top1_margin`` (rows
  with a smaller margin may flip legitimately under different reduction orders; vLLM's tests
  accept flips below a margin of about 0.7, docs/architecture.md, "Public facts behind the defaults"), the fraction
  whose argmax agrees. It must be 1.

The error bound is ``max_relative_logit_error`` for float32 and
``max_relative_logit_error_16bit`` for bfloat16/float16 (CanaryThresholds in the worker config).

KV blocks. The canary's batches need KV blocks of their own (:func:`canary_blocks_needed`), and
it runs between engine steps: at start-up before serving, and in a recapture on the engine's loop
thread. No request can finish while it runs, so a canary that *waits* for requests to free blocks
would wait on itself, and one that *preempts* them would make live requests recompute their
prefill to prove a graph. The lifecycle therefore *reserves* the blocks when it sizes the KV cache
(:func:`canary_reserve`, ``BlockManager.reserve``), never handed to requests: a canary batch of the
largest keys that can ever be configured (the scheduler maxima, which every graph configuration
captures and none may exceed), about ``max(2 * max_num_seqs, max_num_batched_tokens / block_size)``
blocks (``(ceil((k + 1) / block_size) + 1) * max_num_seqs`` for verification keys of ``k`` draft
tokens, :func:`canary_blocks_needed`), one token budget's worth of KV, a small part of a GPU's
cache. A cache too small to spare them gets fewer (it keeps room for one sequence of
``max_model_len``); the canary then borrows the rest from the free blocks, and a key left with no
block at all raises :class:`CanaryCapacityError`: a capacity shortfall the lifecycle retries, never
a divergence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from graphserving.contract.worker_config import CanaryThresholds
from ..model.forward_metadata import ForwardMetadata
from .key import GraphKey, GraphRuntimeMode


class CanaryCapacityError(ValueError):
    """Too few KV blocks to build a canary batch for a key: a capacity shortfall, not a divergence."""


@dataclass
class CanaryResult:
    """The comparison of one key's replay against eager execution on the same inputs."""

    key: GraphKey
    passed: bool
    relative_error: float
    top1_agreement: float
    rows_compared: int
    rows_above_margin: int
    min_margin: float
    replay_seconds: float
    eager_seconds: float
    reason: str | None = None


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    block_ids: list[int],
    block_size: int,
    vocab_size: int,
    device: torch.device,
    generator: torch.Generator,
    *,
    sample_rows: int | None = None,
) -> ForwardMetadata:
    """A batch of random tokens for requests with the given query and context lengths.

    Each request gets its own consecutive blocks from ``block_ids`` (so no two tokens write one
    slot) and its tokens sit at positions ``context .. context + query - 1``.

    Args:
        query_lens / context_lens: per request, tokens in this step / tokens already cached.
        block_ids: borrowed KV blocks, never a live sequence's.
        sample_rows: how many rows get logits: the last token of each request, plus evenly spaced
            token rows up to this many (None: the last token of each request only).

    Raises:
        CanaryCapacityError: the requests need more blocks than ``block_ids`` holds.
    """
    needed = [math.ceil((c + q) / block_size) for q, c in zip(query_lens, context_lens)]
    if sum(needed) > len(block_ids):
        raise CanaryCapacityError(f"canary batch needs {sum(needed)} KV blocks, {len(block_ids)} available")
    width = max(needed)
    tables, slots, positions, starts = [], [], [], [0]
    cursor = 0
    for q, c, k in zip(query_lens, context_lens, needed):
        blocks = block_ids[cursor : cursor + k]
        cursor += k
        tables.append(blocks + [0] * (width - k))
        for p in range(c, c + q):
            positions.append(p)
            slots.append(blocks[p // block_size] * block_size + p % block_size)
        starts.append(starts[-1] + q)
    last_rows = [s - 1 for s in starts[1:]]
    rows = set(last_rows)
    if sample_rows and sample_rows > len(rows):
        step = max(1, starts[-1] // (sample_rows - len(rows)))
        rows.update(range(0, starts[-1], step))
    num_tokens = starts[-1]
    i32 = dict(dtype=torch.int32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    return ForwardMetadata(
        input_ids=torch.randint(0, vocab_size, (num_tokens,), generator=generator).to(device),
        positions=torch.tensor(positions, **i64),
        seq_lens=torch.tensor(seq_lens, **i32),
        query_lens=torch.tensor(query_lens, **i32),
        query_start_loc=torch.tensor(starts, **i32),
        block_table=torch.tensor(tables, **i32),
        slot_mapping=torch.tensor(slots, **i64),
        logits_indices=torch.tensor(sorted(rows), **i64),
        num_actual_tokens=num_tokens,
        num_actual_reqs=len(query_lens),
        max_query_len=max(query_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
    )


def randomize_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], generator: torch.Generator) -> None:
    """Fill the given blocks of every layer with random K/V (a context worth attending to).

    The noise is drawn on the caches' device, from a device generator seeded by one draw of
    ``generator`` (reproducible for a seeded ``generator``; drawing hundreds of millions of
    values on the host and copying them made a canary of every default key take minutes).
    """
    if not block_ids or not kv_caches:
        return
    device = kv_caches[0].device
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    noise_gen = torch.Generator(device=device).manual_seed(seed)
    index = torch.tensor(block_ids, dtype=torch.int64).to(device)
    for cache in kv_caches:
        shape = (cache.shape[0], len(block_ids), *cache.shape[2:])
        noise = torch.randn(shape, generator=noise_gen, device=device, dtype=torch.float32)
        cache.index_copy_(1, index, noise.to(cache.dtype))


def canary_batch_for(
    key: GraphKey,
    block_ids: list[int],
    block_size: int,
    vocab_size: int,
    max_model_len: int,
    device: torch.device,
    generator: torch.Generator,
) -> ForwardMetadata:
    """A fresh batch for ``key``, filling it exactly when enough blocks are borrowed.

    FULL keys: ``num_reqs`` requests of the key's query length q, each with a random context (its
    rows and context within ``ceil(q / block_size) + 1`` blocks: up to 2 for decode; bounded by the
    borrowed blocks and ``max_model_len``); for q > 1 a verification batch (ForwardMetadata
    ``uniform_query_len``, logits for every token row), so the eager pass runs the same
    verification attention the graph captured. PIECEWISE keys: ``num_tokens`` token rows split
    into prefill chunks plus single-token decode rows (a mixed batch). No request is longer than
    ``max_model_len`` (the model's position table ends there), so a key with more tokens than that
    gets several chunks; a single chunk also gets a cached context of one block. With fewer
    borrowed blocks than that needs (a recapture while requests hold most of the KV cache), the
    batch is smaller and the replay pads it to the key.

    Raises:
        CanaryCapacityError: no block was borrowed at all, or too few for one request of the
            key's query length.
    """
    budget = len(block_ids)
    if budget < 1:
        raise CanaryCapacityError("no free KV blocks to borrow for a canary batch")
    if key.mode is GraphRuntimeMode.FULL:
        return _uniform_batch(key, block_ids, block_size, vocab_size, max_model_len, device, generator)
    t = key.num_tokens
    decodes = min(t - 1, 3, budget - 1)
    # tokens the chunks' own blocks can hold: a chunk shorter than a block (max_model_len below
    # block_size) still takes a block of its own
    room = (budget - decodes) * min(block_size, max_model_len)
    chunks = prefill_chunks(t - decodes, max_model_len, block_size)
    # a lone chunk's cached context: up to one block, bounded by the model length and the room
    context = min(block_size, max(0, max_model_len - chunks[0])) if len(chunks) == 1 else 0
    if context + sum(chunks) > room:  # few free blocks: shorter chunks without context, padded to the key
        context, chunks = 0, prefill_chunks(max(1, min(t - decodes, room)), max_model_len, block_size)
    contexts = [context] + [0] * (len(chunks) - 1)
    # a decode row's context stays within one block and the model length
    contexts += [int(x) for x in torch.randint(0, min(block_size, max_model_len), (decodes,), generator=generator)]
    return make_batch(
        chunks + [1] * decodes, contexts, block_ids, block_size, vocab_size, device, generator, sample_rows=64
    )


def _uniform_batch(
    key: GraphKey, block_ids: list[int], block_size: int, vocab_size: int, max_model_len: int,
    device: torch.device, generator: torch.Generator,
) -> ForwardMetadata:
    """:func:`canary_batch_for` of a FULL key: requests of ``q = key.uniform_query_len`` rows."""
    q, budget = key.uniform_query_len, len(block_ids)
    own = math.ceil(q / block_size)  # the blocks a request's q rows need without context
    # Fewer free blocks than rows (a recapture under load): fewer real rows, padded to the key.
    n = min(key.num_reqs, budget // own)
    if n < 1:
        raise CanaryCapacityError(f"a request of {q} query rows needs {own} KV blocks, {budget} available")
    per_row = max(own, min(own + 1, budget // n))
    longest = min(per_row * block_size, max_model_len) - q
    contexts = torch.randint(0, max(longest, 0) + 1, (n,), generator=generator).tolist()
    meta = make_batch([q] * n, contexts, block_ids, block_size, vocab_size, device, generator)
    if q == 1:
        return meta
    every_row = torch.arange(meta.num_tokens, dtype=torch.int64, device=device)
    return replace(meta, logits_indices=every_row, uniform_query_len=q)


def canary_blocks_needed(key: GraphKey, block_size: int, max_model_len: int) -> int:
    """KV blocks with which :func:`canary_batch_for` fills ``key`` completely (pure).

    FULL: ``num_reqs`` requests of ``q`` rows whose rows and contexts take up to
    ``ceil(q / block_size) + 1`` blocks each (2 for decode; ``ceil(max_model_len / block_size)``
    when that is fewer). PIECEWISE: up to 3 single-token decode rows (a block each) plus the prefill
    chunks and a lone chunk's one block of cached context (:func:`prefill_chunks`). With fewer
    blocks the batch gets fewer rows or shorter contexts (the replay pads it to the key).
    """
    if key.mode is GraphRuntimeMode.FULL:
        own = math.ceil(key.uniform_query_len / block_size)
        return key.num_reqs * max(own, min(own + 1, math.ceil(max_model_len / block_size)))
    decodes = min(key.num_tokens - 1, 3)
    chunks = prefill_chunks(key.num_tokens - decodes, max_model_len, block_size)
    context = min(block_size, max(0, max_model_len - chunks[0])) if len(chunks) == 1 else 0
    contexts = [context] + [0] * (len(chunks) - 1)
    return decodes + sum(math.ceil((c + q) / block_size) for q, c in zip(chunks, contexts))


def canary_reserve(
    largest_keys: list[GraphKey], *, block_size: int, max_model_len: int, usable_blocks: int
) -> int:
    """KV blocks to reserve for the canary when the KV cache is sized (pure; module docstring, "KV blocks").

    The most :func:`canary_blocks_needed` of ``largest_keys`` (keys run one at a time over the
    same blocks), at most what the cache holds beyond one sequence of ``max_model_len`` tokens (so
    the engine's ``max_model_len`` stays servable); 0 when it holds no more than that.

    Args:
        largest_keys: the largest FULL and PIECEWISE keys any graph configuration may have (the
            scheduler maxima ``max_num_seqs`` and ``max_num_batched_tokens``).
        block_size: tokens per block; max_model_len: the engine's longest sequence, in tokens.
        usable_blocks: blocks sequences could get without the reserve (the null block excluded).
    """
    needed = max((canary_blocks_needed(k, block_size, max_model_len) for k in largest_keys), default=0)
    return max(0, min(needed, usable_blocks - math.ceil(max_model_len / block_size)))


def prefill_chunks(tokens: int, max_model_len: int, block_size: int) -> list[int]:
    """Split ``tokens`` prefill rows into requests of at most ``max_model_len`` tokens each.

    Pure. Every chunk but the last is a whole number of blocks long (the largest such length that
    fits ``max_model_len``), so the chunks need no more blocks than ``ceil(tokens / block_size)``;
    with ``max_model_len < block_size`` every chunk (``max_model_len`` tokens) takes a block of its
    own: ``ceil(tokens / max_model_len)`` blocks.
    """
    cap = max_model_len if max_model_len < block_size else (max_model_len // block_size) * block_size
    return [min(cap, tokens - start) for start in range(0, tokens, cap)]


def compare_logits(
    key: GraphKey,
    eager: torch.Tensor,
    graph: torch.Tensor,
    thresholds: CanaryThresholds,
    dtype: torch.dtype,
    replay_seconds: float = 0.0,
    eager_seconds: float = 0.0,
) -> CanaryResult:
    """Judge one key from its eager and replayed logits (float32 [S, vocab] each)."""
    eager = eager.float()
    graph = graph.float()
    scale = eager.abs().max().clamp_min(1e-6)
    rel = float((graph - eager).abs().max() / scale)
    top2 = eager.topk(2, dim=-1).values
    margins = top2[:, 0] - top2[:, 1]
    confident = margins > thresholds.min_top1_margin
    disagree = eager.argmax(-1) != graph.argmax(-1)
    checked = int(confident.sum())
    # counted in integers: a float mean of all-agreeing rows can come out below 1 (a CUDA mean
    # multiplies by 1/N: 61 * (1/61) is 0.99999994 in float32) and fail a graph that agrees
    flipped = int((disagree & confident).sum())
    agreement = (checked - flipped) / checked if checked else 1.0
    bound = (
        thresholds.max_relative_logit_error
        if dtype == torch.float32
        else thresholds.max_relative_logit_error_16bit
    )
    reason = None
    if not math.isfinite(rel):
        reason = "non-finite logits in replay"
    elif rel > bound:
        reason = f"relative logit error {rel:.3g} > {bound:.3g}"
    elif flipped:
        reason = (f"top-1 token differs on {flipped} of {checked} rows with margin > {thresholds.min_top1_margin} "
                  f"(agreement {agreement:.4f} < 1)")
    return CanaryResult(
        key=key,
        passed=reason is None,
        relative_error=rel,
        top1_agreement=agreement,
        rows_compared=int(eager.shape[0]),
        rows_above_margin=checked,
        min_margin=float(margins.min()) if margins.numel() else 0.0,
        replay_seconds=replay_seconds,
        eager_seconds=eager_seconds,
        reason=reason,
    )


def run_canary(
    runner,
    key: GraphKey,
    block_ids: list[int],
    block_size: int,
    max_model_len: int,
    thresholds: CanaryThresholds,
    generator: torch.Generator,
) -> CanaryResult:
    """Replay ``key`` of a :class:`~graphserving.runtime.graphs.runner.GraphRunner` on a fresh
    batch and compare with eager execution of the same batch.

    Eager runs first; both passes write identical K/V to the same borrowed slots, so the replay
    sees the same cache contents.
    """
    import time

    meta = canary_batch_for(
        key, block_ids, block_size, runner.model.config.vocab_size, max_model_len, runner.device, generator
    )
    # only the blocks the batch reads: a key needs far fewer than the borrowed ones
    used = sorted(set(meta.block_table.flatten().tolist()).intersection(block_ids))
    runner.randomize_blocks(used, generator)  # on every rank under tensor parallelism
    runner.backend.synchronize()
    start = time.perf_counter()
    eager = runner.run_eager(meta)
    runner.backend.synchronize()
    middle = time.perf_counter()
    graph = runner.replay(key, meta)
    runner.backend.synchronize()
    end = time.perf_counter()
    return compare_logits(key, eager, graph, thresholds, runner.dtype, end - middle, middle - start)
