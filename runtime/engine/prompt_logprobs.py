"""Prompt log-probabilities: how likely the model finds each prompt token, given the tokens before it.

A request with ``SamplingParams.prompt_logprobs`` = k gets, for its prompt ``t_0 .. t_{P-1}``, the
list ``[None, e_1, ..., e_{P-1}]``: ``e_j`` holds the log-probability of ``t_j`` given
``t_0 .. t_{j-1}`` (the log-softmax of the float32 raw logits at position ``j - 1``, before any
sampling parameter, as the sampler takes the log-probabilities of sampled tokens), its rank, and
the k most likely tokens at that position. The first token has none: nothing precedes it.

Where they come from: the prefill. Position ``p`` predicts the token at ``p + 1``, so a prefill
chunk ``[start, end)`` (chunked prefill spreads a prompt over steps; each chunk scores its own
positions) scores the prompt tokens ``start + 1 .. min(end, P - 1)``
(:func:`scored_positions`). The model runner asks the forward pass for the logits of those
positions after those of the rows that sample (:class:`PromptLogprobRows`); :func:`compute` turns
them into log-probabilities on the device and :func:`store` appends them to the sequences. The
last prompt position predicts the first *output* token: it samples and scores nothing.

Once per request: only choice 0 computes them (every choice has the same prompt), and a preempted
sequence whose prefill is recomputed does not score the tokens it already scored again
(``Sequence.prompt_logprobs`` holds them, and tells how far it got).

Memory: a forward pass returns float32 logits [S + N, V] for its S sampling rows and N scored
positions. N is at most the pass's token rows, which the scheduler bounds by its token budget
``max_num_batched_tokens`` (EngineLimits; chunked prefill cuts longer prompts): with the default
2048 and SmolLM2's 49152-token vocabulary, 0.4 GB. The log-softmax runs over slices of
:data:`SLICE_ROWS` rows, so it adds at most [SLICE_ROWS, V] float32 on top.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.forward_metadata import to_device
from .scheduler import ScheduledSequence
from .sequence import Sequence, TokenLogprob

SLICE_ROWS = 256
"""Scored positions per log-softmax: bounds its float32 copy of the logits at [256, V]."""


def scored_positions(row: ScheduledSequence) -> range:
    """The positions of ``row``'s chunk whose logits score a prompt token not scored yet (pure):
    position ``p`` scores the prompt token at ``p + 1``. Empty for a sequence that computes no
    prompt log-probabilities (``Sequence.prompt_logprobs`` empty)."""
    seq = row.seq
    if not seq.prompt_logprobs:
        return range(0)
    return range(max(row.start, len(seq.prompt_logprobs) - 1), min(row.end, seq.num_prompt_tokens - 1))


@dataclass
class PromptLogprobRows:
    """The scored prompt positions of one batch, in the order of their logits rows.

    Attributes:
        seqs: the sequence of each run of consecutive positions (one run per scheduled row that scores).
        counts: positions in each run.
        target_ids: the scored token of every position (the prompt token at position + 1).
        num_top: the most top tokens any of the sequences asks for (``params.prompt_logprobs``).
    """

    seqs: list[Sequence] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    target_ids: list[int] = field(default_factory=list)
    num_top: int = 0

    def add(self, seq: Sequence, target_ids: list[int]) -> None:
        """Append a run of ``seq``'s positions, scoring ``target_ids``."""
        self.seqs.append(seq)
        self.counts.append(len(target_ids))
        self.target_ids.extend(target_ids)
        self.num_top = max(self.num_top, seq.params.prompt_logprobs or 0)


@dataclass
class PromptLogprobs:
    """What :func:`compute` returns for N scored positions (device tensors, not waited for).

    Attributes:
        rows: the positions they belong to.
        logprobs: float32 [N], each scored token's log-probability.
        ranks: int64 [N], each scored token's rank (tokens at least as likely, itself included).
        top_ids / top_logprobs: int64 / float32 [N, K] (K = ``rows.num_top``), the most likely
            tokens first; None when K is 0.
    """

    rows: PromptLogprobRows
    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def compute(logits: torch.Tensor, rows: PromptLogprobRows) -> PromptLogprobs:
    """Log-probabilities of the scored tokens from their positions' logits, slice by slice.

    Args:
        logits: float32 [N, V], row i the logits of the i-th scored position of ``rows``.
        rows: the scored positions.

    Returns:
        :class:`PromptLogprobs` (on the device of ``logits``; does not wait for it).
    """
    targets = to_device(rows.target_ids, torch.int64, logits.device)
    k = rows.num_top
    parts: list[tuple[torch.Tensor, ...]] = []
    for lo in range(0, logits.shape[0], SLICE_ROWS):
        logprobs = torch.log_softmax(logits[lo:lo + SLICE_ROWS].float(), dim=-1)
        chosen = logprobs.gather(1, targets[lo:lo + SLICE_ROWS, None])
        rank = (logprobs >= chosen).sum(dim=-1)
        parts.append((chosen[:, 0], rank, *(logprobs.topk(k, dim=-1)[::-1] if k else ())))
    columns = [torch.cat(c) for c in zip(*parts)]
    return PromptLogprobs(rows, *columns)


def store(result: PromptLogprobs) -> None:
    """Append the entries of ``result`` to the ``prompt_logprobs`` of their sequences, each with as
    many top tokens as its own request asks for. Waits for the device (the run is processed)."""
    lps, ranks, top_ids, top_lps = (t.tolist() if t is not None else None for t in
                                    (result.logprobs, result.ranks, result.top_ids, result.top_logprobs))
    rows, i = result.rows, 0
    for seq, count in zip(rows.seqs, rows.counts):
        k = seq.params.prompt_logprobs
        for j in range(i, i + count):
            top = list(zip(top_ids[j][:k], top_lps[j][:k])) if k else []
            seq.prompt_logprobs.append(TokenLogprob(rows.target_ids[j], lps[j], top, ranks[j]))
        i += count


def prefilled_without_output(rows: list[ScheduledSequence]) -> list[Sequence]:
    """The sequences with ``max_tokens`` 0 whose prefill ``rows`` (a run's schedule) completed:
    they finish now, with ``"length"``, nothing sampled (pure)."""
    return [r.seq for r in rows if r.seq.max_tokens == 0 and r.end == r.seq.num_prompt_tokens
            and not r.seq.is_finished]
