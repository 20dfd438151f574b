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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloadedError
from ..engine.output import ChoiceDelta, CompletedChoice, RequestOutput
from ..engine.sequence import RequestError, SamplingParams, SamplingParamsError, TokenLogprob
from ..engine.structured import StructuredOutput
from .access import current_request_id
from .logprobs import TokenStr, join_legacy, legacy_logprobs, memoised, prompt_logprobs_json
from .protocol import (
    TEXT_SLOT,
    APIError,
    CompletionRequest,
    SamplingRequest,
    new_request_id,
    openai_finish_reason,
    sse_event,
    sse_text_template,
    structured_output,
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


def sampling_params(req: SamplingRequest, *, max_tokens: int, logprobs: int | None,
                    structured: StructuredOutput | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    """The engine's sampling parameters of a request (OpenAI defaults where a field is absent;
    ``prompt_logprobs``: top tokens per prompt position, None for no prompt log-probabilities).
    ``structured`` is the output constraint; None: :func:`protocol.structured_output` of the
    request (chat passes the one that merges its ``tool_choice``).

    Raises:
        APIError: 400 for an unsupported field (``best_of`` other than ``n``), a ``logit_bias``
            key that is not a token id, two output constraints, or a value
            :class:`SamplingParams` refuses (``param`` names it).
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
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            min_tokens=req.min_tokens,
            logit_bias=logit_bias_pairs(req.logit_bias),
            structured=structured or structured_output(req),
        )
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from exc


def engine_params(state: ServerState, req: SamplingRequest, *, max_tokens: int, logprobs: int | None,
                  structured: StructuredOutput | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    """:func:`sampling_params`, then checked by the engine (``logit_bias`` ids against the
    vocabulary; a structured-output spec compiled): a bad request is a 400 before anything is
    queued or streamed.

    Raises:
        APIError: 400 naming the field.
    """
    params = sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, structured=structured,
                             prompt_logprobs=prompt_logprobs)
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


async def event_stream(events: AsyncIterator[str], receive) -> Response:
    """The ``text/event-stream`` response of ``events`` (server-sent events, as text), sent once
    the first event is ready: its status line and headers leave together with the first chunk.

    Why not at once: a proxy in front (Traefik, any Go ``httputil.ReverseProxy``) may still be
    checking the end of the request body it forwarded when the response headers come back; Go's
    HTTP/1 server closes the inbound body as the headers go out, and the proxy then tears down its
    connection to this worker, cutting the stream after the headers (measured on the dev gateway:
    a few in a few hundred streams, docs/rollout-traffic.md). A first token takes at least one
    forward pass, so the headers no longer race the request. A client that disconnects before the
    first event gets status 499 and its requests are aborted (closing ``events``).
    """
    loop = asyncio.get_running_loop()
    first = loop.create_task(anext(events, None))
    gone = loop.create_task(wait_disconnect(receive))
    try:
        await asyncio.wait((first, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not first.done():
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await events.aclose()  # the requests are aborted as disconnected (the generator's cleanup)
        return Response(status_code=499)
    head = first.result()  # an exception in the generator before any event is the route's error

    async def chained() -> AsyncIterator[str]:
        async with contextlib.aclosing(events):
            if head is not None:
                yield head
            async for event in events:
                yield event

    return StreamingResponse(chained(), media_type="text/event-stream")


async def collect_final(engine: AsyncLLMEngine, submissions: list[Submission], n: int,
                        receive) -> tuple[dict[int, CompletedChoice], int, int] | None:
    """Run non-streaming requests to completion: choices by global index
    (``prompt index * n + choice index``, each with its request's ``prompt_logprobs`` when asked
    for), prompt and completion token counts; None when the client disconnects first. Every
    request not finished on return (disconnect, error, cancellation) is aborted.

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
    prompt_logprobs: dict[int, list] = {}  # by prompt index: they come in one output of the request

    def on_output(p_idx: int, out: RequestOutput) -> None:
        if done.done():
            return
        if out.error:
            done.set_exception(APIError(500, str(EngineDeadError(out.error)), type="internal_error", code="engine_error"))
            return
        if out.prompt_logprobs is not None:
            prompt_logprobs[p_idx] = out.prompt_logprobs
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
    for idx, choice in choices.items():
        choice.prompt_logprobs = prompt_logprobs.get(idx // n)
    return choices, counts[0], counts[1]


# -- /v1/completions ----------------------------------------------------------------------------
async def create_completion(state: ServerState, req: CompletionRequest, receive) -> Response:
    """Answer a completion request: a JSON ``text_completion``, a stream of them (``req.stream``),
    or status 499 when a non-streaming client disconnected first.

    ``echo`` puts each prompt (as text, and with ``logprobs`` as log-probabilities: the engine's
    prompt log-probabilities, :class:`SamplingParams` ``prompt_logprobs``) before its choices'
    completions, in the first chunk of each choice when streamed; ``max_tokens`` 0 then generates
    nothing (finish reason ``"length"``). ``prompt_logprobs`` adds vLLM's ``prompt_logprobs`` to
    each choice (to its first chunk when streamed).

    Raises:
        APIError: 404 for another model; 400 for an unsupported field (``suffix``), ``max_tokens``
            0 without ``echo`` or ``prompt_logprobs``, an empty or too long prompt, an invalid
            sampling value, or more prompts x ``n`` than one request may create; 503 when the
            engine has no room (:func:`check_room`).
    """
    check_model(state, req.model)
    if req.suffix:
        raise APIError(400, "suffix: not supported by this server", param="suffix", code="unsupported")
    if req.max_tokens == 0 and not req.echo and req.prompt_logprobs is None:
        raise APIError(400, "max_tokens: 0 generates nothing; it is accepted with echo or prompt_logprobs, which "
                       "return the prompt (and its log-probabilities)", param="max_tokens", code="invalid_value")
    check_fan_out(state, _num_prompts(req.prompt), req.n, "prompt")  # before any prompt is tokenised
    prompts = await _prompt_token_ids(state, req)
    max_tokens = [check_length(state, p, req.max_tokens, "prompt", "max_tokens") for p in prompts]
    if req.max_tokens is None:
        max_tokens = [min(16, m) for m in max_tokens]
    params = [engine_params(state, req, max_tokens=m, logprobs=req.logprobs, prompt_logprobs=_num_prompt_logprobs(req))
              for m in max_tokens]
    check_room(state, len(prompts) * req.n)
    texts = await _prompt_texts(state, req, prompts)
    rid = new_request_id("cmpl")
    created = int(time.time())
    submissions = [(f"{rid}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    if req.stream:
        streams = [state.engine.generate(*sub, abort_reason=disconnected()) for sub in submissions]
        return await event_stream(_completion_events(state, req, rid, created, streams, prompts, texts), receive)
    result = await collect_final(state.engine, submissions, req.n, receive)
    if result is None:
        return Response(status_code=499)
    choices, prompt_tokens, completion_tokens = result

    def body() -> dict:
        token_str = memoised(state.tokenizer.token_to_str)
        return {
            "id": rid, "object": "text_completion", "created": created, "model": state.model_name,
            "choices": [_choice_json(token_str, req, idx, c, 0, _Opening(prompts[idx // req.n], texts[idx // req.n],
                                                                        c.prompt_logprobs))
                        for idx, c in sorted(choices.items())],
            "usage": token_usage(prompt_tokens, completion_tokens),
        }

    # a prompt's log-probabilities are a tokenizer call per token: long prompts leave the event loop
    return JSONResponse(await asyncio.to_thread(body) if req.echo or req.prompt_logprobs is not None else body())


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


def _num_prompt_logprobs(req: CompletionRequest) -> int | None:
    """Top tokens per prompt position the engine computes: for ``prompt_logprobs``, and for
    ``logprobs`` under ``echo`` (the larger); None when neither asks for prompt log-probabilities."""
    wanted = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    return max(wanted) if wanted else None


async def _prompt_texts(state: ServerState, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """Each prompt's text under ``echo`` (as given; token ids decoded, special tokens kept, off
    the event loop); empty strings without ``echo``."""
    if not req.echo:
        return [""] * len(prompts)
    if isinstance(req.prompt, str):
        return [req.prompt]
    if isinstance(req.prompt[0], str):
        return list(req.prompt)
    decode = state.tokenizer.decode
    return await asyncio.to_thread(lambda: [decode(p, skip_special_tokens=False) for p in prompts])


@dataclass
class _Opening:
    """What a choice's first chunk (or whole answer) starts with: its prompt's token ids, text
    (``echo``; else empty) and log-probabilities (the first entry None; None when not computed)."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob | None] | None


def _choice_json(token_str: TokenStr, req: CompletionRequest, idx: int, c: ChoiceDelta | CompletedChoice,
                 offset: int, opening: _Opening | None) -> dict:
    """One choice of a completion (or of a chunk): ``c``'s text, its legacy ``logprobs`` (from
    character ``offset`` of the choice's text), after the prompt's (``echo``) and with vLLM's
    ``prompt_logprobs`` (when asked for) when ``opening`` is given: the answer, or a first chunk."""
    echo = opening is not None and req.echo
    text = opening.text + c.text if echo else c.text
    lp = None
    if req.logprobs is not None and c.logprobs is not None:
        lp = legacy_logprobs(token_str, [(e.token_id, e) for e in c.logprobs], req.logprobs,
                             offset + (len(opening.text) if echo else 0))
        if echo:
            prompt_lps = opening.logprobs or [None] * len(opening.token_ids)
            lp = join_legacy(legacy_logprobs(token_str, list(zip(opening.token_ids, prompt_lps)), req.logprobs, 0), lp)
    choice = {"index": idx, "text": text, "logprobs": lp, "finish_reason": openai_finish_reason(c.finish_reason),
              "stop_reason": c.stop_reason}
    if opening is not None and req.prompt_logprobs is not None:
        choice["prompt_logprobs"] = (prompt_logprobs_json(token_str, opening.logprobs, req.prompt_logprobs)
                                     if opening.logprobs is not None else None)
    return choice


async def _completion_events(state: ServerState, req: CompletionRequest, rid: str, created: int,
                             streams: list[AsyncIterator[RequestOutput]], prompts: list[list[int]],
                             texts: list[str]) -> AsyncIterator[str]:
    """The server-sent events of a streamed completion: a chunk per choice delta (choice index
    ``prompt index * n + choice index``; a choice's first chunk opens with its prompt under
    ``echo``, :func:`_choice_json`), the usage chunk when asked for, then ``[DONE]``. An engine
    failure is sent as an error event before ``[DONE]``."""
    prompt_tokens = completion_tokens = 0
    offsets: dict[int, int] = {}
    prompt_logprobs: dict[int, list] = {}  # by prompt index, from the request's first output
    token_str = memoised(state.tokenizer.token_to_str)
    text_chunks: dict[int, Callable[[str], str]] = {}  # per choice: its text-only chunk, pre-serialised
    async with contextlib.aclosing(merge_streams(streams)) as merged:
        try:
            async for p_idx, out in merged:
                events = []  # one write per engine update: a run's chunks (stream interval) leave together
                if out.prompt_logprobs is not None:
                    prompt_logprobs[p_idx] = out.prompt_logprobs
                for c in out.choices:
                    idx = p_idx * req.n + c.index
                    if idx in offsets and req.logprobs is None and c.finish_reason is None and c.text:
                        template = text_chunks.get(idx)  # the common chunk: text only, mid-stream
                        if template is None:
                            template = text_chunks[idx] = sse_text_template({
                                "id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                                "choices": [_choice_json(token_str, req, idx, ChoiceDelta(c.index, TEXT_SLOT, [], None), 0, None)],
                            })
                        events.append(template(c.text))
                        offsets[idx] += len(c.text)
                        continue
                    opening = None if idx in offsets else _Opening(prompts[p_idx], texts[p_idx],
                                                                   prompt_logprobs.get(p_idx))
                    choice = _choice_json(token_str, req, idx, c, offsets.get(idx, 0), opening)
                    offsets[idx] = offsets.get(idx, 0) + len(choice["text"])
                    nothing = not choice["text"] and not c.token_ids and c.finish_reason is None
                    if nothing and "prompt_logprobs" not in choice:
                        continue
                    events.append(sse_event({
                        "id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                        "choices": [choice],
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
