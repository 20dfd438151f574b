"""The drafter interface: what a drafter is asked for and what it proposes.

A drafter proposes, for each request of a batch, up to ``k`` tokens that the target model may
accept (``k`` is fixed per worker: the verification graphs are captured for query length
``k + 1``). A proposal is a fixed-shape batch: requests with fewer drafts are padded with
:data:`PAD_DRAFT`, which never equals a token id, so padded positions are rejected by construction
(runtime/engine/spec_decode/rejection.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from graphserving.contract.worker_config import MAX_SPECULATIVE_TOKENS

__all__ = ["MAX_SPECULATIVE_TOKENS", "PAD_DRAFT", "DraftProposal", "DraftRequest", "Drafter",
           "check_num_speculative_tokens", "pad_drafts"]

PAD_DRAFT = -1
"""Draft token id of a padded position (a request proposed fewer than ``k`` tokens)."""


@dataclass(frozen=True)
class DraftRequest:
    """One request's input to a drafter.

    Attributes:
        token_ids: the whole sequence so far (prompt and output tokens), the context to continue.
        max_drafts: propose at most this many tokens (0: none; the engine lowers it near
            ``max_tokens`` or ``max_model_len``).
        seed: the request's RNG seed (``Sequence.seed``), for drafters that sample.
        step: output tokens generated so far: the RNG counter of the first draft position
            (runtime/engine/sampler.py's counter-based noise).
    """

    token_ids: Sequence[int]
    max_drafts: int
    seed: int = 0
    step: int = 0


@dataclass(frozen=True)
class DraftProposal:
    """The drafts of ``R`` requests, ``k`` positions each.

    Attributes:
        token_ids: int64 [R, k], the proposed tokens; :data:`PAD_DRAFT` at positions ``>= num_drafts``.
        num_drafts: int64 [R], real drafts of each request (``0 .. k``).
        probs: float32 [R, k, V], the draft distribution q each token was drawn from (rows of
            padded positions are ignored), or None: every draft is a deterministic function of the
            context (q is a point mass on the token), as for prompt lookup and greedy draft models.
    """

    token_ids: torch.Tensor
    num_drafts: torch.Tensor
    probs: torch.Tensor | None = None

    @property
    def num_speculative_tokens(self) -> int:
        """``k``, the draft positions of every request (padded ones included)."""
        return int(self.token_ids.shape[1])


class Drafter(Protocol):
    """Proposes up to ``num_speculative_tokens`` tokens per request.

    A drafter may also set ``host_replayable = True``: its proposal is a cheap deterministic
    function of the context on the host (prompt lookup: a few scans), so the engine replays it over
    decoded tokens to judge requests that decoded without verifying (shadow windows,
    spec_decode/policy.py). Without it (a draft model: a device pass per proposal) nothing is
    replayed.
    """

    num_speculative_tokens: int

    def propose(self, requests: Sequence[DraftRequest], device: torch.device | str) -> DraftProposal:
        """The drafts of ``requests`` (in order), as tensors on ``device``."""
        ...


def check_num_speculative_tokens(k: int) -> int:
    """``k`` when it is a valid number of speculative tokens (1 .. :data:`MAX_SPECULATIVE_TOKENS`).

    Raises:
        ValueError: otherwise (the message gives the value and the range).
    """
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"the number of speculative tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, got {k}")
    return k


def pad_drafts(drafts: Sequence[Sequence[int]], k: int, device: torch.device | str) -> DraftProposal:
    """A point-mass :class:`DraftProposal` from per-request token lists of at most ``k`` tokens.

    Raises:
        ValueError: a list longer than ``k``.
    """
    rows = []
    for i, tokens in enumerate(drafts):
        if len(tokens) > k:
            raise ValueError(f"request {i} has {len(tokens)} drafts, more than k={k}")
        rows.append([*tokens, *[PAD_DRAFT] * (k - len(tokens))])
    token_ids = torch.tensor(rows, dtype=torch.int64).reshape(len(drafts), k)
    num_drafts = torch.tensor([len(t) for t in drafts], dtype=torch.int64)
    return DraftProposal(token_ids=token_ids.to(device), num_drafts=num_drafts.to(device))
