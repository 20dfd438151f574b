"""Prompt-lookup (n-gram) drafting: continue the context the way it continued before.

Model-free: the last ``n`` tokens of the context (its suffix) are looked up earlier in the same
context (prompt and output); the tokens that followed that earlier occurrence are the drafts.
Copy-heavy work (summarising or repeating a passage, editing code, answering from a document)
repeats long spans of the prompt, which is where the drafts are accepted.

Choices (defaults of :class:`NgramDrafter`, kept in :data:`DEFAULT_MIN_N` / :data:`DEFAULT_MAX_N`):

- the longest suffix first, ``max_n`` down to ``min_n`` tokens, and the first length that occurs
  earlier wins: a longer match is stronger evidence that the continuation repeats too;
- among the occurrences of that suffix, the most recent: the nearest earlier copy is the likeliest
  to continue the same way (the current loop of a repetition, the latest version of an edited
  line);
- a match too near the end to supply ``k`` tokens continues into its own drafts (the text between
  the match and the end repeats with that period), so a periodic context always yields ``k``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from .drafter import PAD_DRAFT, DraftProposal, DraftRequest, check_num_speculative_tokens, pad_drafts

DEFAULT_MIN_N = 1
"""Shortest suffix looked up: a single token, as prompt-lookup decoding's reference implementation
searches down to; the engine's acceptance tracking, not the drafter, decides whether weak drafts
are worth verifying."""

DEFAULT_MAX_N = 3
"""Longest suffix looked up: prompt-lookup decoding's reference value (longer suffixes rarely find
a match that a 3-token one misses, and each length is one more scan of the context)."""


def propose_ngram(context: Sequence[int] | np.ndarray, k: int, min_n: int = DEFAULT_MIN_N,
                  max_n: int = DEFAULT_MAX_N) -> list[int]:
    """Up to ``k`` draft tokens continuing ``context`` (pure).

    For ``n`` from ``max_n`` down to ``min_n``: the most recent earlier occurrence of the last
    ``n`` tokens (one that ends before the context's last token, so a token follows it) gives the
    drafts, the tokens after it; the first ``n`` with an occurrence wins. When fewer than ``k``
    tokens follow the occurrence, the drafts continue with their own tokens at the same distance
    (the span repeats). No occurrence of any length: no drafts.

    Args:
        context: the token ids so far (prompt and output).
        k: drafts wanted (>= 0).
        min_n, max_n: suffix lengths to look up, ``1 <= min_n <= max_n``.

    Returns:
        ``k`` tokens when some suffix of ``min_n .. max_n`` tokens occurs earlier, else ``[]``.

    Raises:
        ValueError: ``min_n < 1``, ``max_n < min_n`` or ``k < 0``.
    """
    if min_n < 1 or max_n < min_n or k < 0:
        raise ValueError(f"need 1 <= min_n <= max_n and k >= 0; got min_n={min_n}, max_n={max_n}, k={k}")
    tokens = np.asarray(context, dtype=np.int64)
    length = len(tokens)
    if k == 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows starting at 0 .. length - n - 1: each is followed by at least one token
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the first token after the most recent occurrence
            tail = tokens[start:].tolist()  # what followed it, up to the end
            for i in range(k):
                tail.append(tail[i])  # token start + i of the context extended by its drafts
            return tail[length - start:]
    return []


class NgramDrafter:
    """The :class:`~.drafter.Drafter` of prompt lookup (:func:`propose_ngram` per request).

    Args:
        num_speculative_tokens: ``k``, 1 .. ``drafter.MAX_SPECULATIVE_TOKENS``.
        min_n, max_n: suffix lengths (defaults :data:`DEFAULT_MIN_N`, :data:`DEFAULT_MAX_N`).

    Raises:
        ValueError: ``k`` out of range, or ``min_n``/``max_n`` as :func:`propose_ngram` refuses.
    """

    host_replayable = True
    """Proposals are host scans of the context: shadow windows replay them (``drafter.Drafter``)."""

    def __init__(self, num_speculative_tokens: int, min_n: int = DEFAULT_MIN_N, max_n: int = DEFAULT_MAX_N) -> None:
        self.num_speculative_tokens = check_num_speculative_tokens(num_speculative_tokens)
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"need 1 <= min_n <= max_n; got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: Sequence[DraftRequest], device: torch.device | str) -> DraftProposal:
        """Drafts for each request, at most its ``max_drafts`` (point masses: ``probs`` is None)."""
        k = self.num_speculative_tokens
        drafts = [
            propose_ngram(r.token_ids, min(k, r.max_drafts), self.min_n, self.max_n) if r.max_drafts > 0 else []
            for r in requests
        ]
        return pad_drafts(drafts, k, device)


def propose_ngram_batch(history: torch.Tensor, lens: torch.Tensor, max_drafts: torch.Tensor, k: int,
                        min_n: int = DEFAULT_MIN_N, max_n: int = DEFAULT_MAX_N) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`propose_ngram` for a batch of contexts on the device, in fixed-shape tensor ops.

    Row ``r`` drafts exactly what ``propose_ngram(history[r, :lens[r]], min(k, max_drafts[r]))``
    returns (tested), without a host round trip: the device-resident verification loop
    (runtime/engine/spec_decode/resident.py) drafts from the tokens its last step emitted.

    Args:
        history: int64 [R, W], each row's context in its first ``lens[r]`` columns (the rest is
            ignored).
        lens: int64 [R], context lengths (``1 <= lens[r] <= W``).
        max_drafts: int64 [R], drafts each row may propose (``<= 0``: none).
        k: draft positions of the result.
        min_n, max_n: suffix lengths, as :func:`propose_ngram`.

    Returns:
        ``(token_ids int64 [R, k], num_drafts int64 [R])`` as a point-mass
        :class:`~.drafter.DraftProposal` holds them: :data:`~.drafter.PAD_DRAFT` from position
        ``num_drafts[r]`` on.
    """
    rows, width = history.shape
    device = history.device
    start = torch.full((rows,), -1, dtype=torch.int64, device=device)  # first token after the match
    for n in range(min(max_n, width - 1), min_n - 1, -1):
        suffix = history.gather(1, (lens[:, None] - n + torch.arange(n, device=device)).clamp(min=0))
        count = width - n  # windows starting at 0 .. width - n - 1
        match = history[:, :count] == suffix[:, :1]
        for i in range(1, n):
            match &= history[:, i:i + count] == suffix[:, i:i + 1]
        p = torch.arange(count, device=device)
        match &= p[None, :] <= (lens - n - 1)[:, None]  # the window ends before the last token
        hit = torch.where(match, p, -1).amax(dim=1)
        start = torch.where((start < 0) & (hit >= 0), hit + n, start)
    found = start >= 0
    period = (lens - start).clamp(min=1)  # the drafts repeat the span after the match
    j = torch.arange(k, device=device)
    drafts = history.gather(1, (start.clamp(min=0)[:, None] + j[None, :] % period[:, None]).clamp(max=width - 1))
    num_drafts = torch.where(found, max_drafts.clamp(min=0, max=k), 0)
    return torch.where(j[None, :] < num_drafts[:, None], drafts, PAD_DRAFT), num_drafts
