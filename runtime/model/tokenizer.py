"""Text <-> token ids, chat templates and streaming detokenisation.

:class:`Tokenizer` wraps a ``transformers`` fast tokenizer (backed by the ``tokenizers`` library);
it is built from a Hugging Face directory (``tokenizer.json`` / ``tokenizer_config.json``) or from
GGUF metadata through transformers' GGUF converter, so no BPE code of our own is involved.
Chat templates are Jinja2 templates (Hugging Face convention) rendered by transformers' own
chat-template renderer (Jinja2's immutable sandbox), with tools, documents and extra template
variables passed through. :class:`IncrementalDetokenizer` turns a stream of generated token ids
into text deltas.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any


class TokenizerError(RuntimeError):
    """The tokenizer files could not be read, or a chat template is missing or failed to render."""


class Tokenizer:
    """A fast tokenizer plus the model's special ids and chat template.

    Args:
        hf_tokenizer: a ``transformers`` tokenizer (``PreTrainedTokenizerBase``) with a fast backend.
        chat_template: Jinja2 chat template source; defaults to ``hf_tokenizer.chat_template``.
        eos_token_ids: ids that end a generation; defaults to the tokenizer's ``eos_token_id``.
        bos_token_id: defaults to the tokenizer's ``bos_token_id``.
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        chat_template: str | None = None,
        eos_token_ids: Iterable[int] | None = None,
        bos_token_id: int | None = None,
    ) -> None:
        self._hf = hf_tokenizer
        self.chat_template: str | None = chat_template or getattr(hf_tokenizer, "chat_template", None)
        if eos_token_ids is None:
            eos = hf_tokenizer.eos_token_id
            eos_token_ids = () if eos is None else (eos,)
        self.eos_token_ids: tuple[int, ...] = tuple(int(e) for e in eos_token_ids)
        self.bos_token_id: int | None = bos_token_id if bos_token_id is not None else hf_tokenizer.bos_token_id

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_hf_dir(cls, path: str | Path, **kwargs: Any) -> Tokenizer:
        """Load from a Hugging Face model directory (local files only, never the hub).

        Raises:
            TokenizerError: the directory holds no readable tokenizer files.
        """
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, TypeError) as exc:
            raise TokenizerError(f"cannot load a tokenizer from directory {str(path)!r}: {exc}") from exc
        return cls(hf, **kwargs)

    @classmethod
    def from_gguf(cls, path: str | Path, **kwargs: Any) -> Tokenizer:
        """Build from a GGUF file's ``tokenizer.*`` metadata (transformers' GGUF tokenizer converter).

        The chat template is the file's ``tokenizer.chat_template``.

        Raises:
            TokenizerError: the file has no tokenizer metadata transformers can convert.
        """
        from transformers import AutoTokenizer

        path = Path(path)
        try:
            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise TokenizerError(f"cannot build a tokenizer from GGUF file {str(path)!r}: {exc}") from exc
        return cls(hf, **kwargs)

    # ------------------------------------------------------------------ properties

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped ``transformers`` tokenizer."""
        return self._hf

    @cached_property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return len(self._hf)

    @cached_property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of special tokens (removed by ``decode(..., skip_special_tokens=True)``)."""
        return frozenset(self._hf.all_special_ids)

    @property
    def eos_token(self) -> str | None:
        """Text of the first end-of-sequence token."""
        return self._hf.convert_ids_to_tokens(self.eos_token_ids[0]) if self.eos_token_ids else None

    @property
    def bos_token(self) -> str | None:
        """Text of the beginning-of-sequence token."""
        return self._hf.convert_ids_to_tokens(self.bos_token_id) if self.bos_token_id is not None else None

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer's post-processor adds (e.g. BOS)."""
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids; special tokens are dropped when ``skip_special_tokens``.

        Calls the Rust ``tokenizers`` backend directly when the transformers wrapper would add
        nothing (no clean-up of tokenization spaces): the same text, without the wrapper's per-call
        overhead (this runs for every sequence after every engine step).
        """
        backend = self._fast_decoder
        if backend is not None:
            return backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    CLEAN_UP_PROBE = "a . b , c ! d ? e ' f n't g 'm h 's i 've j 're"
    """Text with every pattern that transformers' ``clean_up_tokenization`` rewrites (a space before
    punctuation and English contractions)."""

    @cached_property
    def _fast_decoder(self):
        """The ``tokenizers.Tokenizer`` behind a fast transformers tokenizer whose ``decode`` adds
        nothing to it, or None (then ``decode`` goes through transformers).

        Without ``clean_up_tokenization_spaces`` the wrapper adds nothing. With it, whether the
        wrapper rewrites the text depends on the transformers version (recent ones ignore it for
        byte-level BPE tokenizers, whose output it would corrupt), so the two decoders are compared
        on :data:`CLEAN_UP_PROBE` once.
        """
        backend = getattr(self._hf, "backend_tokenizer", None)
        if backend is None:
            return None
        if getattr(self._hf, "clean_up_tokenization_spaces", True):
            probe = self._hf.encode(self.CLEAN_UP_PROBE, add_special_tokens=False)
            if backend.decode(probe, skip_special_tokens=True) != self._hf.decode(probe, skip_special_tokens=True):
                return None
        return backend

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary strings (byte-level BPE symbols, not decoded text) of token ids."""
        return list(self._hf.convert_ids_to_tokens(list(ids)))

    def token_to_str(self, token_id: int) -> str:
        """Decoded text of one token (as it would appear alone; may be a partial UTF-8 character)."""
        return self._hf.decode([token_id], skip_special_tokens=False)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's chat template through transformers' own renderer
        (``PreTrainedTokenizerBase.apply_chat_template``, ``tokenize=False``): Jinja2's immutable
        sandbox with the helpers Hugging Face templates use (``raise_exception``, ``tojson``,
        ``strftime_now``, the ``generation`` tag).

        Args:
            messages: OpenAI-shaped messages (``{"role", "content"}``, plus ``tool_calls`` with
                ``arguments`` as a dict, ``tool_call_id``, ``name``, ...); keys whose value is None
                are dropped before rendering, as transformers does.
            add_generation_prompt: open the assistant's turn at the end.
            tools: JSON-schema tool definitions (``{"type": "function", "function": {...}}``), or None.
            documents: retrieval documents (dicts, e.g. ``{"title", "text"}``), or None.
            chat_template: a template source to use instead of :attr:`chat_template`.
            template_kwargs: more template variables (a request's ``chat_template_kwargs``); none
                may be one of :data:`RESERVED_TEMPLATE_KWARGS`.

        The template also sees ``bos_token``, ``eos_token``, ``unk_token`` and ``pad_token``
        (``""`` when the tokenizer has none; a template variable of the same name overrides
        them). The prompt text already holds the special tokens the template writes; encode it
        with ``add_special_tokens=False``.

        Raises:
            TokenizerError: there is no chat template, a reserved variable is passed, the template
                is not valid Jinja2, or rendering failed (the message carries the template's own
                error, e.g. from ``raise_exception``).
        """
        source = chat_template or self.chat_template
        if not source:
            raise TokenizerError("the model has no chat template (tokenizer.chat_template is empty)")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs))
        if reserved:
            raise TokenizerError(f"template variable {reserved[0]!r} is set by the renderer itself")
        import jinja2

        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "unk_token": self._hf.unk_token or "",
            "pad_token": self._hf.pad_token or "",
            **template_kwargs,
        }
        try:
            return self._hf.apply_chat_template(
                messages, tools=tools, documents=documents, chat_template=source,
                add_generation_prompt=add_generation_prompt, tokenize=False, **context)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(f"chat template is not valid Jinja2 (line {exc.lineno}): {exc.message}") from exc
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise TokenizerError(f"chat template failed to render: {exc}") from exc

    def template_variables(self, chat_template: str | None = None) -> frozenset[str] | None:
        """The variables a chat template reads from its context (Jinja2's
        ``meta.find_undeclared_variables``): what a request's ``chat_template_kwargs`` may set.
        None when the template cannot be parsed (rendering then reports why)."""
        return _template_variables(chat_template or self.chat_template or "")


RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "chat_template",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})
"""Names :meth:`Tokenizer.apply_chat_template` sets itself, or that transformers' renderer reads
as its own arguments (``tokenize``, ``return_dict``, ...): never template variables of a request."""

_GENERATION_TAG = re.compile(r"{%-?\s*(?:end)?generation\s*-?%}")


@lru_cache(maxsize=16)
def _template_variables(source: str) -> frozenset[str] | None:
    import jinja2
    import jinja2.ext
    import jinja2.meta

    env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols])
    try:  # the ``generation`` tag is transformers' extension; it reads no variable
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(_GENERATION_TAG.sub("", source))))
    except jinja2.TemplateSyntaxError:
        return None


class IncrementalDetokenizer:
    """Turns generated token ids, fed a few at a time, into text deltas.

    The concatenation of every delta (after :meth:`flush`) equals
    ``tokenizer.decode(all_generated_ids, skip_special_tokens)`` for byte-level BPE tokenizers.
    Two offsets into the id list bound a short decoding window, so each step costs O(window)
    rather than O(generated length): text is emitted once the window decodes to more text than its
    already-emitted prefix and does not end in U+FFFD (an incomplete UTF-8 sequence split across
    byte-level tokens is held back until its last byte arrives).

    Args:
        tokenizer: the model's :class:`Tokenizer`.
        prompt_ids: optional prompt tail used as left context (a few tokens suffice), so that the
            first generated token decodes as it does after the prompt (e.g. a leading space in
            SentencePiece vocabularies).
        skip_special_tokens: drop special tokens from the text, as ``decode`` does.
    """

    CONTEXT_TOKENS = 6
    """Prompt tokens kept as left context for the first decoding window."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-self.CONTEXT_TOKENS:]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._num_context = len(self._ids)
        self.text = ""
        """All text emitted so far."""

    @property
    def token_ids(self) -> list[int]:
        """The generated ids fed so far (without the prompt context)."""
        return self._ids[self._num_context:]

    def feed(self, token_ids: int | Iterable[int]) -> str:
        """Add generated token id(s); return the newly completed text (possibly ``""``)."""
        if isinstance(token_ids, int):
            self._ids.append(token_ids)
        else:
            self._ids.extend(token_ids)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        new_text = decode(self._ids[self._prefix_offset:], self._skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (e.g. an incomplete UTF-8 sequence at the end of generation)."""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        new_text = decode(self._ids[self._prefix_offset:], self._skip)
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta
