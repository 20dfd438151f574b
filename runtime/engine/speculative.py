"""Speculative decoding in the engine: which rows draft, the verification step, its bookkeeping.

A worker started with ``EngineLimits.speculative = "ngram:k"`` (``--speculative ngram:k``) gets a
:class:`SpeculativeDecoder`. For each uniform-decode batch (every row a decode that samples) it
asks the drafter for up to ``k`` tokens per row (:func:`max_drafts` caps them); when no row has a
draft, the batch runs as a plain decode (and multi-step decoding as without speculation). Otherwise
it runs one *verification batch* (:func:`verification_metadata`): ``R`` requests of ``k + 1`` token
rows each (the last token, then the drafts), ``ForwardMetadata.uniform_query_len = k + 1``, logits
for every row; a FULL graph of that query length replays it where one is captured
(runtime/graphs/runner.py). :func:`~.spec_decode.rejection.verify` keeps the accepted drafts and
the target's token after them, so a row emits ``a + 1`` tokens (``a`` accepted); the scheduler
commits ``a + 1`` positions (``Scheduler.commit``): the K/V of rejected drafts stays behind
``num_computed_tokens``, stale and overwritten later, never in the prefix cache. The engine's
output processing cuts the emitted run at EOS, stop tokens and strings, and ``max_tokens``.

Rows without drafts in a verification batch (and the positions a row did not draft) are padded:
input token 0, slot ``PAD_SLOT_ID`` (no K/V written), the position of the row's last real token,
draft :data:`~.spec_decode.drafter.PAD_DRAFT` (rejected by construction). Their logits are never
emitted.

Drafting stops where it cannot pay (:func:`max_drafts`, :func:`next_history`): requests with a
grammar (the allowed-token mask holds for the first position only), the last token before
``max_tokens``, and a request whose drafts were accepted at a rate below
:data:`MIN_ACCEPTANCE_RATE` over its last :data:`ACCEPTANCE_WINDOW` verifications, which then
decodes plainly for :data:`PAUSE_TOKENS` tokens (doubling with each low window in a row) before
it drafts again. A batch whose rows would
pass ``max_model_len`` with ``k + 1`` positions runs a plain decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from graphserving.contract.worker_config import EngineLimits
from ..model.forward_metadata import ForwardMetadata
from ..model.kv_layout import NULL_BLOCK, PAD_SLOT_ID
from .block_manager import BlockManager
from .model_runner import ModelRunner, RunOutput
from .sampler import SamplerOutput
from .scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from .spec_decode.acceptance import AcceptanceStats
from .spec_decode.drafter import DraftProposal, Drafter, DraftRequest
from .spec_decode.ngram import NgramDrafter
from .spec_decode.rejection import expand_sampling_tensors, verify

ACCEPTANCE_WINDOW = 4
"""Verifications with drafts over which a request's acceptance rate is judged (16 drafts at k = 4)."""

MIN_ACCEPTANCE_RATE = 0.25
"""Below this acceptance rate (accepted / proposed drafts over :data:`ACCEPTANCE_WINDOW`
verifications) a request stops drafting for :data:`PAUSE_TOKENS` tokens. At rate ``α`` a verification
emits ``1 + α + α² + ...`` tokens; at 0.25 that is about 1.33 for ``k >= 2``, which a verification
costing up to a third more than a decode step still breaks even on."""

PAUSE_TOKENS = 64
"""Tokens a low-acceptance request first decodes without drafts before it drafts (probes) again;
each further low window in a row doubles the pause (up to :data:`MAX_PAUSE_TOKENS`), a good one
resets it. A request that never accepts verifies 4 of its first 68 steps, 8 of 200, 12 of 460: a
verification costing ``c`` decode steps slows it by at most ``0.06 (c - 1)``, falling with its length
(under 3% for ``c <= 1.5`` from 200 tokens on)."""

MAX_PAUSE_TOKENS = 1024
"""The longest pause: a request whose text turns repetitive late still drafts within 1024 tokens."""


@dataclass(frozen=True)
class DraftHistory:
    """One request's recent drafting (``Sequence.draft_history``).

    Attributes:
        verifications / proposed / accepted: since the window started.
        paused_until: no drafts while the request has fewer output tokens than this.
        low_windows: windows in a row below :data:`MIN_ACCEPTANCE_RATE` (the pause doubles with each).
    """

    verifications: int = 0
    proposed: int = 0
    accepted: int = 0
    paused_until: int = 0
    low_windows: int = 0


def next_history(history: DraftHistory | None, proposed: int, accepted: int, num_output_tokens: int) -> DraftHistory:
    """The history after a verification that proposed and accepted these drafts (pure).

    A full window (:data:`ACCEPTANCE_WINDOW` verifications with drafts) below
    :data:`MIN_ACCEPTANCE_RATE` pauses drafting for ``PAUSE_TOKENS * 2 ** (low windows in a row - 1)``
    tokens (at most :data:`MAX_PAUSE_TOKENS`) from ``num_output_tokens``; a full window starts over
    either way.

    Args:
        num_output_tokens: the request's output tokens after this verification's.
    """
    h = history or DraftHistory()
    if proposed == 0:
        return h
    h = DraftHistory(h.verifications + 1, h.proposed + proposed, h.accepted + accepted, h.paused_until, h.low_windows)
    if h.verifications < ACCEPTANCE_WINDOW:
        return h
    if h.accepted >= MIN_ACCEPTANCE_RATE * h.proposed:
        return DraftHistory(paused_until=h.paused_until)
    pause = min(MAX_PAUSE_TOKENS, PAUSE_TOKENS << h.low_windows)
    return DraftHistory(paused_until=num_output_tokens + pause, low_windows=h.low_windows + 1)


def max_drafts(row: ScheduledSequence, k: int) -> int:
    """Drafts a decode row may propose (pure): ``k``, at most the tokens it has left after the
    step's own, 0 with a grammar or while its drafting is paused (module docstring)."""
    seq = row.seq
    history = seq.draft_history
    if seq.matcher is not None or (history is not None and seq.num_output_tokens < history.paused_until):
        return 0
    return max(0, min(k, seq.max_tokens - seq.num_output_tokens - 1))


def is_uniform_decode(rows: list[ScheduledSequence]) -> bool:
    """Every row decodes one token that samples (the only batches that speculate)."""
    return bool(rows) and all(r.num_new_tokens == 1 and r.samples and r.end == r.seq.num_tokens for r in rows)


def verification_metadata(rows: list[ScheduledSequence], drafts: list[list[int]], k: int,
                          bm: BlockManager) -> ForwardMetadata:
    """The host metadata of a verification batch: ``R`` requests of ``q = k + 1`` token rows.

    Row ``j`` of request ``r`` is its last token (``j = 0``) or draft ``j - 1`` at position
    ``start + j``; ``seq_lens = start + q``; every token row is in ``logits_indices``. Positions a
    request did not draft are padded (module docstring); block tables are padded with
    ``NULL_BLOCK`` to cover ``start + q`` positions.

    Args:
        rows: uniform-decode rows; their slots up to ``start + len(drafts) + 1`` are allocated.
        drafts: each row's drafts (at most ``k``).
    """
    q, bs = k + 1, bm.block_size
    ids, positions, slots, tables = [], [], [], []
    for row, d in zip(rows, drafts):
        seq, n = row.seq, len(d)
        ids += [seq.token_ids[row.start], *d, *[0] * (k - n)]
        positions += [row.start + min(j, n) for j in range(q)]
        slots += [*bm.slot_mapping(seq.seq_id, row.start, row.start + n + 1), *[PAD_SLOT_ID] * (k - n)]
        table = bm.block_table(seq.seq_id)
        tables.append(table + [NULL_BLOCK] * (math.ceil((row.start + q) / bs) - len(table)))
    width = max(len(t) for t in tables)
    seq_lens = [row.start + q for row in rows]
    num_reqs = len(rows)
    return ForwardMetadata(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_lens=torch.full((num_reqs,), q, dtype=torch.int32),
        query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32) * q,
        block_table=torch.tensor([t + [NULL_BLOCK] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        logits_indices=torch.arange(num_reqs * q, dtype=torch.int64),
        num_actual_tokens=num_reqs * q,
        num_actual_reqs=num_reqs,
        max_query_len=q,
        query_lens_cpu=[q] * num_reqs,
        seq_lens_cpu=seq_lens,
        uniform_query_len=q,
    )


@dataclass
class Verified:
    """A verification step: the run (one :class:`SamplerOutput` per draft position, tokens
    :data:`~.spec_decode.drafter.PAD_DRAFT` past a row's emitted ones) and each row's emitted
    token count."""

    result: RunOutput
    num_emitted: list[int]


class SpeculativeDecoder:
    """Drafts and verifies uniform-decode batches (module docstring).

    Args:
        drafter: proposes the drafts (``num_speculative_tokens`` is ``k``).
        max_model_len: the engine's context length (no row passes it).
        metrics: an ``EngineMetrics`` to count proposed and accepted drafts in, or None.

    Attributes:
        stats: acceptance totals since the engine started (the worker report's ``spec_decode``).
    """

    def __init__(self, drafter: Drafter, max_model_len: int, metrics=None):
        self.drafter = drafter
        self.k = drafter.num_speculative_tokens
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.stats = AcceptanceStats(self.k)

    @classmethod
    def from_limits(cls, limits: EngineLimits, max_model_len: int, metrics=None) -> SpeculativeDecoder | None:
        """The decoder ``limits.speculative`` asks for (``ngram:k``: :class:`NgramDrafter`), or None."""
        k = limits.num_speculative_tokens
        return cls(NgramDrafter(k), max_model_len, metrics) if k else None

    def launch(self, sched: SchedulerOutput, runner: ModelRunner, scheduler: Scheduler) -> Verified | None:
        """Verify ``sched``'s drafts and commit the emitted tokens' positions, or None (nothing
        run) when the batch is not uniform decode, no row drafts, a row would pass
        ``max_model_len``, or the KV cache has no slots for the drafts. Waits for the device (the
        emitted counts decide the next step's input)."""
        rows = sched.scheduled
        if not is_uniform_decode(rows) or any(r.start + self.k + 1 > self.max_model_len for r in rows):
            return None
        limits = [max_drafts(r, self.k) for r in rows]
        if not any(limits):
            return None
        requests = [DraftRequest(r.seq.token_ids, n, r.seq.seed, r.seq.num_output_tokens) for r, n in zip(rows, limits)]
        proposal = self.drafter.propose(requests, "cpu")
        num_drafts = proposal.num_drafts.tolist()
        if not any(num_drafts) or not scheduler.reserve_decode_steps(sched, [n + 1 for n in num_drafts]):
            return None
        drafts = [d[:n] for d, n in zip(proposal.token_ids.tolist(), num_drafts)]
        out = self._verify(runner, rows, drafts, proposal)
        num_accepted, num_emitted = out.num_accepted.tolist(), out.num_emitted.tolist()
        scheduler.commit(sched, num_emitted)
        self._observe(rows, num_drafts, num_accepted)
        sampled = [SamplerOutput(
            token_ids=out.token_ids[:, j],
            logprobs=None if out.logprobs is None else out.logprobs[:, j],
            top_token_ids=None if out.top_token_ids is None else out.top_token_ids[:, j],
            top_logprobs=None if out.top_logprobs is None else out.top_logprobs[:, j],
        ) for j in range(self.k + 1)]
        return Verified(RunOutput(list(rows), sampled), num_emitted)

    def _verify(self, runner: ModelRunner, rows: list[ScheduledSequence], drafts: list[list[int]],
                proposal: DraftProposal):
        """One forward pass of the verification batch and :func:`verify` (a ``VerifyOutput``)."""
        meta = verification_metadata(rows, drafts, self.k, runner.block_manager)
        logits = runner.execute_model(meta)
        device = logits.device
        proposal = replace(proposal, token_ids=proposal.token_ids.to(device), num_drafts=proposal.num_drafts.to(device),
                           probs=None if proposal.probs is None else proposal.probs.to(device))
        sampling = runner.with_grammar_mask(runner.sampling_tensors([r.seq for r in rows]), rows)
        with torch.inference_mode():
            t_rows = expand_sampling_tensors(sampling, proposal.token_ids, proposal.num_drafts, runner.vocab_size)
            return verify(logits, t_rows, proposal)

    def _observe(self, rows: list[ScheduledSequence], num_drafts: list[int], num_accepted: list[int]) -> None:
        """Count the step in :attr:`stats` and the metrics; update each row's draft history."""
        self.stats.observe(num_drafts, num_accepted)
        if self.metrics is not None:
            self.metrics.observe_spec_decode(num_drafts, num_accepted)
        for row, n, a in zip(rows, num_drafts, num_accepted):
            seq = row.seq
            seq.draft_history = next_history(seq.draft_history, n, a, seq.num_output_tokens + a + 1)
