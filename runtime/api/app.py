"""The worker's HTTP API: OpenAI-compatible completions and chat, health, readiness and metrics.

Routes:

- ``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI request and response shapes,
  non-streaming or streamed as server-sent events (``data: {chunk}`` lines, then ``data: [DONE]``).
  Extensions accepted as vLLM does: ``top_k``, ``min_p``, ``repetition_penalty``,
  ``stop_token_ids``, ``ignore_eos``.
- ``GET /v1/models``: the served model.
- ``GET /healthz``: 200 while the engine loop is alive.
- ``GET /readyz``: 200 only when :class:`Readiness` says so (the lifecycle gates it, e.g. on graph
  capture and canaries) and the engine is alive; 503 with the reason otherwise.
- ``GET /metrics``: Prometheus text format of the engine's registry.

Errors use the OpenAI body ``{"error": {"message", "type", "param", "code"}}``: invalid fields and
malformed JSON are 400 with ``param`` naming the field, an unknown model is 404. Field types are
strict (``"max_tokens": "5"`` is a 400, not coerced); at most 16 stop strings of up to 256
characters (``sequence.MAX_STOP_STRINGS``). Non-streaming requests are answered when every choice
has finished (the engine reports each choice once). A request that
fails validation never reaches the engine, so other requests are unaffected. A client that
disconnects (streaming or not) cancels its request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.core import AsyncLLMEngine, CompletedChoice, EngineDeadError, RequestError, RequestOutput
from ..engine.metrics import CONTENT_TYPE, EngineMetrics
from ..engine.sequence import SamplingParams, SamplingParamsError, TokenLogprob

log = logging.getLogger(__name__)


# -- errors -------------------------------------------------------------------------------------
class APIError(Exception):
    """An error returned to the client in the OpenAI shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _loc_to_param(loc: tuple) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"``."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p in ("str", "list[str]", "list[int]", "list[list[int]]", "function-after[_check(), str]"):
            continue  # union-member tags pydantic adds to the location
        else:
            out += f".{p}" if out else str(p)
    return out or None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request", "type": "value_error"}
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx", {}).get("error", "")
        return APIError(400, f"Malformed JSON body: {ctx}".rstrip(": "), param="body", code="invalid_json")
    param = _loc_to_param(tuple(first.get("loc", ())))
    if param is None:
        return APIError(400, f"body: {first.get('msg')}", param="body", code="invalid_request")
    msg = first.get("msg", "invalid value")
    if "input" in first and first.get("type") != "missing":
        msg += f" (got {json.dumps(first['input'], default=str)[:200]})"
    return APIError(400, f"{param}: {msg}", param=param, code="invalid_value" if first.get("type") != "missing" else "missing_field")


# -- request models -------------------------------------------------------------------------------
class _Request(BaseModel):
    # Unknown fields are ignored (OpenAI clients send fields we do not use, e.g. "user"). Types are
    # strict, as in the OpenAI API: "max_tokens": "5" or "stream": 1 is a 400 naming the field, not
    # silently coerced (an integer is still accepted where a number is expected).
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=2**31)
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()



MAX_BODY_BYTES = 8 * 2**20
"""Largest request body accepted (bytes); larger ones get a 413 before they are read."""


class BodyLimit:
    """ASGI middleware: no request body above :data:`MAX_BODY_BYTES` reaches the routes.

    A declared Content-Length above the limit gets a 413 at once, unread. A body without one
    (chunked transfer encoding) is read here, up to the limit, and handed to the routes in one
    piece; the chunk that crosses the limit gets the 413. Plain ASGI (not Starlette's
    BaseHTTPMiddleware), so client disconnects still reach the routes.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            length = dict(scope.get("headers") or []).get(b"content-length")
            if await _refused_by_length(length, scope, receive, send):
                return
            if length is None and scope.get("method") in ("POST", "PUT", "PATCH"):
                body = await _read_body(scope, receive, send, limited=True)
                if body is None:
                    return
                receive = _replayed(body, receive)
        await self.app(scope, receive, send)

    @staticmethod
    async def _too_large(what: str, scope, receive, send) -> None:
        response = APIError(413, f"{what}; the limit is {MAX_BODY_BYTES}", code="request_too_large").response()
        await response(scope, receive, send)


async def _refused_by_length(length: bytes | None, scope, receive, send) -> bool:
    """Answer 413 when the declared Content-Length ``length`` exceeds :data:`MAX_BODY_BYTES`
    (the body stays unread); True when it did."""
    if length is None or not length.isdigit() or int(length) <= MAX_BODY_BYTES:
        return False
    await BodyLimit._too_large(f"the request body is {int(length)} bytes", scope, receive, send)
    return True


async def _read_body(scope, receive, send, *, limited: bool) -> bytes | None:
    """The whole request body. With ``limited`` (no declared Content-Length), the chunk that
    crosses :data:`MAX_BODY_BYTES` gets the 413. None when the answer is sent or the client left."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if limited and size > MAX_BODY_BYTES:
            await BodyLimit._too_large(f"the request body exceeds {size - 1} bytes", scope, receive, send)
            return None
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _replayed(body: bytes, receive):
    """An ASGI ``receive`` that yields ``body`` as one message, then defers to ``receive``."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


class _ServerApp(FastAPI):
    """The FastAPI app, with a direct path for well-formed completion and chat requests.

    A POST to a path in ``fast_routes`` (path -> (request model, handler)) whose body is a JSON
    object (``Content-Type: application/json``) that the model validates goes straight to the
    handler, without FastAPI's middleware stack, router and dependency solving (about a third of
    the event loop's CPU per request). The body limit is enforced as :class:`BodyLimit` does.
    Every other request, and every body that does not validate, goes through the full app with the
    body replayed, so errors are exactly the app's. A handler's :class:`APIError` gets the same
    response as the app's exception handler; any other exception a 500, as Starlette answers.
    """

    fast_routes: dict[str, tuple[type[BaseModel], Any]] = {}

    async def __call__(self, scope, receive, send) -> None:
        route = self.fast_routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:
            await super().__call__(scope, receive, send)
            return
        length = content_type = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"content-type" and content_type is None:  # the first, as Starlette reads it
                content_type = value
        if await _refused_by_length(length, scope, receive, send):
            return
        body = await _read_body(scope, receive, send, limited=length is None)
        if body is None:
            return
        req = _parse_json_body(route[0], content_type, body)
        if req is None:
            await super().__call__(scope, _replayed(body, receive), send)
            return
        try:
            response = await route[1](req, receive)
        except APIError as exc:
            response = exc.response()
        except Exception:
            await PlainTextResponse("Internal Server Error", status_code=500)(scope, receive, send)
            raise
        await response(scope, receive, send)


def _parse_json_body(model: type[BaseModel], content_type: bytes | None, body: bytes) -> BaseModel | None:
    """``body`` validated as ``model`` when it is a JSON object sent as ``application/json`` and
    valid; None otherwise (the full app then answers, with its own error)."""
    if content_type is None or content_type.split(b";", 1)[0].strip().lower() != b"application/json":
        return None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if type(data) is not dict:
        return None
    try:
        return model.model_validate(data)
    except ValidationError:
        return None


# -- state --------------------------------------------------------------------------------------
@dataclass
class Readiness:
    """Whether the worker takes traffic; the lifecycle flips it (``/readyz`` reads it)."""

    ready: bool = False
    reason: str = "starting"

    def set_ready(self, reason: str = "ready") -> None:
        self.ready, self.reason = True, reason

    def set_not_ready(self, reason: str) -> None:
        self.ready, self.reason = False, reason


@dataclass
class ServerState:
    """What the routes need; kept on ``app.state.server``."""

    engine: AsyncLLMEngine
    model_name: str
    metrics: EngineMetrics | None = None
    readiness: Readiness = field(default_factory=Readiness)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len


# -- helpers ------------------------------------------------------------------------------------
def _sampling_params(req: _Request, *, max_tokens: int, logprobs: int | None) -> SamplingParams:
    if req.logit_bias:
        raise APIError(400, "logit_bias: not supported by this server", param="logit_bias", code="unsupported")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, f"best_of: only best_of == n is supported, got {req.best_of}", param="best_of", code="unsupported")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    try:
        return SamplingParams(
            n=req.n,
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            seed=req.seed,
            stop=stop,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
        )
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from exc


def _check_length(state: ServerState, prompt: list[int], requested: int | None, param: str, max_param: str) -> int:
    """Validate the prompt and the requested output length; return the max_tokens to use."""
    try:
        state.engine.engine.check_prompt(prompt, param)
    except RequestError as exc:
        raise APIError(400, str(exc), param=exc.param, code=exc.code) from exc
    room = state.max_model_len - len(prompt)
    if requested is not None and requested > room:
        raise APIError(
            400,
            f"{max_param}: this model's maximum context length is {state.max_model_len} tokens; the prompt has "
            f"{len(prompt)} tokens and {requested} were requested for the output (at most {room} fit)",
            param=max_param, code="context_length_exceeded",
        )
    return requested if requested is not None else room


_ID_BITS = random.Random()  # seeded once from the OS; uuid4() reads os.urandom for every request
# a forked child would otherwise draw its parent's ids (random's own module generator does the same)
os.register_at_fork(after_in_child=_ID_BITS.seed)


def _request_id(prefix: str) -> str:
    """``prefix-`` and 32 random hex digits, as ``uuid4().hex`` gives, without a system call per
    request (``os.urandom``: 0.36 ms per call in a profile of the event loop on a sandboxed machine
    whose system calls are slow, next to ~1 ms for the rest of a request). Opaque, not secret."""
    return f"{prefix}-{_ID_BITS.getrandbits(128):032x}"


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams; closing the merge cancels (aborts) all of them."""
    if len(streams) == 1:  # the common case: no queue, no pump task
        async with contextlib.aclosing(streams[0]) as stream:
            async for out in stream:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    await queue.put((i, out))
        except Exception as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_disconnect(receive) -> None:
    """Return when the client has gone (an ``http.disconnect`` message; the body was read)."""
    with contextlib.suppress(Exception):  # a receive that fails has no client behind it either
        while (await receive())["type"] != "http.disconnect":
            pass


async def _collect_final(engine: AsyncLLMEngine, submissions: list[tuple[str, list[int], SamplingParams]], n: int,
                         receive) -> tuple[dict[int, CompletedChoice], int, int] | None:
    """Run non-streaming requests (id, prompt, params) to completion: choices by global index
    (``prompt index * n + choice index``), prompt and completion token counts; None when the
    client disconnects first. Every request not finished on return (disconnect, error,
    cancellation) is aborted.

    The engine reports each choice once, on the event loop (:meth:`AsyncLLMEngine.submit`): one
    future for the whole call and a task watching ``receive`` for the disconnect, instead of a
    queue, a task per stream and a polling loop.

    Raises:
        APIError: 500 when the engine failed while running them.
        RequestError: a request was refused by the engine (the earlier ones are aborted).
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[bool] = loop.create_future()
    choices: dict[int, CompletedChoice] = {}
    counts = [0, 0]  # prompt tokens, completion tokens
    unfinished: set[str] = set()

    def on_output(p_idx: int, out: RequestOutput) -> None:
        if done.done():
            return
        if out.error:
            done.set_exception(APIError(500, str(EngineDeadError(out.error)), type="internal_error", code="engine_error"))
            return
        for c in out.choices:
            idx = p_idx * n + c.index
            choice = choices.get(idx)
            if choice is None:
                choice = choices[idx] = CompletedChoice(idx)
            choice.add(c)
        if out.finished:
            counts[0] += out.num_prompt_tokens
            counts[1] += out.num_output_tokens
            unfinished.discard(out.request_id)
            if not unfinished:
                done.set_result(True)

    watcher = None
    try:
        for p_idx, (request_id, prompt, params) in enumerate(submissions):
            engine.submit(request_id, prompt, params, functools.partial(on_output, p_idx), final_only=True)
            unfinished.add(request_id)
        watcher = loop.create_task(_wait_disconnect(receive))
        watcher.add_done_callback(lambda _: done.done() or done.set_result(False))
        if not await done:
            return None
    finally:
        if watcher is not None:
            watcher.cancel()
        for request_id in unfinished:
            engine.abort(request_id)
    return choices, counts[0], counts[1]


def _finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("stop" if reason == "abort" else reason)


# -- app ----------------------------------------------------------------------------------------
def build_app(engine: AsyncLLMEngine, model_name: str, *, metrics: EngineMetrics | None = None,
              readiness: Readiness | None = None) -> FastAPI:
    """The FastAPI application over a started (or to-be-started) :class:`AsyncLLMEngine`."""
    app = _ServerApp(title="graphserving worker", docs_url=None, redoc_url=None)
    state = ServerState(engine=engine, model_name=model_name, metrics=metrics, readiness=readiness or Readiness())
    app.state.server = state
    app.state.readiness = state.readiness

    app.add_middleware(BodyLimit)

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    def check_model(name: str) -> None:
        if name != state.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this worker serves `{state.model_name}`.",
                           param="model", code="model_not_found")

    def token_str(token_id: int) -> str:
        return state.tokenizer.token_to_str(token_id)

    # -- completions ------------------------------------------------------------------------
    async def completions(req: CompletionRequest, receive) -> Response:
        check_model(req.model)
        if req.echo:
            raise APIError(400, "echo: not supported by this server", param="echo", code="unsupported")
        if req.suffix:
            raise APIError(400, "suffix: not supported by this server", param="suffix", code="unsupported")
        tok = state.tokenizer
        if isinstance(req.prompt, str):
            prompts = [await asyncio.to_thread(tok.encode, req.prompt, add_special_tokens=True)]
        elif req.prompt and all(isinstance(p, int) for p in req.prompt):
            prompts = [list(req.prompt)]
        elif req.prompt and all(isinstance(p, str) for p in req.prompt):
            prompts = await asyncio.to_thread(lambda: [tok.encode(p, add_special_tokens=True) for p in req.prompt])
        elif req.prompt:
            prompts = [list(p) for p in req.prompt]
        else:
            raise APIError(400, "prompt: must not be empty", param="prompt", code="invalid_value")
        max_tokens = [_check_length(state, p, req.max_tokens or None, "prompt", "max_tokens") for p in prompts]
        if req.max_tokens is None:
            max_tokens = [min(16, m) for m in max_tokens]
        params = [_sampling_params(req, max_tokens=m, logprobs=req.logprobs) for m in max_tokens]
        rid = _request_id("cmpl")
        created = int(time.time())
        submissions = [(f"{rid}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        n = req.n

        def logprobs_obj(entries: list[TokenLogprob] | None, offset: int) -> dict | None:
            if req.logprobs is None or entries is None:
                return None
            tokens, token_lps, tops, offsets = [], [], [], []
            for e in entries:
                s = token_str(e.token_id)
                offsets.append(offset)
                offset += len(s)
                tokens.append(s)
                token_lps.append(e.logprob)
                tops.append({token_str(t): lp for t, lp in e.top} if req.logprobs else None)
            return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

        if req.stream:
            streams = [engine.generate(*sub, final_only=False) for sub in submissions]

            async def body() -> AsyncIterator[str]:
                prompt_tokens = completion_tokens = 0
                offsets: dict[int, int] = {}
                async with contextlib.aclosing(_merge(streams)) as merged:
                    try:
                        async for p_idx, out in merged:
                            for c in out.choices:
                                idx = p_idx * n + c.index
                                lp = logprobs_obj(c.logprobs, offsets.get(idx, 0))
                                offsets[idx] = offsets.get(idx, 0) + len(c.text)
                                if not c.text and not c.token_ids and c.finish_reason is None:
                                    continue
                                yield _sse({
                                    "id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                                    "choices": [{"index": idx, "text": c.text, "logprobs": lp,
                                                 "finish_reason": _finish_reason(c.finish_reason),
                                                 "stop_reason": c.stop_reason}],
                                })
                            if out.finished:
                                prompt_tokens += out.num_prompt_tokens
                                completion_tokens += out.num_output_tokens
                    except EngineDeadError as exc:
                        yield _sse(APIError(500, str(exc), type="internal_error").body())
                if req.stream_options and req.stream_options.include_usage:
                    yield _sse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                                "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
                yield _sse("[DONE]")

            return StreamingResponse(body(), media_type="text/event-stream")

        result = await _collect_final(engine, submissions, n, receive)
        if result is None:
            return Response(status_code=499)
        choices, prompt_tokens, completion_tokens = result
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": state.model_name,
            "choices": [
                {"index": idx, "text": c.text, "logprobs": logprobs_obj(c.logprobs, 0),
                 "finish_reason": _finish_reason(c.finish_reason), "stop_reason": c.stop_reason}
                for idx, c in sorted(choices.items())
            ],
            "usage": _usage(prompt_tokens, completion_tokens),
        })

    # -- chat -----------------------------------------------------------------------------------
    async def chat_completions(req: ChatCompletionRequest, receive) -> Response:
        from ..model.tokenizer import TokenizerError

        check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs", code="invalid_value")
        messages = []
        for i, m in enumerate(req.messages):
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
        try:
            prompt_text = state.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except TokenizerError as exc:
            raise APIError(400, f"messages: {exc}", param="messages", code="invalid_value") from exc
        prompt = await asyncio.to_thread(state.tokenizer.encode, prompt_text, add_special_tokens=False)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = _check_length(state, prompt, requested, "messages", max_param)
        params = _sampling_params(req, max_tokens=max_tokens,
                                  logprobs=(req.top_logprobs or 0) if req.logprobs else None)
        rid = _request_id("chatcmpl")
        created = int(time.time())

        def logprobs_obj(entries: list[TokenLogprob] | None) -> dict | None:
            if not req.logprobs or entries is None:
                return None

            def item(t: int, lp: float) -> dict:
                s = token_str(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

            return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                                for e in entries]}

        if req.stream:
            streams = [engine.generate(rid, prompt, params, final_only=False)]

            async def body() -> AsyncIterator[str]:
                usage = None
                started: set[int] = set()

                def chunk(choices: list[dict]) -> str:
                    return _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                 "model": state.model_name, "choices": choices})

                async with contextlib.aclosing(_merge(streams)) as merged:
                    try:
                        async for _, out in merged:
                            for c in out.choices:
                                if c.index not in started:
                                    started.add(c.index)
                                    yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}])
                                if not c.text and not c.token_ids and c.finish_reason is None:
                                    continue
                                yield chunk([{"index": c.index, "delta": {"content": c.text} if c.text else {},
                                              "logprobs": logprobs_obj(c.logprobs),
                                              "finish_reason": _finish_reason(c.finish_reason)}])
                            if out.finished:
                                usage = _usage(out.num_prompt_tokens, out.num_output_tokens)
                    except EngineDeadError as exc:
                        yield _sse(APIError(500, str(exc), type="internal_error").body())
                if req.stream_options and req.stream_options.include_usage and usage is not None:
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                "model": state.model_name, "choices": [], "usage": usage})
                yield _sse("[DONE]")

            return StreamingResponse(body(), media_type="text/event-stream")

        result = await _collect_final(engine, [(rid, prompt, params)], req.n, receive)
        if result is None:
            return Response(status_code=499)
        choices, prompt_tokens, completion_tokens = result
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
            "choices": [
                {"index": idx, "message": {"role": "assistant", "content": c.text},
                 "logprobs": logprobs_obj(c.logprobs), "finish_reason": _finish_reason(c.finish_reason),
                 "stop_reason": c.stop_reason}
                for idx, c in sorted(choices.items())
            ],
            "usage": _usage(prompt_tokens, completion_tokens),
        })

    @app.post("/v1/completions")
    async def completions_route(req: CompletionRequest, raw: Request):
        return await completions(req, raw.receive)

    @app.post("/v1/chat/completions")
    async def chat_completions_route(req: ChatCompletionRequest, raw: Request):
        return await chat_completions(req, raw.receive)

    app.fast_routes = {"/v1/completions": (CompletionRequest, completions),
                       "/v1/chat/completions": (ChatCompletionRequest, chat_completions)}

    # -- service routes -------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "graphserving",
            "max_model_len": state.max_model_len,
        }]}

    @app.get("/healthz")
    async def healthz():
        if not engine.is_running:
            return JSONResponse({"status": "dead", "reason": "engine loop is not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        if not engine.is_running:
            return JSONResponse({"ready": False, "reason": "engine loop is not running"}, status_code=503)
        if not state.readiness.ready:
            return JSONResponse({"ready": False, "reason": state.readiness.reason}, status_code=503)
        return {"ready": True, "reason": state.readiness.reason}

    @app.get("/metrics")
    async def metrics_route():
        body = state.metrics.render() if state.metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE)

    return app


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
