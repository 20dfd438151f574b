"""``POST /v1/completions``: request -> :class:`SamplingParams` -> engine -> response or stream.

Also the steps chat completions share (runtime/api/chat.py): the model check, the length check,
the sampling parameters, running non-streaming requests to completion
(:func:`collect_final`) and merging streams (:func:`merge_streams`).

A request that fails validation never reaches the engine, so other requests are unaffected.
Non-streaming requests are answered when every choice has finished (the engine reports each
choice once). A client that disconnects (streaming or not) cancels its request and frees its KV
blocks: a non-streaming one gets no answer (status 499 in the logs), a stream ends.

Amplification bounds (:func:`check_fan_out`, :func:`check_room`): a request creates prompts x ``n`` sequences, at
most :attr:`AsyncLLMEngine.max_seqs_per_request` (a 400 naming ``n`` or ``prompt``); when the
engine already holds :attr:`AsyncLLMEngine.max_queued_seqs` it gets a 503 with ``Retry-After``
(:func:`overloaded`), nothing queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloadedError
from ..engine.core import RequestError
from ..engine.output import CompletedChoice, RequestOutput
from ..engine.sequence import SamplingParams, SamplingParamsError, TokenLogprob
from .access import current_request_id
from .protocol import (
    APIError,
    CompletionRequest,
    SamplingRequest,
    new_request_id,
    openai_finish_reason,
    sse_event,
    token_usage,
)

if TYPE_CHECKING:
    from .app import ServerState

Submission = tuple[str, list[int], SamplingParams]
"""One engine request: (request id, prompt token ids, sampling parameters)."""


# -- shared steps -------------------------------------------------------------------------------
def check_model(state: ServerState, name: str) -> None:
    """Raises:
        APIError: 404 ``model_not_found`` when ``name`` is not the served model."""
    if name != state.model_name:
        raise APIError(404, f"The model `{name}` does not exist; this worker serves `{state.model_name}`.",
                       param="model", code="model_not_found")


def fan_out_error(num_prompts: int, n: int, bound: int, prompt_param: str) -> APIError | None:
    """The 400 of a request whose ``num_prompts`` prompts (field ``prompt_param``) x ``n`` choices
    create more than ``bound`` sequences, or None (pure). It names ``n`` when one prompt's choices
    alone pass the bound, else the prompt list."""
    total = num_prompts * n
    if total <= bound:
        return None
    if num_prompts == 1 or n > bound:
        return APIError(400, f"n: {n} choices are more than the {bound} sequences this server runs for one request",
                        param="n", code="invalid_value")
    return APIError(
        400, f"{prompt_param}: {num_prompts} prompts x n={n} would create {total} sequences; this server runs at most "
        f"{bound} for one request (send fewer prompts per request, or a smaller n)",
        param=prompt_param, code="invalid_value",
    )


def overloaded(exc: EngineOverloadedError) -> APIError:
    """The 503 (``code`` ``overloaded``, with ``Retry-After``) of a request the engine has no room for."""
    return APIError(503, str(exc), type="service_unavailable", code="overloaded",
                    headers={"Retry-After": str(exc.retry_after_s)})


def check_fan_out(state: ServerState, num_prompts: int, n: int, prompt_param: str) -> None:
    """Check a request's sequences (``num_prompts`` x ``n``) against the engine's per-request bound
    (before anything is tokenised; :func:`check_room` checks the queue once the request is built).

    Raises:
        APIError: 400 from :func:`fan_out_error`.
    """
    error = fan_out_error(num_prompts, n, state.engine.max_seqs_per_request, prompt_param)
    if error is not None:
        raise error


def check_room(state: ServerState, num_seqs: int) -> None:
    """Check that the engine's queue has room for ``num_seqs`` more sequences.

    Raises:
        APIError: 503 from :func:`overloaded`.
    """
    try:
        state.engine.check_capacity(num_seqs)
    except EngineOverloadedError as exc:
        raise overloaded(exc) from exc


def stream_error(exc: Exception) -> str:
    """The error event of a stream whose engine failed (500) or had no room left for a part of
    it (503, when requests raced for the last room after :func:`check_room`)."""
    if isinstance(exc, EngineOverloadedError):
        return sse_event(overloaded(exc).body())
    return sse_event(APIError(500, str(exc), type="internal_error").body())


def sampling_params(req: SamplingRequest, *, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The engine's sampling parameters of a request (OpenAI defaults where a field is absent).

    Raises:
        APIError: 400 for an unsupported field (``best_of`` other than ``n``), a ``logit_bias``
            key that is not a token id, or a value :class:`SamplingParams` refuses (``param``
            names it).
    """
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
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            min_tokens=req.min_tokens,
            logit_bias=logit_bias_pairs(req.logit_bias),
        )
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from exc


def engine_params(state: ServerState, req: SamplingRequest, *, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """:func:`sampling_params`, then checked by the engine (``logit_bias`` ids against the
    vocabulary; a structured-output spec compiled): a bad request is a 400 before anything is
    queued or streamed.

    Raises:
        APIError: 400 naming the field.
    """
    params = sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)
    try:
        state.engine.engine.check_params(params)
    except RequestError as exc:
        raise APIError(400, str(exc), param=exc.param, code=exc.code) from exc
    return params


def logit_bias_pairs(logit_bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs: the OpenAI API's keys are token ids as JSON
    strings (``{"50256": -100}``).

    Raises:
        APIError: 400 naming ``logit_bias`` for a key that is not a decimal token id.
    """
    pairs = []
    for key, bias in (logit_bias or {}).items():
        if not key.isdigit():
            raise APIError(400, f"logit_bias: keys must be token ids (decimal integers as strings), got {key!r}",
                           param="logit_bias", code="invalid_value")
        pairs.append((int(key), bias))
    return tuple(pairs)


def check_length(state: ServerState, prompt: list[int], requested: int | None, param: str, max_param: str) -> int:
    """Validate the prompt (field ``param``) and the requested output length (field
    ``max_param``, None when not given); return the max_tokens to use (the room left in the
    context when not given).

    Raises:
        APIError: 400 for a prompt the engine refuses, or ``context_length_exceeded`` when prompt
            and output do not fit in ``max_model_len`` tokens.
    """
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


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output); closing the merge cancels
    (aborts) all of them. An exception of a stream is raised here."""
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


def disconnected() -> str:
    """The reason logged for a request aborted because its client went away (with its X-Request-Id)."""
    return f"the client disconnected; X-Request-Id {current_request_id()}"


async def wait_disconnect(receive) -> None:
    """Return when the client has gone (an ``http.disconnect`` message; the body was read)."""
    with contextlib.suppress(Exception):  # a receive that fails has no client behind it either
        while (await receive())["type"] != "http.disconnect":
            pass


async def collect_final(engine: AsyncLLMEngine, submissions: list[Submission], n: int,
                        receive) -> tuple[dict[int, CompletedChoice], int, int] | None:
    """Run non-streaming requests to completion: choices by global index
    (``prompt index * n + choice index``), prompt and completion token counts; None when the
    client disconnects first. Every request not finished on return (disconnect, error,
    cancellation) is aborted.

    The engine reports each choice once, on the event loop (:meth:`AsyncLLMEngine.submit`): one
    future for the whole call and a task watching ``receive`` for the disconnect, instead of a
    queue, a task per stream and a polling loop.

    Raises:
        APIError: 500 when the engine failed while running them; 503 when it had no room left
            (:func:`overloaded`; the earlier ones are aborted).
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
    reason = "the request was cancelled"  # by an error, or by the server's shutdown
    try:
        for p_idx, (request_id, prompt, params) in enumerate(submissions):
            try:
                engine.submit(request_id, prompt, params, functools.partial(on_output, p_idx), final_only=True)
            except EngineOverloadedError as exc:
                raise overloaded(exc) from exc
            unfinished.add(request_id)
        watcher = loop.create_task(wait_disconnect(receive))
        watcher.add_done_callback(lambda _: done.done() or done.set_result(False))
        if not await done:
            reason = disconnected()
            return None
    finally:
        if watcher is not None:
            watcher.cancel()
        for request_id in unfinished:
            engine.abort(request_id, reason)
    return choices, counts[0], counts[1]


# -- /v1/completions ----------------------------------------------------------------------------
async def create_completion(state: ServerState, req: CompletionRequest, receive) -> Response:
    """Answer a completion request: a JSON ``text_completion``, a stream of them (``req.stream``),
    or status 499 when a non-streaming client disconnected first.

    Raises:
        APIError: 404 for another model; 400 for an unsupported field (``echo``, ``suffix``), an
            empty or too long prompt, an invalid sampling value, or more prompts x ``n`` than one
            request may create; 503 when the engine has no room (:func:`check_room`).
    """
    check_model(state, req.model)
    if req.echo:
        raise APIError(400, "echo: not supported by this server", param="echo", code="unsupported")
    if req.suffix:
        raise APIError(400, "suffix: not supported by this server", param="suffix", code="unsupported")
    check_fan_out(state, _num_prompts(req.prompt), req.n, "prompt")  # before any prompt is tokenised
    prompts = await _prompt_token_ids(state, req)
    max_tokens = [check_length(state, p, req.max_tokens or None, "prompt", "max_tokens") for p in prompts]
    if req.max_tokens is None:
        max_tokens = [min(16, m) for m in max_tokens]
    params = [engine_params(state, req, max_tokens=m, logprobs=req.logprobs) for m in max_tokens]
    check_room(state, len(prompts) * req.n)
    rid = new_request_id("cmpl")
    created = int(time.time())
    submissions = [(f"{rid}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    if req.stream:
        streams = [state.engine.generate(*sub, abort_reason=disconnected()) for sub in submissions]
        return StreamingResponse(_completion_events(state, req, rid, created, streams), media_type="text/event-stream")
    result = await collect_final(state.engine, submissions, req.n, receive)
    if result is None:
        return Response(status_code=499)
    choices, prompt_tokens, completion_tokens = result
    return JSONResponse({
        "id": rid, "object": "text_completion", "created": created, "model": state.model_name,
        "choices": [
            {"index": idx, "text": c.text, "logprobs": _completion_logprobs(state, req, c.logprobs, 0),
             "finish_reason": openai_finish_reason(c.finish_reason), "stop_reason": c.stop_reason}
            for idx, c in sorted(choices.items())
        ],
        "usage": token_usage(prompt_tokens, completion_tokens),
    })


def _num_prompts(prompt: str | list) -> int:
    """How many prompts a ``prompt`` field holds: one text or token list, or a list of them."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


async def _prompt_token_ids(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    """The prompts of a request as token ids (text is encoded off the event loop).

    Raises:
        APIError: 400 for an empty prompt.
    """
    tok = state.tokenizer
    if isinstance(req.prompt, str):
        return [await asyncio.to_thread(tok.encode, req.prompt, add_special_tokens=True)]
    if req.prompt and all(isinstance(p, int) for p in req.prompt):
        return [list(req.prompt)]
    if req.prompt and all(isinstance(p, str) for p in req.prompt):
        return await asyncio.to_thread(lambda: [tok.encode(p, add_special_tokens=True) for p in req.prompt])
    if req.prompt:
        return [list(p) for p in req.prompt]
    raise APIError(400, "prompt: must not be empty", param="prompt", code="invalid_value")


def _completion_logprobs(state: ServerState, req: CompletionRequest, entries: list[TokenLogprob] | None,
                         offset: int) -> dict | None:
    """The legacy ``logprobs`` object (tokens, token_logprobs, top_logprobs, text_offset) of the
    tokens ``entries``, whose text starts at character ``offset`` of the choice; None when not
    asked for."""
    if req.logprobs is None or entries is None:
        return None
    token_str = state.tokenizer.token_to_str
    tokens, token_lps, tops, offsets = [], [], [], []
    for e in entries:
        s = token_str(e.token_id)
        offsets.append(offset)
        offset += len(s)
        tokens.append(s)
        token_lps.append(e.logprob)
        tops.append({token_str(t): lp for t, lp in e.top} if req.logprobs else None)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def _completion_events(state: ServerState, req: CompletionRequest, rid: str, created: int,
                             streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
    """The server-sent events of a streamed completion: a chunk per choice delta (choice index
    ``prompt index * n + choice index``), the usage chunk when asked for, then ``[DONE]``. An
    engine failure is sent as an error event before ``[DONE]``."""
    prompt_tokens = completion_tokens = 0
    offsets: dict[int, int] = {}
    async with contextlib.aclosing(merge_streams(streams)) as merged:
        try:
            async for p_idx, out in merged:
                events = []  # one write per engine update: a run's chunks (stream interval) leave together
                for c in out.choices:
                    idx = p_idx * req.n + c.index
                    lp = _completion_logprobs(state, req, c.logprobs, offsets.get(idx, 0))
                    offsets[idx] = offsets.get(idx, 0) + len(c.text)
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    events.append(sse_event({
                        "id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                        "choices": [{"index": idx, "text": c.text, "logprobs": lp,
                                     "finish_reason": openai_finish_reason(c.finish_reason),
                                     "stop_reason": c.stop_reason}],
                    }))
                if events:
                    yield "".join(events)
                if out.finished:
                    prompt_tokens += out.num_prompt_tokens
                    completion_tokens += out.num_output_tokens
        except (EngineDeadError, EngineOverloadedError) as exc:
            yield stream_error(exc)
    if req.stream_options and req.stream_options.include_usage:
        yield sse_event({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                         "choices": [], "usage": token_usage(prompt_tokens, completion_tokens)})
    yield sse_event("[DONE]")
