"""Request and sequence state: sampling parameters, one sequence per generated choice.

A request with ``n`` choices becomes ``n`` :class:`Sequence` objects that the scheduler treats
independently (each has its own KV blocks). A sequence's tokens are its prompt followed by its
outputs; ``num_computed_tokens`` counts the prefix whose K/V is in the cache. Preemption by
recompute sets it back to 0, so the next prefill recomputes prompt and outputs together (less what
the prefix cache still holds of them: :mod:`.prefix_cache`).
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Literal


class RequestError(ValueError):
    """A request the engine cannot serve; ``param`` names the offending field, ``code`` classifies it."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; ``param`` names the field (as in the OpenAI API)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


MAX_LOGPROBS = 20
"""Most top log-probabilities per token (the OpenAI API's limit for ``top_logprobs``)."""

MAX_STOP_STRINGS = 16
"""Most stop strings per request (OpenAI allows 4; every one is searched after every step, and the
stream holds back ``len(longest) - 1`` characters, so both are bounded)."""

MAX_STOP_STRING_CHARS = 256
"""Longest stop string, in characters."""

MAX_STOP_TOKEN_IDS = 256
"""Most stop token ids per request."""

MAX_LOGIT_BIAS = 1024
"""Most ``logit_bias`` entries per request (OpenAI documents the bias range [-100, 100], not a count;
each entry is one column of a per-step tensor, so it is bounded)."""
GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily."""
MIN_REPETITION_PENALTY = 0.01
"""Repetition penalties are bounded to [0.01, 100]: beyond, logits overflow to inf."""


StructuredKind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match.

    Attributes:
        kind: ``json_schema`` (``value`` is the schema as JSON text), ``json_object`` (any JSON
            object; ``value`` ignored), ``regex`` (a regular expression the whole output matches),
            ``grammar`` (llguidance's Lark dialect, which may embed JSON schemas with
            ``%json { ... }``), ``choice`` (``value`` is a JSON array of strings; the output is one
            of them).
        value: the kind's source text.
        param: the request field it came from (``response_format``, ``tool_choice``, ...), named
            in the error when it does not compile.
    """

    kind: StructuredKind
    value: str = ""
    param: str = "response_format"


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Defaults follow the OpenAI API (temperature 1, top_p 1).

    Attributes:
        n: choices generated for the request, each its own sequence.
        max_tokens: most generated tokens per choice; 0: none, the sequence finishes with
            ``"length"`` once its prompt is prefilled (a request that only scores its prompt:
            ``prompt_logprobs``, or the API's ``echo``).
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus sampling; keep the smallest set of tokens whose probability sum reaches it.
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        min_p: drop tokens whose probability is below ``min_p`` times the top token's.
        repetition_penalty: divides positive (multiplies negative) logits of tokens already in the
            prompt or output (CTRL paper, Keskar et al. 2019; as in transformers); 1 disables it.
        presence_penalty / frequency_penalty: subtracted from logits of tokens already generated,
            once / per occurrence (OpenAI API definition); 0 disables them.
        min_tokens: the end-of-sequence and stop token ids cannot be sampled before this many
            output tokens (vLLM's parameter of that name; stop strings still apply).
        logit_bias: ``(token id, bias)`` pairs added to the logits before sampling (OpenAI API:
            bias in [-100, 100]).
        structured: the grammar the output must match (:mod:`.structured`), or None.
        prompt_logprobs: ``None``: none; ``k >= 0``: the log-probability of every prompt token
            after the first, plus the ``k`` most likely tokens at each prompt position (at most
            :data:`MAX_LOGPROBS`; computed once per request, by choice 0: :mod:`.prompt_logprobs`).
        seed: makes sampling reproducible: the same seed gives the same tokens whatever else is in
            the batch. ``None``: a seed drawn by the engine.
        stop: strings that end the generation; the stop string is not part of the output unless
            ``include_stop_str_in_output``.
        stop_token_ids: token ids that end the generation (in addition to EOS).
        ignore_eos: keep generating past the model's end-of-sequence tokens.
        include_stop_str_in_output: keep the stop string (or the text of the stop token id) that
            ended the generation in the output text (vLLM's parameter of that name).
        skip_special_tokens: drop special tokens from the output text (the tokenizer's
            ``all_special_ids``); token ids and log-probabilities keep them either way.
        logprobs: ``None``: no log-probabilities; ``k >= 0``: the sampled token's log-probability
            plus the ``k`` most likely tokens' (at most :data:`MAX_LOGPROBS`).
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutput | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 sample greedily: dividing logits by them overflows to inf and
        NaN probabilities (the same cut-off vLLM uses)."""
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        """Raise :class:`SamplingParamsError` naming the first invalid field."""

        def bad(param: str, message: str) -> SamplingParamsError:
            return SamplingParamsError(param, f"{param}: {message}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value!r}")
        if self.n < 1:
            raise bad("n", f"must be >= 1, got {self.n}")
        if self.max_tokens < 0:
            raise bad("max_tokens", f"must be >= 0 (0: only the prompt is processed), got {self.max_tokens}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k < 2**31:
            raise bad("top_k", f"must be -1 or 0 (disabled) or in [1, 2**31), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 1 / MIN_REPETITION_PENALTY:
            raise bad("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY}, {1 / MIN_REPETITION_PENALTY:g}] "
                                            f"(1 disables it), got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise bad("seed", f"must fit in a signed 64-bit integer, got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise bad("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", f"stop strings must be non-empty strings, got {list(self.stop)!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise bad("stop", f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, "
                              f"got {max(len(s) for s in self.stop)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be non-negative token ids, got {list(self.stop_token_ids)!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= max(self.max_tokens, 0):
            raise bad("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        self._validate_logit_bias(bad)

    def _validate_logit_bias(self, bad) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        ids = [t for t, _ in self.logit_bias]
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
            raise bad("logit_bias", f"keys must be non-negative token ids, got {ids[:8]!r}")
        if len(set(ids)) != len(ids):
            raise bad("logit_bias", "a token id appears more than once")
        for t, b in self.logit_bias:
            if not isinstance(b, (int, float)) or not math.isfinite(b) or not -100 <= b <= 100:
                raise bad("logit_bias", f"the bias of token {t} must be a number in [-100, 100], got {b!r}")

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a sequence ended (the OpenAI ``finish_reason`` values plus ``abort``)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled: the client disconnected, the drain deadline passed, or the engine failed


@dataclass
class TokenLogprob:
    """Log-probability of one token (generated, or of the prompt) and, if asked, of the most likely
    alternatives (``top``: ``(token id, log-probability)``, most likely first).

    ``rank``: how many tokens of the vocabulary are at least as likely as this one (1: the most
    likely; vLLM's definition), for prompt tokens; None for generated ones."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


@dataclass(eq=False)
class Sequence:
    """One generated choice of a request.

    Attributes:
        seq_id: unique id, ``f"{request_id}-{index}"``.
        request_id: the request it belongs to.
        index: the choice index within the request (0 .. n-1).
        prompt_token_ids: the prompt.
        params: the request's sampling parameters.
        seed: the RNG seed of this choice (request seed + index, or drawn by the engine).
        max_tokens: most output tokens (``params.max_tokens`` capped by the model's context).
        output_token_ids: generated so far.
        num_computed_tokens: prefix of :attr:`token_ids` whose K/V is in the cache.
        output_text: detokenized output (stop strings cut off).
        prompt_logprobs: for choice 0 of a request with ``params.prompt_logprobs``: ``[None]``
            followed by the entries of the prompt tokens scored so far (token ``j`` is scored by
            the logits at position ``j - 1``); complete at ``num_prompt_tokens`` entries. Empty for
            the other choices and requests (:mod:`.prompt_logprobs`).
        block_hashes: the block hashes of its full blocks hashed so far (:mod:`.prefix_cache`),
            extended as blocks fill; the token ids never change, so a preemption keeps them.
        kv_extra_key: what besides the tokens changes its K/V, hashed into every block hash
            (``extra`` of :func:`~.prefix_cache.block_hash`; e.g. a LoRA adapter's id). b"": the
            base model.
        num_cached_tokens: prompt tokens found in the prefix cache at its first admission (their
            prefill skipped); 0 without a hit or with caching off.
    """

    seq_id: str
    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    max_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    output_text: str = ""
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    """``time.monotonic()`` when the scheduler first admitted it into the running batch (its queue
    time ends there; a resumption after a preemption leaves it)."""
    first_token_time: float | None = None
    last_token_time: float | None = None
    """``time.monotonic()`` when its latest output tokens were appended (the inter-token latency's start)."""
    finish_time: float | None = None
    detokenizer: object | None = None
    matcher: object | None = None
    """The structured-output grammar matcher (``llguidance.LLMatcher``) when ``params.structured``."""
    num_sent_chars: int = 0
    """Characters of :attr:`output_text` already handed to the client."""
    num_sent_tokens: int = 0
    """Output tokens already handed to the client."""
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    """Whether :attr:`prompt_logprobs` were handed to the client (once, complete)."""
    block_hashes: list[bytes] = field(default_factory=list)
    kv_extra_key: bytes = b""
    num_cached_tokens: int = 0
    draft_history: object | None = None
    """Speculative decoding's recent acceptance of this sequence's drafts (``speculative.DraftHistory``;
    None: never drafted)."""

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.index == 0 and not self.prompt_logprobs:
            self.prompt_logprobs = [None]  # the first prompt token has no log-probability

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = time.monotonic()
