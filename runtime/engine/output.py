"""From sampled tokens to what a client is handed: detokenisation, stop conditions, deltas.

The engine (:class:`~graphserving.runtime.engine.core.LLMEngine`) appends each run's sampled
tokens to their sequences with :func:`append_tokens` (no stop strings, no log-probabilities: one
detokenizer call for the whole run) or :func:`append_steps` (token by token, checking stop strings
with :func:`check_stop`); both return the :class:`Finish` decision instead of finishing the
sequence, which the engine does through its scheduler (that frees the KV blocks).

What was produced since the previous update becomes a :class:`ChoiceDelta` (:func:`take_delta`):
text that might still become a stop string is held back (:func:`holdback`) until it cannot, and a
stop string is cut off. The deltas of one request in one step are gathered into a
:class:`RequestOutput` (:func:`add_delta`, :func:`update_progress`); :class:`CompletedChoice`
accumulates a choice's deltas (``LLMEngine.generate``, tests, the non-streaming HTTP path).
:class:`TokenTimes` stamps when a run's tokens were appended and gathers their TTFT and
inter-token latencies for the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .sequence import FinishReason, Sequence, TokenLogprob

if TYPE_CHECKING:
    from .metrics import EngineMetrics


@dataclass
class ChoiceDelta:
    """What one choice produced since the previous output of its request.

    Attributes:
        index: the choice index.
        text: new text (stop strings cut off; text that might still become a stop string is held
            back until it cannot).
        token_ids: new token ids.
        logprobs: one entry per new token when the request asked for log-probabilities.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` once finished, else None.
        stop_reason: the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    """An update for one request: the choices with something new, and whether all have finished.

    ``prompt_logprobs``: the request's prompt log-probabilities (``SamplingParams.prompt_logprobs``;
    one entry per prompt token, the first None), in one update only: the request's first, unless
    choice 0's prefill completes after a sibling's first delta (:func:`take_prompt_logprobs`).
    """

    request_id: str
    choices: list[ChoiceDelta]
    finished: bool
    num_prompt_tokens: int
    num_output_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class CompletedChoice:
    """A finished choice, accumulated from its deltas (what :meth:`LLMEngine.generate` returns);
    ``prompt_logprobs`` are its request's (:class:`RequestOutput`), when asked for."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs:
            self.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


@dataclass(frozen=True)
class Finish:
    """A stop condition that holds: how the sequence finishes (the caller finishes it).

    Attributes:
        reason: ``FinishReason.STOP`` or ``FinishReason.LENGTH``.
        stop_reason: the stop string or stop token id that ended it; None for EOS and length.
    """

    reason: FinishReason
    stop_reason: str | int | None = None


def holdback(stops: tuple[str, ...]) -> int:
    """Characters withheld from a stream: a stop string may still complete within them."""
    return max((len(s) for s in stops), default=1) - 1


def find_stop_string(text: str, stops: tuple[str, ...], new_from: int) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends after ``new_from`` (its start index and itself)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, new_from - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def new_detokenizer(tokenizer, seq: Sequence):
    """An incremental detokenizer for ``seq``'s output, primed with its prompt."""
    from ..model.tokenizer import IncrementalDetokenizer

    return IncrementalDetokenizer(tokenizer, seq.prompt_token_ids, skip_special_tokens=seq.params.skip_special_tokens)


def _stop_token(seq: Sequence, token: int, eos_token_ids: frozenset[int]) -> bool:
    params = seq.params
    return (not params.ignore_eos and token in eos_token_ids) or token in params.stop_token_ids


def _stop_token_has_text(seq: Sequence, token: int) -> bool:
    """Whether a stop token's own text goes into the output: only for ``stop_token_ids`` with
    ``include_stop_str_in_output`` (an EOS adds no text, as in vLLM)."""
    return seq.params.include_stop_str_in_output and token in seq.params.stop_token_ids


def append_tokens(seq: Sequence, tokens: list[int], eos_token_ids: frozenset[int]) -> tuple[int, Finish | None]:
    """Append a run of sampled tokens to a sequence without stop strings or log-probabilities.

    The same result as :func:`check_stop` token by token (tokens after a stop token, an EOS or
    ``max_tokens`` are dropped), with one detokenizer call for the whole run instead of one per
    token. Updates ``seq.output_token_ids`` and ``seq.output_text``; does not finish ``seq``.

    Returns:
        (tokens kept, the stop condition that holds after them or None).
    """
    keep, finish = len(tokens), None
    for j, token in enumerate(tokens):
        if _stop_token(seq, token, eos_token_ids):
            keep = j + 1
            finish = Finish(FinishReason.STOP, token if token in seq.params.stop_token_ids else None)
            break
        if seq.num_output_tokens + j + 1 >= seq.max_tokens:
            keep, finish = j + 1, Finish(FinishReason.LENGTH)
            break
    kept = tokens[:keep]
    if not kept:
        return 0, None
    seq.output_token_ids.extend(kept)
    stopped_on_token = finish is not None and finish.reason is FinishReason.STOP
    text_ids = kept[:-1] if stopped_on_token and not _stop_token_has_text(seq, kept[-1]) else kept
    if text_ids:
        seq.output_text += seq.detokenizer.feed(text_ids)
    if finish is not None:
        seq.output_text += seq.detokenizer.flush()
    return keep, finish


def append_steps(
    seq: Sequence, row: int, token_ids: list[list[int]], logprobs: list[list[float]] | None,
    top_ids: list[list[list[int]]] | None, top_lps: list[list[list[float]]] | None,
    eos_token_ids: frozenset[int],
) -> tuple[int, Finish | None]:
    """Append row ``row``'s token of every step to ``seq``, in step order, checking stops after each.

    For sequences with stop strings or log-probabilities; tokens after the step that stops the
    sequence are discarded. Updates the sequence's tokens, log-probabilities and text; does not
    finish ``seq``.

    Args:
        seq: the sequence of the row.
        row: the row's index in each step's lists.
        token_ids: [steps][rows] sampled token ids.
        logprobs: [steps][rows] their log-probabilities, or None.
        top_ids / top_lps: [steps][rows][K] the top-K token ids and log-probabilities, or None.
        eos_token_ids: the model's and tokenizer's EOS ids.

    Returns:
        (tokens kept, the stop condition that holds after them or None).
    """
    count = 0
    for step in range(len(token_ids)):
        token = token_ids[step][row]
        seq.output_token_ids.append(token)
        count += 1
        k = seq.params.logprobs
        if k is not None and logprobs is not None:
            top = list(zip(top_ids[step][row][:k], top_lps[step][row][:k])) if k and top_ids is not None else []
            seq.output_logprobs.append(TokenLogprob(token, logprobs[step][row], top))
        finish = check_stop(seq, token, eos_token_ids)
        if finish is not None:
            return count, finish
    return count, None


def check_stop(seq: Sequence, token: int, eos_token_ids: frozenset[int]) -> Finish | None:
    """Append ``token``'s text to ``seq`` (already in its token ids) and say whether it stops.

    Order: EOS (unless ``ignore_eos``), stop token ids, stop strings (the text is cut before the
    stop string, or after it with ``include_stop_str_in_output``), then ``max_tokens``. The detokenizer is flushed into the text when the sequence
    stops on a token or on its length.
    """
    params = seq.params
    if _stop_token(seq, token, eos_token_ids):
        if _stop_token_has_text(seq, token):
            seq.output_text += seq.detokenizer.feed(token)
        seq.output_text += seq.detokenizer.flush()
        return Finish(FinishReason.STOP, token if token in params.stop_token_ids else None)
    before = len(seq.output_text)
    seq.output_text += seq.detokenizer.feed(token)
    if params.stop:
        hit = find_stop_string(seq.output_text, params.stop, before)
        if hit is not None:
            idx, stop = hit
            seq.output_text = seq.output_text[:idx + len(stop) if params.include_stop_str_in_output else idx]
            return Finish(FinishReason.STOP, stop)
    if seq.num_output_tokens >= seq.max_tokens:
        seq.output_text += seq.detokenizer.flush()
        return Finish(FinishReason.LENGTH)
    return None


def take_delta(seq: Sequence) -> ChoiceDelta:
    """What ``seq`` produced since its last delta, which it then counts as sent.

    While the sequence runs, the last ``holdback(stop)`` characters of its text are withheld (a
    stop string may still complete within them); a finished sequence releases all of it.
    """
    sent_text, sent_tokens = seq.num_sent_chars, seq.num_sent_tokens
    if seq.is_finished:
        visible = len(seq.output_text)
    else:
        visible = len(seq.output_text) - holdback(seq.params.stop)
    visible = max(visible, sent_text)
    delta = ChoiceDelta(
        index=seq.index,
        text=seq.output_text[sent_text:visible],
        token_ids=seq.output_token_ids[sent_tokens:],
        logprobs=seq.output_logprobs[sent_tokens:] if seq.params.logprobs is not None else None,
        finish_reason=seq.finish_reason.value if seq.finish_reason is not None else None,
        stop_reason=seq.stop_reason,
    )
    seq.num_sent_chars = visible
    seq.num_sent_tokens = seq.num_output_tokens
    return delta


def take_prompt_logprobs(seq: Sequence) -> list[TokenLogprob | None] | None:
    """``seq``'s prompt log-probabilities once all are computed and not yet handed out, which they
    then count as; else None. The engine takes them from choice 0 (which computes them for the
    request) into the request's next update: its first one, since choice 0's prefill ends no later
    than any sibling's (the scheduler serves the older first and preempts the younger first)."""
    if seq.prompt_logprobs_sent or not seq.prompt_logprobs or len(seq.prompt_logprobs) < seq.num_prompt_tokens:
        return None
    seq.prompt_logprobs_sent = True
    return seq.prompt_logprobs


def add_delta(out: RequestOutput, delta: ChoiceDelta, max_tokens: int | None = None) -> None:
    """Put ``delta`` into ``out``, after an earlier delta of the same choice in the same update.

    A step may update a choice twice (a pipelined run's tokens, then the step's own batch or an
    abort): the earlier delta is already counted as sent, so ``delta`` extends it, unless the two
    together would hold more than ``max_tokens`` tokens (a stream interval, :func:`stream_cuts`):
    then ``delta`` follows it as a delta of its own (None: always extend).
    """
    earlier = next((c for c in reversed(out.choices) if c.index == delta.index), None)
    if earlier is None or (max_tokens is not None and delta.token_ids
                           and len(earlier.token_ids) + len(delta.token_ids) > max_tokens):
        out.choices.append(delta)
        return
    earlier.text += delta.text
    earlier.token_ids = earlier.token_ids + delta.token_ids
    if delta.logprobs is not None:
        earlier.logprobs = (earlier.logprobs or []) + delta.logprobs
    earlier.finish_reason, earlier.stop_reason = delta.finish_reason, delta.stop_reason


def stream_cuts(num_output_tokens: int, num_new: int, interval: int) -> list[int]:
    """Where a streamed choice's update is cut within a run of ``num_new`` new tokens (pure).

    A streamed choice is updated after its first token and then after every ``interval``-th
    (and when it finishes): so a multi-step run of N tokens reaches a client as N chunks with the
    default interval 1, not as one burst (docs/worker.md, "Multi-step decoding").

    Args:
        num_output_tokens: the choice's output tokens before the run.
        num_new: the run's tokens for it.
        interval: the stream interval, in tokens (>= 1).

    Returns:
        Counts of the run's tokens (1 .. ``num_new``, ascending) after which an update is cut.
    """
    return [j for j in range(1, num_new + 1)
            if (total := num_output_tokens + j) == 1 or total % interval == 0]


def update_progress(out: RequestOutput, seqs: list[Sequence]) -> None:
    """Set ``out``'s output-token count and whether every choice of its request has finished."""
    out.num_output_tokens = sum(s.num_output_tokens for s in seqs)
    out.finished = all(s.is_finished for s in seqs)


class TokenTimes:
    """When one run's new output tokens were appended: stamps each sequence's first- and
    latest-token times, observes its TTFT, and gathers the inter-token latencies (ITL) of the whole
    run for one :meth:`~.metrics.EngineMetrics.observe_token_intervals` call (:meth:`record`).

    ITL as runtime/engine/metrics.py defines it: ``kept`` new tokens at ``now`` after the previous
    ones at ``t_prev`` are ``kept`` intervals of ``(now - t_prev) / kept``; in the run of a
    sequence's first token, ``kept - 1`` intervals of ``(now - first admission) / kept``.

    Args:
        now: when the run's tokens were appended (``time.monotonic()``, seconds).
        metrics: what to record into, or None (only the sequences' times are stamped).
    """

    def __init__(self, now: float, metrics: EngineMetrics | None):
        self.now = now
        self.metrics = metrics
        self.intervals: list[float] = []
        self.counts: list[int] = []

    def note(self, seq: Sequence, kept: int) -> None:
        """``kept`` (>= 1) tokens were appended to ``seq`` at :attr:`now`."""
        now = self.now
        last, seq.last_token_time = seq.last_token_time, now
        intervals = kept
        if last is None:
            seq.first_token_time = now
            if self.metrics is not None:
                self.metrics.observe_first_token(now - seq.arrival_time)
            last = now if seq.first_scheduled_time is None else seq.first_scheduled_time
            intervals = kept - 1
        if intervals and self.metrics is not None:
            self.intervals.append((now - last) / kept)
            self.counts.append(intervals)

    def record(self) -> None:
        """Record the gathered inter-token latencies (one call for the run)."""
        if self.metrics is not None and self.intervals:
            self.metrics.observe_token_intervals(self.intervals, self.counts)
