"""Speculative decoding in the engine: which rows draft, the verification step, its bookkeeping.

A worker started with ``EngineLimits.speculative = "ngram:k"`` (``--speculative ngram:k``) gets a
:class:`SpeculativeDecoder`. Where multi-step decoding is allowed and no row needs penalties,
log-probabilities or a grammar (:func:`runs_resident`), a uniform-decode batch with a row that may
draft runs several verification steps on the device without a host round trip
(:meth:`SpeculativeDecoder.launch_resident`, spec_decode/resident.py; continued pipelined by
:meth:`SpeculativeDecoder.continue_resident`, settled by :meth:`SpeculativeDecoder.settle`). Other
uniform-decode batches are verified one step at a time from the host
(:meth:`SpeculativeDecoder.launch`): the drafter proposes up to ``k`` tokens per row
(:func:`max_drafts` caps them); when no row has a draft or verifying does not pay, the batch runs
as a plain decode (and multi-step decoding as without speculation, continued while verifying does
not pay, :meth:`SpeculativeDecoder.may_continue_plain`). Otherwise
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

A row drafts nothing with a grammar (the allowed-token mask holds for the first position only)
or on its last token before ``max_tokens`` (:func:`max_drafts`); a batch verifies only where it
pays (spec_decode/policy.py): its requests' expected accepted drafts, from their recent real or
shadow windows, against what a verification pass costs in decode steps at that batch size, timed
on the device as the engine runs (spec_decode/costs.py). A batch whose rows would pass
``max_model_len`` with ``k + 1`` positions runs a plain decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from graphserving.contract.worker_config import EngineLimits
from ..model.forward_metadata import ForwardMetadata
from ..model.kv_layout import NULL_BLOCK, PAD_SLOT_ID
from .block_manager import BlockManager
from .model_runner import DecodeRun, HostSamples, ModelRunner, RunOutput
from .sampler import SamplerOutput, sample
from .scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from .spec_decode.acceptance import AcceptanceStats
from .spec_decode.costs import DECODE, VERIFY, PassCosts
from .spec_decode.drafter import DraftProposal, Drafter, DraftRequest
from .spec_decode.ngram import NgramDrafter
from .spec_decode.policy import (ACCEPTANCE_WINDOW, expected_acceptance, next_history, shadow_due, shadow_review,
                                 verification_pays)
from .spec_decode.rejection import expand_sampling_tensors, verify
from .spec_decode.resident import SpecState, advance, extend, initial_state

def max_drafts(row: ScheduledSequence, k: int, after: int = 0) -> int:
    """Drafts a decode row may propose (pure): ``k``, at most the tokens it has left after the
    step's own, 0 with a grammar (module docstring); ``after``: once ``after`` more tokens are
    decoded. Whether its batch verifies at all is :func:`~.spec_decode.policy.verification_pays`'s
    decision."""
    seq = row.seq
    if seq.matcher is not None or seq.is_finished:
        return 0
    return max(0, min(k, seq.max_tokens - seq.num_output_tokens - after - 1))


def probing(row: ScheduledSequence) -> bool:
    """Whether a row that may draft has not been judged by a window yet (real or shadow,
    spec_decode/policy.py). A resident run with such a row is one window long and is not
    continued: the host judges the window before more verification steps are queued, so a request
    whose drafts fail costs one window of real verifications, its first."""
    history = row.seq.draft_history
    return history is None or history.acceptance is None


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


def runs_resident(rows: list[ScheduledSequence]) -> bool:
    """Whether a uniform-decode batch may verify on the device for several steps
    (spec_decode/resident.py): no row needs penalties (their counts would change between the
    steps), log-probabilities or a grammar (its mask needs the host after every token)."""
    return all(not r.seq.params.needs_penalties and r.seq.params.logprobs is None and r.seq.matcher is None
               for r in rows)


@dataclass
class ResidentRun:
    """Verification steps queued on the device by :meth:`SpeculativeDecoder.launch_resident`.

    Attributes:
        rows: the batch (every row samples).
        state: the device state (spec_decode/resident.py).
        decode: the batch's device metadata and replay (a verification key's static buffers, or
            the run's own copy), as a multi-step decode run holds them.
        num_steps: verification steps queued.
        host: the emitted tokens on their way to pinned host memory, int64 [C, R] (row ``r``'s
            first ``out_len[r]`` entries of column ``r``).
        counts: pinned int64 [1 + 2 * num_steps, R]: ``out_len``, then drafts proposed and accepted
            per step (valid once ``host.ready`` has fired).
        drafting: the rows that may draft in the run (host copy of ``state.enabled``).
    """

    rows: list[ScheduledSequence]
    state: SpecState
    decode: DecodeRun
    num_steps: int
    host: HostSamples
    counts: torch.Tensor
    drafting: list[bool]


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
        costs: device time per step of timed decode and verification runs (spec_decode/costs.py).
    """

    def __init__(self, drafter: Drafter, max_model_len: int, metrics=None):
        self.drafter = drafter
        self.k = drafter.num_speculative_tokens
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.stats = AcceptanceStats(self.k)
        self.costs = PassCosts()

    @classmethod
    def from_limits(cls, limits: EngineLimits, max_model_len: int, metrics=None) -> SpeculativeDecoder | None:
        """The decoder ``limits.speculative`` asks for (``ngram:k``: :class:`NgramDrafter`), or None."""
        k = limits.num_speculative_tokens
        return cls(NgramDrafter(k), max_model_len, metrics) if k else None

    def launch(self, sched: SchedulerOutput, runner: ModelRunner, scheduler: Scheduler) -> Verified | None:
        """Verify ``sched``'s drafts and commit the emitted tokens' positions, or None (nothing
        run) when the batch is not uniform decode, verifying it does not pay (:meth:`pays`), no
        row drafts, a row would pass ``max_model_len``, or the KV cache has no slots for the drafts.
        Waits for the device (the
        emitted counts decide the next step's input)."""
        rows = sched.scheduled
        if not is_uniform_decode(rows) or any(r.start + self.k + 1 > self.max_model_len for r in rows):
            return None
        self.review(rows)
        limits = [max_drafts(r, self.k) for r in rows]
        if not self.pays(rows, limits):
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

    def launch_resident(self, sched: SchedulerOutput, runner: ModelRunner, scheduler: Scheduler,
                        num_steps: int) -> ResidentRun | None:
        """Queue ``num_steps`` verification steps of ``sched`` on the device (spec_decode/resident.py),
        or None (nothing queued) when the batch is not uniform decode, a row cannot run resident
        (:func:`runs_resident`), verifying it does not pay (:meth:`pays`), a row would pass
        ``max_model_len``, or the KV cache has no slots for the run. Does not wait for the device;
        :meth:`settle` commits the run once its tokens are on the host.

        KV slots are reserved for ``min(num_steps * (k + 1), remaining tokens)`` positions per
        row, the most a run can write; a row's step never goes past its ``max_tokens``.
        """
        rows, k = sched.scheduled, self.k
        q = k + 1
        if not isinstance(self.drafter, NgramDrafter) or not is_uniform_decode(rows) or not runs_resident(rows):
            return None
        self.review(rows)
        limits = [max_drafts(r, k) for r in rows]
        num_steps = min(num_steps, *((self.max_model_len - r.start) // q for r in rows))
        if any(n and probing(r) for r, n in zip(rows, limits)):
            num_steps = min(num_steps, ACCEPTANCE_WINDOW)
        if num_steps < 1 or not self.pays(rows, limits):
            return None
        seqs = [r.seq for r in rows]
        remaining = [s.max_tokens - s.num_output_tokens for s in seqs]
        if not scheduler.reserve_decode_steps(sched, [min(num_steps * q, n) for n in remaining]):
            return None
        bm = runner.block_manager
        meta, replay, resident = runner.resident_metadata(verification_metadata(rows, [[] for _ in rows], k, bm))
        if not resident:
            spans = [(r.start, num_steps * q, n) for r, n in zip(rows, remaining)]
            meta = _cover_reads_of(meta, spans, q, bm.block_size, runner.device)
        with torch.inference_mode():
            state = initial_state([s.token_ids for s in seqs], remaining, [s.num_output_tokens for s in seqs],
                                  [n > 0 for n in limits], k, num_steps, runner.device)
            t_rows = expand_sampling_tensors(runner.sampling_tensors(seqs), state.drafts, state.num_drafts,
                                             runner.vocab_size)
            decode = DecodeRun(meta, replay, resident, [s.seq_id for s in seqs],
                               [len(bm.block_table(s.seq_id)) for s in seqs], t_rows, state.lens,
                               runner.graph_generation())
            return self._run(list(rows), state, decode, num_steps, runner, [n > 0 for n in limits], timed=False)

    def continue_resident(self, run: ResidentRun, runner: ModelRunner, scheduler: Scheduler,
                          num_steps: int) -> ResidentRun | None:
        """Queue ``num_steps`` more verification steps of ``run``'s batch before ``run`` is settled
        (its tokens processed), from its device state, or None (nothing queued).

        The caller has checked that nothing could change the batch (no queued command or
        admission); rows already finished are retired first. ``run``'s emitted counts are not known
        yet, so each row gets KV slots for both runs' most (``(run.num_steps + num_steps) * (k + 1)``
        positions from its committed ones, at most its remaining tokens); None when the cache has
        none to give, the device state is stale (a recapture) or no row can pass ``run``.
        """
        q = self.k + 1
        seqs = [row.seq for row in run.rows]
        bound = [0 if s.is_finished else s.max_tokens - s.num_output_tokens for s in seqs]
        after = [n - run.num_steps for n in bound]  # every live step emits at least one token
        num_steps = min(num_steps, *((self.max_model_len - s.num_computed_tokens) // q - run.num_steps for s in seqs))
        if any(d and not s.is_finished and probing(r) for d, s, r in zip(run.drafting, seqs, run.rows)):
            return None
        drafting = [d and not s.is_finished and max_drafts(r, self.k) > 0
                    for d, s, r in zip(run.drafting, seqs, run.rows)]
        if (not self.pays(run.rows, drafting, run.num_steps) or not runner.can_continue(run.decode) or max(after) <= 0
                or num_steps < 1):
            return None  # verifying does not pay any more: plain multi-step takes over
        live = [i for i, s in enumerate(seqs) if not s.is_finished]
        sched = SchedulerOutput([ScheduledSequence(seqs[i], seqs[i].num_computed_tokens, 1, True) for i in live])
        if not scheduler.reserve_decode_steps(sched, [min((run.num_steps + num_steps) * q, bound[i]) for i in live]):
            return None
        decode = run.decode
        with torch.inference_mode():
            retire = [i for i, s in enumerate(seqs) if s.is_finished and i not in decode.retired]
            if retire:
                run.state.remaining.index_fill_(0, torch.tensor(retire, device=runner.device), 0)
                decode.retired.update(retire)
            stopped = [i for i, (was, now) in enumerate(zip(run.drafting, drafting)) if was and not now]
            if stopped:
                run.state.enabled.index_fill_(0, torch.tensor(stopped, device=runner.device), 0)
            runner.refresh_block_tables(decode)
            _cover_reads(decode, [(s.num_computed_tokens, (run.num_steps + num_steps) * q, n)
                                  for s, n in zip(seqs, bound)], q, runner)
            longest = max(s.num_computed_tokens + 1 for s in seqs) + (run.num_steps + num_steps) * q
            state = extend(run.state, num_steps, longest)
            return self._run(run.rows, state, decode, num_steps, runner, drafting, timed=True)

    def _run(self, rows: list[ScheduledSequence], state: SpecState, decode: DecodeRun, num_steps: int,
             runner: ModelRunner, drafting: list[bool], timed: bool) -> ResidentRun:
        """Queue the steps: the first pass's drafts and inputs (for a continuation: again, after its
        retirements and new blocks), then pass, sample and :func:`advance` ``num_steps`` times.
        ``timed``: a continuation, queued while the device is busy, so its events measure device
        time as a plain continuation's do (a first run starts on an idle device)."""
        q, block_size = self.k + 1, runner.block_manager.block_size
        ngram = (self.drafter.min_n, self.drafter.max_n)
        meta, t_rows = decode.meta, decode.sampling
        position = torch.arange(q, device=runner.device).repeat(len(rows))
        with self.costs.timing(VERIFY, len(rows), num_steps if timed else 0, runner.device):
            advance(meta, state, None, 0, block_size, *ngram)
            for step in range(num_steps):
                logits = decode.replay(meta)
                t = replace(t_rows, steps=state.steps.repeat_interleave(q) + position)
                advance(meta, state, sample(logits, t).token_ids.view(len(rows), q), step, block_size, *ngram)
        host, counts = _stage_resident(state)
        return ResidentRun(rows, state, decode, num_steps, host, counts, drafting)

    def review(self, rows: list[ScheduledSequence]) -> None:
        """Judge each live row that has decoded :data:`~.spec_decode.policy.SHADOW_INTERVAL`
        tokens without verifying by a shadow window (:func:`~.spec_decode.policy.shadow_review`).
        Only a drafter that is ``host_replayable`` (``drafter.Drafter``: prompt lookup drafts in a few
        host scans of the context; a draft model's proposal is a device pass, and a request it
        judged low is not reviewed)."""
        if not getattr(self.drafter, "host_replayable", False):
            return
        for row in rows:
            seq = row.seq
            if not seq.is_finished and seq.matcher is None and shadow_due(seq.draft_history, seq.num_output_tokens):
                seq.draft_history = shadow_review(seq.draft_history, seq.token_ids, seq.num_output_tokens, self.drafter)

    def pays(self, rows: list[ScheduledSequence], limits: list[int], after: int = 0) -> bool:
        """Whether verifying the batch pays (:func:`~.spec_decode.policy.verification_pays`): the
        expected acceptance of the rows that will still decode (0 where ``limits`` allows no
        draft) against the measured cost of a pass at ``len(rows)`` rows (retired rows are computed
        too). ``after``: steps already queued for the batch; a row they finish emits nothing either
        way and does not count."""
        live = [(r, n) for r, n in zip(rows, limits)
                if not r.seq.is_finished and r.seq.max_tokens - r.seq.num_output_tokens > after]
        expected = [expected_acceptance(r.seq.draft_history) if n else 0.0 for r, n in live]
        return verification_pays(expected, self.costs.ratio(len(rows)))

    def may_continue_plain(self, rows: list[ScheduledSequence], after: int) -> bool:
        """Whether a plain multi-step run of the batch may continue after the ``after`` steps queued:
        verifying it does not pay then (after :meth:`review`; each row's drafts as it will stand)."""
        self.review(rows)
        limits = [max_drafts(r, self.k, after) for r in rows]
        return not self.pays(rows, limits, after)

    def timing_decode(self, rows: int, num_steps: int, device: torch.device):
        """A context timing a plain multi-step decode run of ``rows`` rows (spec_decode/costs.py)."""
        return self.costs.timing(DECODE, rows, num_steps, device)

    def settle(self, run: ResidentRun, scheduler: Scheduler) -> list[int]:
        """Wait for a resident run's tokens, commit each row's emitted positions, count the steps'
        drafts (stats, metrics, draft histories); returns each row's emitted token count."""
        run.host.ready is not None and run.host.ready.synchronize()
        counts = run.counts.tolist()
        emitted, proposed, accepted = counts[0], counts[1:1 + run.num_steps], counts[1 + run.num_steps:]
        sched = SchedulerOutput([ScheduledSequence(r.seq, r.seq.num_computed_tokens, 1, True) for r in run.rows])
        scheduler.commit(sched, emitted)
        done = [0] * len(run.rows)  # tokens each row emitted before the step
        for step in range(run.num_steps):
            live = [i for i, d in enumerate(done) if d < emitted[i]]
            if not live:
                break
            self._count([proposed[step][i] for i in live], [accepted[step][i] for i in live])
            for i in live:
                seq, n, a = run.rows[i].seq, proposed[step][i], accepted[step][i]
                before = seq.num_output_tokens + done[i]
                could_draft = run.drafting[i] and seq.max_tokens - before > 1  # not at its last token
                seq.draft_history = next_history(seq.draft_history, n, a, before + a + 1, counted=could_draft)
                done[i] += a + 1
        return emitted

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
        """Count the step (:meth:`_count`); update each row's draft history."""
        self._count(num_drafts, num_accepted)
        for row, n, a in zip(rows, num_drafts, num_accepted):
            seq = row.seq
            seq.draft_history = next_history(seq.draft_history, n, a, seq.num_output_tokens + a + 1)

    def _count(self, num_drafts: list[int], num_accepted: list[int]) -> None:
        """Count one verification step of several requests in :attr:`stats` and the metrics."""
        self.stats.observe(num_drafts, num_accepted)
        if self.metrics is not None:
            self.metrics.observe_spec_decode(num_drafts, num_accepted)


def _read_width(spans: list[tuple[int, int, int]], q: int, block_size: int) -> int:
    """Block-table columns that cover every key a resident run's passes read: a pass starting at
    ``start_s`` sets ``seq_lens = start_s + q`` whatever it drafted, so its undrafted rows read up to
    position ``start_s + q - 1``; ``start_s`` is below ``start + min(positions - q + 1, remaining)``.

    Args:
        spans: per row ``(start, positions, remaining)``: its first position, the positions the
            run's passes may advance it by (``passes * q``), the tokens it has left.
    """
    last = max(start + min(positions - 1, remaining + q - 2) for start, positions, remaining in spans)
    return -(-(last + 1) // block_size)


def _cover_reads_of(meta: ForwardMetadata, spans, q: int, block_size: int, device) -> ForwardMetadata:
    """``meta`` with its (own, not static) block table widened by ``NULL_BLOCK`` columns to
    :func:`_read_width` (a static table is as wide as the longest context already)."""
    width = _read_width(spans, q, block_size)
    table = meta.block_table
    if table.shape[1] >= width:
        return meta
    wide = torch.full((table.shape[0], width), NULL_BLOCK, dtype=table.dtype, device=device)
    wide[:, :table.shape[1]].copy_(table)
    return replace(meta, block_table=wide)


def _cover_reads(decode: DecodeRun, spans, q: int, runner: ModelRunner) -> None:
    """:func:`_cover_reads_of` for a continuation's own device metadata, in ``decode``."""
    if not decode.resident:
        decode.meta = _cover_reads_of(decode.meta, spans, q, runner.block_manager.block_size, runner.device)


def _stage_resident(state: SpecState) -> tuple[HostSamples, torch.Tensor]:
    """Start copying a resident run's output and counts to pinned host memory (see
    :class:`ResidentRun`); does not wait."""
    tokens = state.out_tokens[:, :-1].t()
    counts = torch.cat([state.out_len[None, :], state.proposed, state.accepted])
    if tokens.device.type != "cuda":
        return HostSamples(tokens.contiguous()), counts
    host = HostSamples(torch.empty(tokens.shape, dtype=torch.int64, pin_memory=True).copy_(tokens, non_blocking=True))
    counts = torch.empty(counts.shape, dtype=torch.int64, pin_memory=True).copy_(counts, non_blocking=True)
    host.ready = torch.cuda.Event()
    host.ready.record()
    return host, counts
