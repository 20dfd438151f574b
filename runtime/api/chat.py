"""``POST /v1/chat/completions``: messages -> the model's chat template -> engine -> response or stream.

Message content is text, or a list of ``{"type": "text", "text": ...}`` parts (joined); other
part types are a 400 naming the part. The prompt is the chat template rendered by the tokenizer
library (runtime/model/tokenizer.py) with the generation prompt (unless ``add_generation_prompt``
is false), the request's ``tools`` (runtime/api/tools.py), ``documents`` and
``chat_template_kwargs`` (template variables; each must be one the template reads); the output
length is ``max_completion_tokens`` or ``max_tokens``. A stream opens each choice with a
``{"role": "assistant", "content": ""}`` delta, then sends text deltas.

With tools (``tool_choice`` not ``none``) the output is parsed by the worker's tool-call parser
(runtime/api/tool_parsers.py): calls become ``message.tool_calls`` (streamed as
``delta.tool_calls`` fragments), the rest ``content``, and ``finish_reason`` is ``tool_calls``
when the output holds calls and ended normally (``length`` and ``abort`` stay what they are).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse, Response

from ..engine.async_engine import EngineDeadError, EngineOverloadedError
from ..engine.output import CompletedChoice, RequestOutput
from ..engine.sequence import TokenLogprob
from ..model.tokenizer import RESERVED_TEMPLATE_KWARGS, TokenizerError
from .completions import (
    check_fan_out,
    check_room,
    check_length,
    check_model,
    collect_final,
    disconnected,
    merge_streams,
    engine_params,
    event_stream,
    stream_error,
)
from .logprobs import memoised, prompt_logprobs_json
from .protocol import (TEXT_SLOT, APIError, ChatCompletionRequest, ChatMessage, new_request_id, openai_finish_reason,
                       sse_event, sse_text_template, structured_output, token_usage)
from .tool_parsers import ToolCallParser, ToolCallStreamer, resolve_parser
from .tools import ToolPlan, plan_tools, template_messages

if TYPE_CHECKING:
    from .app import ServerState


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, receive) -> Response:
    """Answer a chat request: a JSON ``chat.completion``, a stream of ``chat.completion.chunk``
    events (``req.stream``), or status 499 when a non-streaming client disconnected first.

    Raises:
        APIError: 404 for another model; 400 for ``top_logprobs`` without ``logprobs``, a
            non-text content part, tools or template inputs that do not fit (:func:`plan_tools`,
            :func:`check_template_inputs`), two output constraints, messages the chat template
            refuses, a too long prompt, an invalid sampling value, or an ``n`` above the sequences
            one request may create; 503 when the engine has no room (:func:`completions.check_room`).
    """
    check_model(state, req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs", code="invalid_value")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "prompt_logprobs: not supported on streamed chat completions (request them without "
                            "stream, or from /v1/completions)", param="prompt_logprobs", code="unsupported")
    plan = plan_tools(req, tool_parser(state), state.tokenizer.chat_template)
    structured = structured_output(req, plan.constraint)
    check_template_inputs(state, req)
    prompt = await _chat_prompt(state, req, plan)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = check_length(state, prompt, requested, "messages", max_param)
    params = engine_params(state, req, max_tokens=max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                           structured=structured, prompt_logprobs=req.prompt_logprobs)
    check_fan_out(state, 1, req.n, "messages")
    check_room(state, req.n)
    rid = new_request_id("chatcmpl")
    created = int(time.time())
    if req.stream:
        streams = [state.engine.generate(rid, prompt, params, abort_reason=disconnected())]
        return await event_stream(_chat_events(state, req, plan, rid, created, streams), receive)
    result = await collect_final(state.engine, [(rid, prompt, params)], req.n, receive)
    if result is None:
        return Response(status_code=499)
    choices, prompt_tokens, completion_tokens = result
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
        "choices": [_choice(state, req, plan, idx, c) for idx, c in sorted(choices.items())],
        "usage": token_usage(prompt_tokens, completion_tokens),
        # vLLM's place for chat: the response, not each choice (the prompt is the request's)
        **({"prompt_logprobs": prompt_logprobs_json(memoised(state.tokenizer.token_to_str),
                                                    choices[0].prompt_logprobs or [], req.prompt_logprobs)}
           if req.prompt_logprobs is not None else {}),
    })


def tool_parser(state: ServerState) -> ToolCallParser | None:
    """The worker's tool-call parser (``state.tool_call_parser``, ``auto`` read from the model's
    chat template), or None."""
    return resolve_parser(state.tool_call_parser, state.tokenizer.chat_template)


def check_template_inputs(state: ServerState, req: ChatCompletionRequest) -> None:
    """Check that the chat template takes what the request gives it beyond the messages.

    Raises:
        APIError: 400 naming ``documents`` when the template never mentions them, or
            ``chat_template_kwargs.<key>`` for a variable the server sets itself
            (``tokenizer.RESERVED_TEMPLATE_KWARGS``: ``add_generation_prompt``, ``tools``, ...)
            or one the template does not read.
    """
    template = state.tokenizer.chat_template or ""
    if req.documents is not None and "documents" not in template:
        raise APIError(400, "documents: the model's chat template does not render documents", param="documents",
                       code="unsupported")
    variables = state.tokenizer.template_variables() if req.chat_template_kwargs else None
    for key in req.chat_template_kwargs or {}:
        param = f"chat_template_kwargs.{key}"
        if key in RESERVED_TEMPLATE_KWARGS:
            raise APIError(400, f"{param}: set by the server from the request (send the request field of that name, "
                           "where there is one)", param=param, code="invalid_value")
        if variables is not None and key not in variables:
            known = ", ".join(sorted(variables)) or "none"
            raise APIError(400, f"{param}: the model's chat template does not read this variable (it reads: {known})",
                           param=param, code="invalid_value")


async def _chat_prompt(state: ServerState, req: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
    """The prompt token ids: the messages rendered with the chat template (and the generation
    prompt, unless ``req.add_generation_prompt`` is false), encoded off the event loop.

    Raises:
        APIError: 400 for a content part that is not text, or messages the template refuses.
    """
    try:
        prompt_text = render_messages(state, req.messages, add_generation_prompt=req.add_generation_prompt, plan=plan,
                                      documents=req.documents, template_kwargs=req.chat_template_kwargs)
    except TokenizerError as exc:
        raise APIError(400, f"messages: {exc}", param="messages", code="invalid_value") from exc
    return await asyncio.to_thread(state.tokenizer.encode, prompt_text, add_special_tokens=False)


def render_messages(state: ServerState, chat: list[ChatMessage], *, add_generation_prompt: bool,
                    plan: ToolPlan | None = None, documents: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> str:
    """The prompt text of chat messages: their text parts joined, earlier tool calls and the
    tools shaped for the template (:func:`tools.template_messages`; ``plan`` None: no tools),
    rendered with the model's chat template (``/v1/chat/completions`` and ``/tokenize``).

    Raises:
        APIError: 400 for a content part that is not text, naming it, or an earlier tool call the
            template cannot be given (:func:`tools.template_messages`).
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
    tokenizer = state.tokenizer
    plan = plan or ToolPlan(family=tool_parser(state))
    messages = template_messages(messages, plan, tokenizer.chat_template)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tools=plan.template_tools, documents=documents, **(template_kwargs or {}))


def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """``tool_calls`` for an output with calls that stopped normally, else the engine's reason."""
    return "tool_calls" if has_calls and reason == "stop" else openai_finish_reason(reason)


def _choice(state: ServerState, req: ChatCompletionRequest, plan: ToolPlan, idx: int, c: CompletedChoice) -> dict:
    """One choice of a ``chat.completion``: the message (parsed into ``content`` and
    ``tool_calls`` when the plan parses), log-probabilities and finish reason."""
    message: dict = {"role": "assistant", "content": c.text}
    calls = []
    if plan.parse:
        message["content"], calls = plan.family.parse(c.text, plan.max_calls)
        if calls:
            message["tool_calls"] = [call.openai() for call in calls]
    return {"index": idx, "message": message, "logprobs": _chat_logprobs(state, req, c.logprobs),
            "finish_reason": _finish_reason(c.finish_reason, bool(calls)), "stop_reason": c.stop_reason}


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


def _deltas(plan: ToolPlan, streamers: dict[int, ToolCallStreamer], index: int, text: str,
            finished: bool) -> list[dict]:
    """The deltas of one choice's new text: the text itself, or what the choice's tool-call
    streamer makes of it (all it held back once ``finished``)."""
    if not plan.parse:
        return [{"content": text}] if text else []
    streamer = streamers.get(index)
    if streamer is None:
        streamer = streamers[index] = plan.family.streamer(plan.max_calls)
    deltas = streamer.feed(text) if text else []
    return deltas + streamer.finish() if finished else deltas


async def _chat_events(state: ServerState, req: ChatCompletionRequest, plan: ToolPlan, rid: str, created: int,
                       streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
    """The server-sent events of a streamed chat completion: the role delta opening each choice,
    a chunk per delta (text, or tool-call fragments when the plan parses; the engine update's
    log-probabilities on its first chunk, the finish reason on its last), the usage chunk when
    asked for, then ``[DONE]``. An engine failure is sent as an error event before ``[DONE]``."""
    usage = None
    started: set[int] = set()
    streamers: dict[int, ToolCallStreamer] = {}
    content_chunks: dict[int, Callable[[str], str]] = {}  # per choice: the common chunk, pre-serialised

    def payload(index: int, delta: dict, logprobs: dict | None, finish_reason: str | None) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}

    def chunk(index: int, delta: dict, logprobs: dict | None, finish_reason: str | None) -> str:
        if logprobs is None and finish_reason is None and delta.keys() == {"content"}:
            template = content_chunks.get(index)
            if template is None:
                template = content_chunks[index] = sse_text_template(payload(index, {"content": TEXT_SLOT}, None, None))
            return template(delta["content"])
        return sse_event(payload(index, delta, logprobs, finish_reason))

    async with contextlib.aclosing(merge_streams(streams)) as merged:
        try:
            async for _, out in merged:
                events = []  # one write per engine update: a run's chunks leave together
                for c in out.choices:
                    if c.index not in started:
                        started.add(c.index)
                        events.append(chunk(c.index, {"role": "assistant", "content": ""}, None, None))
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    deltas = _deltas(plan, streamers, c.index, c.text, c.finish_reason is not None)
                    if not deltas and plan.parse and c.finish_reason is None and not req.logprobs:
                        continue  # text the tool-call parser holds back: no empty chunk for it
                    deltas = deltas or [{}]
                    has_calls = c.index in streamers and streamers[c.index].num_calls > 0
                    reason = _finish_reason(c.finish_reason, has_calls)
                    logprobs = _chat_logprobs(state, req, c.logprobs)
                    events += [chunk(c.index, d, logprobs if k == 0 else None, reason if k == len(deltas) - 1 else None)
                               for k, d in enumerate(deltas)]
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
