"""Structured output: a request's output constrained to a grammar, as a token mask per step.

A request carries a :class:`StructuredOutput` (what its output must match). The engine compiles it
with the grammar library llguidance (docs/worker.md, "Structured output", says why this library)
into one matcher per sequence; before each step that samples such a sequence, the matcher fills
the row's bit of an allowed-token bitmask, and the sampler masks the other tokens to -inf before
anything else (penalties, temperature, truncation). The mask is applied to the logits the forward
pass returns, outside the captured graph, so FULL graphs still serve constrained requests.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict

import torch

from .output import Finish
from .sequence import FinishReason, Sequence, SamplingParamsError, StructuredOutput

log = logging.getLogger(__name__)

__all__ = ["GrammarCompiler", "StructuredOutput", "advance_grammar", "apply_bitmask", "fill_bitmask", "grammar_source"]

MAX_GRAMMAR_CHARS = 64 * 1024
"""Longest grammar source (schema, regex, Lark text) a request may send, in characters."""

MAX_CHOICES = 256
"""Most alternatives of a ``choice`` constraint."""


def _bad(spec: StructuredOutput, message: str) -> SamplingParamsError:
    return SamplingParamsError(spec.param, f"{spec.param}: {message}")


def grammar_source(spec: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) for ``spec``; pure, no tokenizer needed.

    Raises:
        SamplingParamsError: ``spec`` is malformed (naming ``spec.param``): a schema that is not a
            JSON object, choices that are not a non-empty JSON array of strings, or a source longer
            than :data:`MAX_GRAMMAR_CHARS`.
    """
    import llguidance

    if len(spec.value) > MAX_GRAMMAR_CHARS:
        raise _bad(spec, f"the grammar source has {len(spec.value)} characters; at most {MAX_GRAMMAR_CHARS}")
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.value)
        except ValueError as exc:
            raise _bad(spec, f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise _bad(spec, f"the JSON schema must be a JSON object, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(spec.value)
    if spec.kind == "choice":
        try:
            choices = json.loads(spec.value)
        except ValueError as exc:
            raise _bad(spec, f"the choices are not valid JSON: {exc}") from None
        if (not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in choices)):
            raise _bad(spec, f"choices must be a list of 1 to {MAX_CHOICES} non-empty strings")
        # Lark string literals take JSON's escapes
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    raise _bad(spec, f"unknown structured-output kind {spec.kind!r}")


class GrammarCompiler:
    """Compiles :class:`StructuredOutput` specs against one tokenizer and makes matchers.

    The llguidance tokenizer is built on first use (0.3-0.7 s for SmolLM2's 49k vocabulary:
    bench/grammar_libraries.py, "tokenizer set-up") and shared; compiled grammars are cached by spec (:data:`CACHE_SIZE`). Safe to
    call from several threads (requests are added from the HTTP server's thread).

    Args:
        hf_tokenizer: a ``transformers`` fast tokenizer.
        vocab_size: columns of the model's logits (may exceed the tokenizer's vocabulary; the extra
            ids are never allowed).
        eos_token_ids: the ids that end a generation; a finished grammar allows only these.
    """

    CACHE_SIZE = 256

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._lock = threading.Lock()
        self._tokenizer = None
        self._compiled: OrderedDict[StructuredOutput, str] = OrderedDict()  # spec -> its validated grammar

    @property
    def ll_tokenizer(self):
        """The llguidance tokenizer (built once, from :func:`byte_level_json`)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                self._tokenizer = llguidance.LLTokenizer(
                    byte_level_json(self._hf.backend_tokenizer), n_vocab=self.vocab_size, eos_token=self._eos or None)
            return self._tokenizer

    def compile(self, spec: StructuredOutput) -> str:
        """The validated grammar of ``spec`` (cached by spec: the API checks a request's spec and the
        engine compiles it again when the request is added, and the second time is a lookup).

        Raises:
            SamplingParamsError: the spec is malformed, its grammar does not compile, or llguidance
                cannot read the tokenizer's vocabulary (e.g. the word-level tokenizer of the
                random-weight presets); naming ``spec.param`` and quoting llguidance's message.
        """
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        source = grammar_source(spec)
        import llguidance

        try:
            tokenizer = self.ll_tokenizer
        except ValueError as exc:  # llguidance reads byte-level BPE and SentencePiece vocabularies
            raise _bad(spec, f"structured output is not available for this model's tokenizer: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(source, tokenizer)
        if error:
            raise _bad(spec, f"invalid {spec.kind.replace('_', ' ')}: {error}")
        with self._lock:
            self._compiled[spec] = source
            while len(self._compiled) > self.CACHE_SIZE:
                self._compiled.popitem(last=False)
        return source

    def matcher(self, grammar: str):
        """A new ``llguidance.LLMatcher`` for a grammar returned by :meth:`compile` (one per
        sequence: it holds the sequence's position in the grammar)."""
        import llguidance

        return llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)


def byte_level_json(backend) -> str:
    """The ``tokenizers`` JSON of ``backend`` (a ``tokenizers.Tokenizer``) for llguidance, which
    reads how token strings map to bytes from the decoder: a byte-level BPE vocabulary (its
    pre-tokenizer is ``ByteLevel``, alone or in a ``Sequence``) gets the plain ``ByteLevel``
    decoder. Some transformers versions build a GGUF tokenizer's decoder as a ``Sequence`` that
    starts with SentencePiece steps (``ByteFallback``, ``Replace("▁", " ")``) before ``ByteLevel``;
    llguidance then reads ``Ġ`` as two literal bytes instead of a space, and a grammar refuses
    every token that starts with a space (seen on transformers 5.17 with SmolLM2's GGUF).
    Other vocabularies pass through unchanged."""
    data = json.loads(backend.to_str())
    pre = data.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if any(step.get("type") == "ByteLevel" for step in steps):
        data["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    data["padding"] = data["truncation"] = None
    return json.dumps(data)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of an allowed-token bitmask: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


def fill_bitmask(matchers: list, vocab_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The allowed-token bitmask of a batch, on the host.

    Args:
        matchers: one entry per row: an ``LLMatcher`` (its next allowed tokens) or None
            (unconstrained: every token allowed).
        vocab_size: columns of the logits.
        out: a host int32 tensor of at least ``len(matchers)`` rows of ``ceil(vocab_size / 32)``
            words to fill (e.g. pinned, reused step after step), or None for a new one.

    Returns:
        int32 [len(matchers), ceil(vocab_size / 32)] (the first rows of ``out``); bit ``t % 32`` of
        word ``t // 32`` is set when token ``t`` is allowed.
    """
    import llguidance.torch

    shape = (len(matchers), bitmask_width(vocab_size))
    mask = torch.empty(shape, dtype=torch.int32) if out is None else out[: shape[0]]
    mask.fill_(-1)
    rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
    if len(rows) == 1:
        llguidance.torch.fill_next_token_bitmask(rows[0][0], mask, rows[0][1])
    elif rows:
        llguidance.torch.fill_next_token_bitmask_par(_executor(), rows, mask)
    return mask


_EXECUTOR = None


def _executor():
    """llguidance's thread pool for filling many rows' masks at once (built once)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of tokens a row's bitmask does not allow to -inf.

    Args:
        logits: float32 [S, V].
        bitmask: int32 [S, ceil(V / 32)] on the logits' device (:func:`fill_bitmask`).

    Returns:
        a new float32 [S, V] tensor.
    """
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, : logits.shape[1]]
    return logits.masked_fill(allowed == 0, float("-inf"))


def advance_grammar(seq: Sequence, tokens: list[int], finish: Finish | None) -> Finish | None:
    """Move ``seq``'s grammar matcher over its newly appended ``tokens``; the stop condition after them.

    A matcher that has stopped (the grammar is complete and its end-of-sequence token was sampled)
    finishes the sequence with ``"stop"`` even under ``ignore_eos``. A token the matcher rejects
    cannot be sampled under its mask, so a rejection is an engine fault: it is logged and the
    sequence ends with ``"abort"`` rather than emit output that breaks the grammar.
    """
    matcher = seq.matcher
    if not matcher.consume_tokens(tokens) or matcher.is_error():
        log.error("sequence %s: its grammar rejected token(s) %s: %s", seq.seq_id, tokens, matcher.get_error())
        return Finish(FinishReason.ABORT)
    if finish is None and matcher.is_stopped():
        return Finish(FinishReason.STOP)
    return finish
