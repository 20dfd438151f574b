"""``POST /v1/chat/completions``: messages -> the model's chat template -> engine -> response or stream.

Message content is text, or a list of ``{"type": "text", "text": ...}`` parts (joined); other
part types are a 400 naming the part. The prompt is the chat template applied with the
generation prompt (unless ``add_generation_prompt`` is false); the output length is ``max_completion_tokens`` or ``max_tokens``. A stream
opens each choice with a ``{"role": "assistant", "content": ""}`` delta, then sends text deltas.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine.async_engine import EngineDeadError, EngineOverloadedError
from ..engine.output import RequestOutput
from ..engine.sequence import TokenLogprob
from ..model.tokenizer import TokenizerError
from .completions import (
    check_fan_out,
    check_room,
    check_length,
    check_model,
    collect_final,
    disconnected,
    engine_params,
    merge_streams,
    stream_error,
)
from .protocol import (APIError, ChatCompletionRequest, ChatMessage, new_request_id, openai_finish_reason, sse_event,
                       token_usage)

if TYPE_CHECKING:
    from .app import ServerState


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, receive) -> Response:
    """Answer a chat request: a JSON ``chat.completion``, a stream of ``chat.completion.chunk``
    events (``req.stream``), or status 499 when a non-streaming client disconnected first.

    Raises:
        APIError: 404 for another model; 400 for ``top_logprobs`` without ``logprobs``, a
            non-text content part, messages the chat template refuses, a too long prompt, an
            invalid sampling value, or an ``n`` above the sequences one request may create; 503
            when the engine has no room (:func:`completions.check_room`).
    """
    check_model(state, req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs", code="invalid_value")
    prompt = await _chat_prompt(state, req)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = check_length(state, prompt, requested, "messages", max_param)
    params = engine_params(state, req, max_tokens=max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None)
    check_fan_out(state, 1, req.n, "messages")
    check_room(state, req.n)
    rid = new_request_id("chatcmpl")
    created = int(time.time())
    if req.stream:
        streams = [state.engine.generate(rid, prompt, params, abort_reason=disconnected())]
        return StreamingResponse(_chat_events(state, req, rid, created, streams), media_type="text/event-stream")
    result = await collect_final(state.engine, [(rid, prompt, params)], req.n, receive)
    if result is None:
        return Response(status_code=499)
    choices, prompt_tokens, completion_tokens = result
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
        "choices": [
            {"index": idx, "message": {"role": "assistant", "content": c.text},
             "logprobs": _chat_logprobs(state, req, c.logprobs), "finish_reason": openai_finish_reason(c.finish_reason),
             "stop_reason": c.stop_reason}
            for idx, c in sorted(choices.items())
        ],
        "usage": token_usage(prompt_tokens, completion_tokens),
    })


async def _chat_prompt(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    """The prompt token ids: the messages rendered with the chat template (and the generation
    prompt, unless ``req.add_generation_prompt`` is false), encoded off the event loop.

    Raises:
        APIError: 400 for a content part that is not text, or messages the template refuses.
    """
    try:
        prompt_text = render_messages(state, req.messages, add_generation_prompt=req.add_generation_prompt)
    except TokenizerError as exc:
        raise APIError(400, f"messages: {exc}", param="messages", code="invalid_value") from exc
    return await asyncio.to_thread(state.tokenizer.encode, prompt_text, add_special_tokens=False)


def render_messages(state: ServerState, chat: list[ChatMessage], *, add_generation_prompt: bool) -> str:
    """The prompt text of chat messages: their text parts joined, rendered with the model's chat
    template (``/v1/chat/completions`` and ``/tokenize``).

    Raises:
        APIError: 400 for a content part that is not text, naming it.
        TokenizerError: the template refuses the messages.
    """
    messages = []
    for i, m in enumerate(chat):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content[{j}]: only text parts are supported",
                                   param=f"messages[{i}].content[{j}]", code="invalid_value")
                texts.append(part["text"])
            content = "".join(texts)
        messages.append({**m.model_dump(exclude_none=True), "content": content or ""})
    return state.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)


def _chat_logprobs(state: ServerState, req: ChatCompletionRequest, entries: list[TokenLogprob] | None) -> dict | None:
    """The chat ``logprobs`` object (``content``: token, logprob, UTF-8 bytes and the top
    alternatives of each token); None when not asked for."""
    if not req.logprobs or entries is None:
        return None
    token_str = state.tokenizer.token_to_str

    def item(t: int, lp: float) -> dict:
        s = token_str(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


async def _chat_events(state: ServerState, req: ChatCompletionRequest, rid: str, created: int,
                       streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
    """The server-sent events of a streamed chat completion: the role delta opening each choice,
    a chunk per text delta, the usage chunk when asked for, then ``[DONE]``. An engine failure is
    sent as an error event before ``[DONE]``."""
    usage = None
    started: set[int] = set()

    def chunk(choices: list[dict]) -> str:
        return sse_event({"id": rid, "object": "chat.completion.chunk", "created": created,
                          "model": state.model_name, "choices": choices})

    async with contextlib.aclosing(merge_streams(streams)) as merged:
        try:
            async for _, out in merged:
                events = []  # one write per engine update: a run's chunks leave together
                for c in out.choices:
                    if c.index not in started:
                        started.add(c.index)
                        events.append(chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]))
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    events.append(chunk([{"index": c.index, "delta": {"content": c.text} if c.text else {},
                                          "logprobs": _chat_logprobs(state, req, c.logprobs),
                                          "finish_reason": openai_finish_reason(c.finish_reason)}]))
                if events:
                    yield "".join(events)
                if out.finished:
                    usage = token_usage(out.num_prompt_tokens, out.num_output_tokens)
        except (EngineDeadError, EngineOverloadedError) as exc:
            yield stream_error(exc)
    if req.stream_options and req.stream_options.include_usage and usage is not None:
        yield sse_event({"id": rid, "object": "chat.completion.chunk", "created": created,
                         "model": state.model_name, "choices": [], "usage": usage})
    yield sse_event("[DONE]")
