"""When speculative decoding pays: each request's expected acceptance, and the batch's decision.

A verification pass of a batch of ``R`` requests costs ``c`` decode steps (``c`` measured per batch
size, spec_decode/costs.py) and emits ``R + A`` tokens where ``A`` is the drafts it accepts, against
``R`` tokens for a decode step: it pays when ``A >= R (c - 1)`` (:func:`verification_pays`). ``A``
is estimated per request from its recent drafting (:class:`DraftHistory`):

- real windows: every :data:`ACCEPTANCE_WINDOW` verifications of a request, its accepted drafts
  per verification over the window (:func:`next_history`);
- shadow windows: a request that has decoded :data:`SHADOW_INTERVAL` tokens without verifying
  (its batch decoded plainly) gets the drafter replayed over those tokens, which tells what
  verification would have accepted there, at no device cost (:func:`shadow_review`);
- a request judged by neither yet counts :data:`UNJUDGED_ACCEPTANCE`.

So a batch whose requests stop accepting decodes plainly after one window and drafts again as soon
as a shadow window shows its text repeating; a request that accepts little rides in a batch that
verifies for others (its drafts cost nothing more there) and is judged by real windows again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .drafter import Drafter, DraftRequest

ACCEPTANCE_WINDOW = 4
"""Verifications over which a request's acceptance is judged (real or shadow)."""

UNMEASURED_VERIFICATION_COST = 2.0
"""A verification pass's cost in decode steps assumed where the engine has not timed both at the
batch size (the CPU; on CUDA until a continued verification run and a continued plain run were
timed at that size): a batch then verifies when its requests expect one accepted draft per
verification on average. On the H200 whole SmolLM2 runs measured 2.05-2.10 decode steps per pass at
batch 1 and 1.09-1.16 at batch 8; the device time of passes alone (1.49 at batch 1) was too low a
bar: a window that is not continued also pays its host round trip (bench/RESULTS.md, "Speculative
decoding verifies where it pays")."""

UNJUDGED_ACCEPTANCE = 1.0
"""Accepted drafts per verification expected of a request no window has judged yet: at
:data:`UNMEASURED_VERIFICATION_COST` a batch of new requests verifies (probes) from its first
decode step, which is where copying a passage or a file gains."""

SHADOW_INTERVAL = 16
"""Output tokens a request decodes without verifying before a shadow window judges it
(:func:`shadow_review`), and the span of decoded tokens the window replays the drafter over.
Replaying costs the host up to :data:`ACCEPTANCE_WINDOW` drafter calls per interval (prompt lookup:
a few scans of the context) and the device nothing. Before (2026-12-03) a paused request probed
with real verifications after 64, 128, ... tokens: each probe of a request whose drafts fail cost a
window of passes of ``k + 1`` rows and the pipelining of its runs."""


@dataclass(frozen=True)
class DraftHistory:
    """One request's recent drafting (``Sequence.draft_history``).

    Attributes:
        verifications / proposed / accepted: of the window in progress.
        acceptance: accepted drafts per verification of the last full window, real or shadow
            (None before the first: the request is *probing*).
        reviewed_at: the request's output tokens at its last verification or shadow window.
    """

    verifications: int = 0
    proposed: int = 0
    accepted: int = 0
    acceptance: float | None = None
    reviewed_at: int = 0


def next_history(history: DraftHistory | None, proposed: int, accepted: int, num_output_tokens: int,
                 counted: bool = False) -> DraftHistory:
    """The history after a verification that proposed and accepted these drafts (pure).

    A full window (:data:`ACCEPTANCE_WINDOW` verifications) sets ``acceptance`` to its accepted
    drafts per verification and starts over.

    Args:
        num_output_tokens: the request's output tokens after this verification's.
        counted: a verification without drafts counts too (a resident run's step of a row that
            was allowed to draft and found none: it paid for the verification rows all the same);
            False: it leaves the history alone (a row padded into a batch that other rows drafted).
    """
    h = history or DraftHistory()
    if proposed == 0 and not counted:
        return h
    h = replace(h, verifications=h.verifications + 1, proposed=h.proposed + proposed, accepted=h.accepted + accepted,
                reviewed_at=num_output_tokens)
    if h.verifications < ACCEPTANCE_WINDOW:
        return h
    return DraftHistory(acceptance=h.accepted / h.verifications, reviewed_at=num_output_tokens)


def shadow_window(token_ids: list[int], start: int, drafter: Drafter) -> tuple[int, int]:
    """Replay the drafter over decoded tokens: up to :data:`ACCEPTANCE_WINDOW` verifications as
    speculative decoding would have run them from context length ``start`` (pure for a
    deterministic drafter).

    A verification at context length ``L`` drafts from ``token_ids[:L]`` and accepts its drafts
    while they equal ``token_ids[L:]``; the next one is at ``L + accepted + 1``. Only verifications
    whose ``k`` drafts all have a decoded token to compare with are replayed (``L + k`` at most
    ``len(token_ids)``). For point-mass drafts (prompt lookup, a greedy draft model) this is exactly
    what verification accepts: it samples the target's token at each row with the counter plain
    decoding used (spec_decode/rejection.py) and keeps drafts while they equal it.

    Returns:
        ``(verifications, accepted drafts)``.
    """
    k = drafter.num_speculative_tokens
    at, verifications, accepted = max(start, 1), 0, 0
    while verifications < ACCEPTANCE_WINDOW and at + k <= len(token_ids):
        proposal = drafter.propose([DraftRequest(token_ids[:at], k)], "cpu")
        drafts = proposal.token_ids[0, :int(proposal.num_drafts[0])].tolist()
        a = next((j for j, (d, t) in enumerate(zip(drafts, token_ids[at:])) if d != t), len(drafts))
        verifications, accepted, at = verifications + 1, accepted + a, at + a + 1
    return verifications, accepted


def shadow_review(history: DraftHistory | None, token_ids: list[int], num_output_tokens: int,
                  drafter: Drafter) -> DraftHistory | None:
    """The history of a request that has decoded :data:`SHADOW_INTERVAL` output tokens since its
    last verification or shadow window: ``acceptance`` from a shadow window (:func:`shadow_window`)
    over its last :data:`SHADOW_INTERVAL` tokens, the window in progress dropped; unchanged before
    the interval is up."""
    if not shadow_due(history, num_output_tokens):
        return history
    verifications, accepted = shadow_window(token_ids, len(token_ids) - SHADOW_INTERVAL, drafter)
    acceptance = accepted / verifications if verifications else history.acceptance if history else None
    return DraftHistory(acceptance=acceptance, reviewed_at=num_output_tokens)


def shadow_due(history: DraftHistory | None, num_output_tokens: int) -> bool:
    """Whether a request with ``num_output_tokens`` output tokens is due a shadow window (pure)."""
    return num_output_tokens >= (history.reviewed_at if history is not None else 0) + SHADOW_INTERVAL


def expected_acceptance(history: DraftHistory | None) -> float:
    """Accepted drafts per verification a request is expected to add (its last window's, or
    :data:`UNJUDGED_ACCEPTANCE`)."""
    acceptance = history.acceptance if history is not None else None
    return UNJUDGED_ACCEPTANCE if acceptance is None else acceptance


def verification_pays(expected: list[float], cost: float | None) -> bool:
    """Whether a verification pass of these requests emits tokens faster than decode steps (pure):
    their expected accepted drafts sum to at least ``R (cost - 1)``, and some request expects any.

    Args:
        expected: per request of the batch, accepted drafts per verification it expects (0 for
            one that cannot draft: a grammar, its last token, finished).
        cost: a verification pass's time in decode steps at this batch size, or None (unmeasured:
            :data:`UNMEASURED_VERIFICATION_COST`).
    """
    cost = UNMEASURED_VERIFICATION_COST if cost is None else cost
    total = sum(expected)
    return total > 0 and total >= len(expected) * (cost - 1)
