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

from .drafter import DraftProposal, DraftRequest, check_num_speculative_tokens, pad_drafts

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
