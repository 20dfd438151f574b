"""Log-probabilities in the response shapes of the OpenAI API and of vLLM's extension (pure).

- :func:`legacy_logprobs`: the completions ``logprobs`` object, ``{"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}``, one entry per token. ``top_logprobs[i]`` maps the text of the
  ``logprobs`` most likely tokens at position i to their log-probability and always holds the
  token's own (OpenAI: "up to logprobs+1 elements"); a token without a log-probability (the first
  prompt token under ``echo``) has null in both lists.
- :func:`prompt_logprobs_json`: vLLM's ``prompt_logprobs``: per prompt token, null for the first,
  else ``{token id (JSON string): {"logprob", "rank", "decoded_token"}}`` for the prompt token
  itself (first) and the k most likely tokens (ranks 1 .. k).

Every function takes ``token_str`` (a token id's text, ``Tokenizer.token_to_str``); pass a memoised
one (:func:`memoised`) for long prompts, whose tokens repeat.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from ..engine.sequence import TokenLogprob

TokenStr = Callable[[int], str]


def memoised(token_str: TokenStr) -> TokenStr:
    """``token_str`` remembering its answers (one tokenizer call per distinct token)."""
    return functools.lru_cache(maxsize=None)(token_str)


def legacy_logprobs(token_str: TokenStr, tokens: Sequence[tuple[int, TokenLogprob | None]], num_top: int,
                    offset: int) -> dict[str, list]:
    """The completions ``logprobs`` object of ``tokens``.

    Args:
        token_str: a token id's text.
        tokens: (token id, its entry, or None when it has no log-probability), in text order.
        num_top: top tokens per position (the request's ``logprobs``); 0: ``top_logprobs`` entries
            are null.
        offset: the character of the choice's text where the first token's text starts.

    Returns:
        ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, lists of ``len(tokens)``.
    """
    texts, token_lps, tops, offsets = [], [], [], []
    for token_id, entry in tokens:
        text = token_str(token_id)
        texts.append(text)
        offsets.append(offset)
        offset += len(text)
        token_lps.append(entry.logprob if entry is not None else None)
        if entry is None or not num_top:
            tops.append(None)
            continue
        top = {token_str(t): lp for t, lp in entry.top[:num_top]}
        top.setdefault(text, entry.logprob)
        tops.append(top)
    return {"tokens": texts, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def join_legacy(first: dict[str, list], second: dict[str, list]) -> dict[str, list]:
    """Two :func:`legacy_logprobs` objects one after the other (the prompt's, then the completion's)."""
    return {key: first[key] + second[key] for key in first}


def prompt_logprobs_json(token_str: TokenStr, entries: Sequence[TokenLogprob | None],
                         num_top: int) -> list[dict[str, dict] | None]:
    """vLLM's ``prompt_logprobs`` of a prompt's entries (``RequestOutput.prompt_logprobs``), with
    ``num_top`` top tokens per position (the request's ``prompt_logprobs``)."""

    def item(token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_str(token_id)}

    result: list[dict[str, dict] | None] = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        position = {str(entry.token_id): item(entry.token_id, entry.logprob, entry.rank)}
        for rank, (t, lp) in enumerate(entry.top[:num_top], 1):
            position.setdefault(str(t), item(t, lp, rank))
        result.append(position)
    return result
