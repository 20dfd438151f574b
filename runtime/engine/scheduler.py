"""Continuous batching: which sequences run in the next forward pass, and with how many tokens.

Policy (first come, first served, one token budget per step):

1. Running sequences, oldest first, each get ``min(uncomputed tokens, remaining budget)`` tokens:
   1 for a decode, a chunk for a prefill still in progress (chunked prefill). When the KV cache
   cannot hold a sequence's new tokens, the *youngest* running sequence is preempted (its blocks
   freed, its progress reset so it is recomputed later) until it fits; the sequence itself may be
   the youngest, in which case it waits.
2. If nothing was preempted, waiting sequences are admitted in arrival order while the token
   budget, ``max_num_seqs`` and the free blocks allow; the first that does not fit stops admission
   (no overtaking). Preempted sequences go back to the front of the waiting queue.

Multi-step decoding (``num_scheduler_steps`` in the engine limits): when every scheduled row is a
decode, the engine may run several decode steps for one schedule, feeding each sampled token back
on the device; :meth:`Scheduler.reserve_decode_steps` gives the rows the slots those steps need
(all or none, never by preemption) and :meth:`Scheduler.commit` records the extra cached tokens.

Prefix caching (:mod:`.prefix_cache`, when the block manager has it): a sequence admitted from the
waiting queue (new, or preempted) starts with the longest cached prefix of its full blocks, and its
prefill starts after it (``num_computed_tokens`` = the cached tokens; the token budget and the free
blocks count only the rest). The last token is always computed, since its logits sample the next
token: the lookup stops at the last *full block before* the last token (:func:`cacheable_blocks`),
so a prompt of exactly N full blocks, all cached, takes N - 1 of them and recomputes the last block
into a block of its own. Nothing ever writes into a shared block: shared blocks are full and lie
before ``num_computed_tokens``, and a sequence writes only from there on. A sequence computing prompt
log-probabilities needs the logits of every prompt position it has not scored yet, so it takes no
cached block from there on. A sequence's full blocks are registered in the cache as they fill
(:meth:`Scheduler.commit`: prompt blocks during prefill, generated ones during decode, once their
token ids are on the host) and when it finishes or is preempted; aborted ones (including every
sequence of a failed step) register nothing more.

Running out of KV blocks therefore never fails a request: it waits or is recomputed. Every
admitted sequence fits in the whole cache on its own (the engine caps ``max_model_len`` at the
cache's capacity), so the oldest running sequence always makes progress.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .prefix_cache import PrefixCacheStats, extend_block_hashes
from .sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSequence:
    """One row of the next batch: ``num_new_tokens`` tokens of ``seq`` from position ``start``."""

    seq: Sequence
    start: int
    num_new_tokens: int
    samples: bool
    """Whether this step reaches the sequence's last token, so a new token is sampled (never for a
    sequence with ``max_tokens`` 0: it finishes after its prefill)."""

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        return cls(seq, start, num_new_tokens, start + num_new_tokens == seq.num_tokens and seq.max_tokens > 0)

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass
class SchedulerOutput:
    """The batch of one step.

    Attributes:
        scheduled: rows of the batch, running sequences first (oldest first), then admissions.
        preempted: sequences preempted in this step (blocks freed, back in the waiting queue).
        admitted: sequences moved from the waiting queue into the running batch in this step, in
            admission order: new ones and preempted ones resuming (``num_preemptions`` > 0).
        prefix_cache_query_tokens: tokens of the admitted sequences looked up in the prefix cache
            (all their tokens; 0 with caching off).
        prefix_cache_hit_tokens: of those, tokens found cached (their prefill skipped).
        num_batched_tokens: total token rows (sum of ``num_new_tokens``).
    """

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """FCFS continuous-batching scheduler over a :class:`BlockManager`.

    Args:
        block_manager: owns the KV blocks.
        max_num_seqs: most sequences running at once (and rows in one batch).
        max_num_batched_tokens: most token rows in one forward pass.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache_query_tokens = 0
        self.prefix_cache_hit_tokens = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prefix-cache totals since this scheduler started (admissions' queries and hits, in
        tokens) and the blocks cached now."""
        bm = self.block_manager
        return PrefixCacheStats(enabled=bm.prefix_caching, query_tokens=self.prefix_cache_query_tokens,
                                hit_tokens=self.prefix_cache_hit_tokens, cached_blocks=bm.num_cached_blocks)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (at the back: FCFS).

        Raises:
            ValueError: the sequence can never fit in the KV cache, even alone.
        """
        longest = seq.num_prompt_tokens + seq.max_tokens
        if longest > self.block_manager.capacity_tokens:
            raise ValueError(
                f"sequence {seq.seq_id} may reach {longest} tokens, more than the KV cache holds "
                f"({self.block_manager.capacity_tokens})"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Remove every unfinished sequence of ``request_id``; free its blocks. Returns them, finished."""
        aborted = [s for s in self.waiting if s.request_id == request_id]
        aborted += [s for s in self.running if s.request_id == request_id]
        self.finish_all(aborted, FinishReason.ABORT)
        return aborted

    def finish_all(self, seqs: list[Sequence], reason: FinishReason) -> None:
        """:meth:`finish` for many sequences at once, in one pass over each queue (an aborted
        request with many sequences: one :meth:`finish` each would scan the waiting queue once per
        sequence, quadratic in the queue's length)."""
        if not seqs:
            return
        gone = set(map(id, seqs))
        self.running = [s for s in self.running if id(s) not in gone]
        self.waiting = deque(s for s in self.waiting if id(s) not in gone)
        for seq in seqs:
            self.block_manager.free(seq.seq_id)
            seq.finish(reason)

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """Mark ``seq`` finished, take it out of the queues, register its full blocks in the prefix
        cache and free its KV blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._cache_full_blocks(seq)
        self.block_manager.free(seq.seq_id)
        seq.finish(reason, stop_reason)

    def schedule(self) -> SchedulerOutput:
        """Choose the next batch and allocate the KV blocks its new tokens need."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        queue = list(self.running)
        i = 0
        while i < len(queue) and budget > 0:
            seq = queue[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            fits = True
            while not bm.can_allocate(seq.seq_id, seq.num_computed_tokens + num_new):
                victim = queue.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    fits = False
                    break
            if not fits:
                break
            bm.allocate(seq.seq_id, seq.num_computed_tokens + num_new)
            out.scheduled.append(ScheduledSequence.of(seq, num_new))
            budget -= num_new
            i += 1

        if not out.preempted:
            self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences in order, each after its cached prefix, while they fit."""
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = self._cached_prefix(seq)
            cached = len(hit) * bm.block_size
            num_new = min(seq.num_tokens - cached, budget)
            if not bm.can_allocate(seq.seq_id, cached + num_new, hit):
                break
            self.waiting.popleft()
            bm.allocate(seq.seq_id, cached + num_new, hit)
            seq.num_computed_tokens = cached
            if bm.prefix_caching:
                out.prefix_cache_query_tokens += seq.num_tokens
                out.prefix_cache_hit_tokens += cached
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)
            out.scheduled.append(ScheduledSequence.of(seq, num_new))
            budget -= num_new
        self.prefix_cache_query_tokens += out.prefix_cache_query_tokens
        self.prefix_cache_hit_tokens += out.prefix_cache_hit_tokens

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks a waiting sequence (no KV yet) starts with ([] with caching off)."""
        bm = self.block_manager
        if not bm.prefix_caching:
            return []
        n = cacheable_blocks(seq, bm.block_size)
        if n > len(seq.block_hashes):
            extend_block_hashes(seq.block_hashes, seq.token_ids, n, bm.block_size, seq.kv_extra_key)
        return bm.cached_prefix(seq.block_hashes[:n])

    def _cache_full_blocks(self, seq: Sequence) -> None:
        """Register ``seq``'s full blocks whose K/V is computed and whose token ids are known."""
        bm = self.block_manager
        if not bm.prefix_caching:
            return
        n = min(seq.num_computed_tokens, seq.num_tokens) // bm.block_size
        if n > len(seq.block_hashes):
            extend_block_hashes(seq.block_hashes, seq.token_ids, n, bm.block_size, seq.kv_extra_key)
        bm.cache_full_blocks(seq.seq_id, seq.block_hashes, n)

    def reserve_decode_steps(self, out: SchedulerOutput, num_steps: int | list[int]) -> bool:
        """Give every row of a uniform-decode batch KV slots for ``num_steps`` decode steps.

        Multi-step decoding runs ``num_steps`` forward passes for one schedule: step ``j`` writes
        the K/V of position ``row.start + j``, so each row needs slots up to ``row.start + num_steps``.
        A list gives each row its own count (speculative decoding: a row verifying ``n`` drafts
        writes ``n + 1`` positions in one pass). All rows get them, or none does (returns False and
        allocates nothing; the batch then runs a single step with the slots :meth:`schedule`
        already gave it). Never preempts.
        """
        bm = self.block_manager
        steps = _per_row(out, num_steps)
        needed = sum(bm.num_blocks_needed(r.seq.seq_id, r.start + n) for r, n in zip(out.scheduled, steps))
        if needed > bm.num_free_blocks:
            return False
        for row, n in zip(out.scheduled, steps):
            bm.allocate(row.seq.seq_id, row.start + n)
        return True

    def commit(self, out: SchedulerOutput, num_steps: int | list[int] = 1) -> None:
        """Record that the batch ran: each scheduled sequence's new tokens are now in the KV cache.

        With ``num_steps > 1`` (multi-step decoding, uniform-decode batches only) each row's next
        ``num_steps - 1`` sampled tokens were also fed back and cached. A list gives each row its
        own count: a verified row that emits ``a + 1`` tokens has the K/V of its last token and its
        ``a`` accepted drafts (runtime/engine/speculative.py); that of its rejected drafts lies past
        ``num_computed_tokens``, stale, never registered in the prefix cache, and overwritten later.
        """
        for row, n in zip(out.scheduled, _per_row(out, num_steps)):
            if row.seq.status is SequenceStatus.RUNNING:
                row.seq.num_computed_tokens = row.end + n - 1
                self._cache_full_blocks(row.seq)

    def _preempt(self, seq: Sequence) -> None:
        # Recompute: drop the KV blocks; prompt and outputs are prefilled again when readmitted
        # (from the prefix cache, as far as it still holds them).
        self.running.remove(seq)
        self._cache_full_blocks(seq)
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1


def _per_row(out: SchedulerOutput, num_steps: int | list[int]) -> list[int]:
    return [num_steps] * len(out.scheduled) if isinstance(num_steps, int) else num_steps


def cacheable_blocks(seq: Sequence, block_size: int) -> int:
    """How many leading full blocks of ``seq`` may come from the prefix cache (pure; module
    docstring): none past the block holding its last token (whose logits sample), none past the
    first prompt position whose prompt log-probability it has yet to compute."""
    limit = seq.num_tokens - 1
    if seq.prompt_logprobs and len(seq.prompt_logprobs) < seq.num_prompt_tokens:
        limit = min(limit, len(seq.prompt_logprobs) - 1)
    return max(0, limit) // block_size


def decode_steps(rows: list[ScheduledSequence], max_steps: int, *, admission_pending: bool) -> int:
    """How many decode steps to run for one schedule (multi-step decoding; pure).

    More than one only when every row is a decode that samples, needs no penalties (their token
    counts would change between the steps) and has no structured-output grammar (its mask for a
    step needs the previous step's token on the host), and no waiting request could be admitted (it would
    wait for the whole run). Never more than any row's remaining ``max_tokens``, so a length limit
    wastes no step; a stop token or string may still end a row early, and the rest of its steps
    are discarded.

    Args:
        rows: the scheduled batch.
        max_steps: ``EngineLimits.num_scheduler_steps``.
        admission_pending: a request is waiting and a batch slot is free.

    Returns:
        1 .. ``max_steps``.
    """
    if max_steps <= 1 or admission_pending or not rows:
        return 1
    if any(r.num_new_tokens != 1 or not r.samples or r.seq.params.needs_penalties or r.seq.matcher is not None
           for r in rows):
        return 1
    return max(1, min(max_steps, min(r.seq.max_tokens - r.seq.num_output_tokens for r in rows)))
