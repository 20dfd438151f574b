"""Verification: which drafts the target accepts, and the target's own token after them.

The target model ran ``k + 1`` rows per request: row ``j`` predicts the token at output step
``steps + j`` given the context and drafts ``0 .. j - 1``. Its logits are processed exactly as
the plain sampler processes them (runtime/engine/sampler.py: constraints, penalties, temperature,
top-k/top-p/min-p), each row with its own RNG counter ``steps + j`` and its drafts counted as
output tokens (:func:`expand_sampling_tensors`).

Two ways to verify, both exact (the emitted tokens follow the target's distribution; Leviathan et
al. 2023, Chen et al. 2023, as issue 15 specifies):

- **point-mass drafts** (``DraftProposal.probs is None``: prompt lookup, a greedy draft model). The
  plain sampler draws the target's token ``y_j`` of every row; the drafts are accepted while
  ``draft_j == y_j``, and the step emits ``y_0 .. y_a`` (``a`` accepted drafts and the target's
  token after them). This *is* rejection sampling for ``q = δ(draft)``: draft ``x`` is accepted with
  probability ``p(x) = min(1, p(x) / q(x))``, and on rejection ``y`` is distributed as ``p`` without
  ``x``, renormalised, which is ``norm(max(0, p - q))``; when every draft is accepted ``y_k`` is the
  bonus token. Greedy rows take the argmax, so this is greedy acceptance (the longest prefix where
  the draft is the argmax, plus the target's token). Every emitted token is the one the plain sampler
  would have drawn at the same step from the same context, with the same noise: seeded output is
  identical with and without speculation, token for token.
- **draft distributions** (``probs`` given: a sampling draft model). Draft ``x_j`` is accepted when
  ``u_j * q_j(x_j) < p_j(x_j)``, i.e. with probability ``min(1, p/q)``; at the first rejection the
  token is drawn from ``norm(max(0, p_j - q_j))``; after ``k`` acceptances, from ``p_k``. ``u_j``
  comes from the request's own counter-based stream at ``(seed ^`` :data:`ACCEPT_SEED_SALT` ``,
  steps + j)``; the residual draw uses the plain sampler's noise at ``steps + j`` (exponential race
  over the residual). A padded position has ``q = 0``: rejected by construction, and its draw is
  from ``p`` itself, the plain sampler's token.

Each step uses the RNG counters ``steps .. steps + a`` and the next step starts at
``steps + a + 1``: a request's randomness advances as without speculation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..sampler import (
    SamplingTensors,
    apply_constraints,
    apply_penalties,
    counter_uniform,
    sample,
    tempered_probs,
)
from ..sequence import GREEDY_TEMPERATURE
from .drafter import PAD_DRAFT, DraftProposal

ACCEPT_SEED_SALT = 0x5DEECE66D
"""XOR-ed into a request's seed for its acceptance uniforms: a stream of its own, independent of
the token noise at the same steps (a constant of this module; any value other than 0 would do)."""


@dataclass
class VerifyOutput:
    """The outcome of verifying ``R`` requests with ``k`` draft positions each.

    Attributes:
        token_ids: int64 [R, k + 1], each request's emitted tokens first (accepted drafts, then
            the target's token), :data:`~.drafter.PAD_DRAFT` after them.
        num_accepted: int64 [R], accepted drafts (``0 .. num_drafts``).
        num_emitted: int64 [R], ``num_accepted + 1``.
        logprobs: float32 [R, k + 1], log-probability of each emitted token under the raw model
            distribution of its row (as ``SamplerOutput.logprobs``), or None when no row asked.
        top_token_ids / top_logprobs: int64 / float32 [R, k + 1, K], or None.
    """

    token_ids: torch.Tensor
    num_accepted: torch.Tensor
    num_emitted: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def _per_position(values: torch.Tensor, q: int) -> torch.Tensor:
    """[R, ...] -> [R * q, ...], each row repeated ``q`` times (request after request)."""
    return values.repeat_interleave(q, dim=0)


def expand_sampling_tensors(
    t: SamplingTensors, draft_token_ids: torch.Tensor, num_drafts: torch.Tensor, vocab_size: int
) -> SamplingTensors:
    """The sampling tensors of the ``R * (k + 1)`` verification rows from those of ``R`` requests.

    Row ``r * (k + 1) + j`` is request ``r`` at draft position ``j``: its parameters, RNG counter
    ``steps + j`` (so ``min_tokens`` counts the drafts before it too), and, for the penalties, its
    output tokens followed by drafts ``0 .. j - 1``. Grammar bitmasks are repeated as they are: they
    hold for position 0 only, so requests with a grammar must not be drafted (``max_drafts = 0``).

    Args:
        t: one row per request, as ``ModelRunner.sampling_tensors`` builds them.
        draft_token_ids: int64 [R, k] (``DraftProposal.token_ids``).
        num_drafts: int64 [R].
        vocab_size: V, the padding id of the token-id tensors.

    Returns:
        New :class:`SamplingTensors` of ``R * (k + 1)`` rows (``t`` is not modified).
    """
    num_reqs, k = draft_token_ids.shape
    q = k + 1
    device = draft_token_ids.device
    position = torch.arange(q, device=device)
    rows = {f.name: getattr(t, f.name) for f in dataclasses.fields(t)}
    for name, value in rows.items():
        if isinstance(value, torch.Tensor):
            rows[name] = _per_position(value, q)
    rows["steps"] = rows["steps"] + position.repeat(num_reqs)
    if t.do_penalties:
        # position j counts drafts i < j (and i < num_drafts) as output; the rest is padding
        counted = (torch.arange(k, device=device)[None, None, :] < position[None, :, None]) & (
            torch.arange(k, device=device)[None, None, :] < num_drafts[:, None, None])
        drafts = torch.where(counted, draft_token_ids[:, None, :], vocab_size).reshape(num_reqs * q, k)
        rows["output_token_ids"] = torch.cat([rows["output_token_ids"], drafts], dim=1)
    return SamplingTensors(**rows)


def target_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The distribution the plain sampler draws each row from: float32 [S, V].

    The steps of ``sampler.sample`` up to its draw (constraints, penalties, temperature, top-k,
    top-p, min-p, softmax); greedy rows are a point mass on the argmax. ``argmax(probs / E)`` with
    the sampler's noise ``E`` is the token ``sample`` returns (tested).

    Args:
        logits: float32 [S, V]; t: parameters of the ``S`` rows.
    """
    logits = apply_constraints(logits.float(), t)
    if t.do_penalties:
        logits = apply_penalties(logits, t)
    greedy_probs = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[1]).float()
    if t.all_greedy:
        return greedy_probs
    greedy = t.temperature < GREEDY_TEMPERATURE
    return torch.where(greedy[:, None], greedy_probs, tempered_probs(logits, t, greedy))


def accepted_prefix(
    target_token_ids: torch.Tensor, draft_token_ids: torch.Tensor, num_drafts: torch.Tensor
) -> torch.Tensor:
    """Accepted drafts of point-mass verification: the longest prefix where ``draft_j == y_j``.

    Args:
        target_token_ids: int64 [R, k + 1], the target's token ``y_j`` of each row.
        draft_token_ids: int64 [R, k]; num_drafts: int64 [R] (positions ``>= num_drafts`` never match).

    Returns:
        int64 [R], ``0 .. num_drafts``.
    """
    k = draft_token_ids.shape[1]
    real = torch.arange(k, device=draft_token_ids.device)[None, :] < num_drafts[:, None]
    matches = (draft_token_ids == target_token_ids[:, :k]) & real
    return matches.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _emitted(token_ids: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """``token_ids`` [R, k + 1] kept at positions ``<= num_accepted``, :data:`PAD_DRAFT` after."""
    position = torch.arange(token_ids.shape[1], device=token_ids.device)[None, :]
    return torch.where(position <= num_accepted[:, None], token_ids, PAD_DRAFT)


def verify(logits: torch.Tensor, t_rows: SamplingTensors, proposal: DraftProposal) -> VerifyOutput:
    """Verify a batch's drafts against the target's logits (the module docstring gives the rule).

    Args:
        logits: float32 [R * (k + 1), V], the target's logits of every verification row, request
            after request (row ``j`` of request ``r`` at ``r * (k + 1) + j``).
        t_rows: :func:`expand_sampling_tensors` of the requests' sampling tensors and ``proposal``.
        proposal: the drafts (``k`` positions per request).

    Returns:
        :class:`VerifyOutput`.

    Raises:
        ValueError: ``logits`` does not have ``R * (k + 1)`` rows.
    """
    num_reqs, k = proposal.token_ids.shape
    q = k + 1
    if logits.shape[0] != num_reqs * q:
        raise ValueError(f"logits have {logits.shape[0]} rows; {num_reqs} requests with k={k} need {num_reqs * q}")
    if proposal.probs is None:
        sampled = sample(logits, t_rows)
        target = sampled.token_ids.view(num_reqs, q)
        num_accepted = accepted_prefix(target, proposal.token_ids, proposal.num_drafts)
        out = VerifyOutput(_emitted(target, num_accepted), num_accepted, num_accepted + 1)
        if sampled.logprobs is not None:
            out.logprobs = sampled.logprobs.view(num_reqs, q)
        if sampled.top_token_ids is not None:
            out.top_token_ids = sampled.top_token_ids.view(num_reqs, q, -1)
            out.top_logprobs = sampled.top_logprobs.view(num_reqs, q, -1)
        return out
    seeds, steps = t_rows.seeds.view(num_reqs, q)[:, 0], t_rows.steps.view(num_reqs, q)[:, 0]
    probs = target_probs(logits, t_rows).view(num_reqs, q, -1)
    token_ids, num_accepted = rejection_sample(probs, proposal, seeds, steps)
    out = VerifyOutput(token_ids, num_accepted, num_accepted + 1)
    if t_rows.num_logprobs >= 0:
        _add_logprobs(out, logits, t_rows.num_logprobs)
    return out


def rejection_sample(
    target: torch.Tensor, proposal: DraftProposal, seeds: torch.Tensor, steps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of drafts drawn from ``proposal.probs`` (Leviathan et al. 2023).

    Args:
        target: float32 [R, k + 1, V], the target distribution ``p_j`` of each row
            (:func:`target_probs`).
        proposal: drafts [R, k], ``num_drafts`` [R] and their distributions ``q`` [R, k, V].
        seeds / steps: int64 [R], each request's seed and the RNG counter of its position 0.

    Returns:
        ``(token_ids int64 [R, k + 1], num_accepted int64 [R])`` as in :class:`VerifyOutput`.
    """
    num_reqs, k = proposal.token_ids.shape
    q, vocab = k + 1, target.shape[-1]
    device = target.device
    real = torch.arange(k, device=device)[None, :] < proposal.num_drafts[:, None]
    drafts = proposal.token_ids.clamp(min=0)[..., None]
    p_x = target[:, :k].gather(-1, drafts).squeeze(-1)
    q_x = proposal.probs.float().gather(-1, drafts).squeeze(-1)
    positions = steps[:, None] + torch.arange(q, device=device)[None, :]  # [R, q] RNG counters
    u = counter_uniform((seeds ^ ACCEPT_SEED_SALT).repeat_interleave(k), positions[:, :k].reshape(-1), 1)
    accept = real & (u.view(num_reqs, k) * q_x.double() < p_x.double())  # float64: u < 1 stays below 1
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)

    # Every row's draw from its residual; a padded position and the bonus row have q = 0.
    draft_q = torch.where(real[..., None], proposal.probs.float(), 0.0)
    draft_q = torch.cat([draft_q, torch.zeros(num_reqs, 1, vocab, device=device)], dim=1)
    residual = (target - draft_q).clamp(min=0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, target)  # rounding left nothing
    noise = -torch.log(counter_uniform(seeds.repeat_interleave(q), positions.reshape(-1), vocab)).to(torch.float32)
    drawn = (residual.view(num_reqs * q, vocab) / noise).argmax(dim=-1).view(num_reqs, q)
    position = torch.arange(q, device=device)[None, :]
    padded_drafts = torch.cat([proposal.token_ids, torch.full((num_reqs, 1), PAD_DRAFT, device=device)], dim=1)
    token_ids = torch.where(position < num_accepted[:, None], padded_drafts, drawn)
    return _emitted(token_ids, num_accepted), num_accepted


def _add_logprobs(out: VerifyOutput, logits: torch.Tensor, num_logprobs: int) -> None:
    """Fill ``out``'s log-probabilities of the emitted tokens from the raw logits [R * q, V]."""
    num_reqs, q = out.token_ids.shape
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    tokens = out.token_ids.clamp(min=0).view(-1, 1)
    out.logprobs = logprobs.gather(1, tokens).view(num_reqs, q)
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
        out.top_logprobs, out.top_token_ids = top_logprobs.view(num_reqs, q, -1), top_ids.view(num_reqs, q, -1)
