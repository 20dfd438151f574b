"""``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer, as vLLM's server
exposes it (evaluation harnesses count and cut prompts with them before they send requests).

``/tokenize`` takes a ``prompt`` (text) or chat ``messages`` (rendered with the model's chat
template, exactly as ``/v1/chat/completions`` renders them) and answers ``{"tokens", "count",
"max_model_len"}``; ``/detokenize`` takes ``tokens`` (ids in the vocabulary) and answers
``{"prompt"}``. Errors are 400s in the OpenAI error shape naming the field.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..model.tokenizer import TokenizerError
from .chat import render_messages
from .completions import check_model
from .protocol import APIError, ChatMessage, Text

if TYPE_CHECKING:
    from .app import ServerState


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: exactly one of ``prompt`` and ``messages``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = Field(True, description="For a prompt: the tokenizer's BOS (and the like), "
                                     "as /v1/completions adds them.")
    add_generation_prompt: bool = Field(True, description="For messages: the assistant turn's opening, "
                                        "as /v1/chat/completions adds it.")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids back to text (special tokens kept, as they were sent)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    tokens: list[int] = Field(..., max_length=1 << 20)


async def tokenize(state: ServerState, req: TokenizeRequest) -> dict:
    """The token ids of a prompt or of rendered chat messages.

    Raises:
        APIError: 404 for another model; 400 for messages the chat template refuses.
    """
    check_model(state, req.model)
    tok = state.tokenizer
    if req.prompt is not None:
        ids = await asyncio.to_thread(tok.encode, req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        try:
            text = render_messages(state, req.messages, add_generation_prompt=req.add_generation_prompt)
        except TokenizerError as exc:
            raise APIError(400, f"messages: {exc}", param="messages", code="invalid_value") from exc
        ids = await asyncio.to_thread(tok.encode, text, add_special_tokens=False)
    return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}


async def detokenize(state: ServerState, req: DetokenizeRequest) -> dict:
    """The text of token ids.

    Raises:
        APIError: 404 for another model; 400 for an id outside the vocabulary, naming it.
    """
    check_model(state, req.model)
    vocab = state.engine.engine.config.vocab_size
    bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens[{bad}]: token id {req.tokens[bad]} is outside the vocabulary [0, {vocab})",
                       param=f"tokens[{bad}]", code="invalid_value")
    text = await asyncio.to_thread(state.tokenizer.decode, req.tokens, skip_special_tokens=False)
    return {"prompt": text}
