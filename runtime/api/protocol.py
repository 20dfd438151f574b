"""The OpenAI wire protocol of the worker: request models, error bodies, response pieces.

Requests (:class:`CompletionRequest`, :class:`ChatCompletionRequest`) follow the OpenAI shapes,
with the extensions vLLM accepts: ``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``, ``skip_special_tokens``,
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (beside OpenAI's
``response_format``: :func:`structured_output`) and (chat) ``add_generation_prompt``,
``documents`` and ``chat_template_kwargs``. Field types are strict (``"max_tokens": "5"`` is a
400, not coerced).

Unknown fields: a parameter this server does not support is never silently ignored. Every field
of a request body is declared; any other is a 400 naming it (``code`` ``unsupported_parameter``).
The only fields accepted without an effect are :data:`NO_EFFECT_FIELDS` (identifiers and
bookkeeping that OpenAI clients send and that change no output); docs/worker.md, "OpenAI-compatible
API", has the table.

Errors use the OpenAI body ``{"error": {"message", "type", "param", "code"}}``
(:class:`APIError`); :func:`validation_error` turns a pydantic validation failure into one
naming the field (``param``), and a malformed JSON body into ``param="body"``,
``code="invalid_json"``.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from ..engine.structured import StructuredOutput


# -- errors -------------------------------------------------------------------------------------
class APIError(Exception):
    """An error returned to the client in the OpenAI shape.

    Args:
        status: the HTTP status code.
        message: a sentence for the client (names the field when one is at fault).
        param: the field at fault (``"messages[0].content"``), or None.
        code: a machine-readable reason (``"invalid_value"``, ``"model_not_found"``, ...).
        type: the OpenAI error type (``"invalid_request_error"``, ``"internal_error"``, ...).
        headers: HTTP headers of the response (``Retry-After`` of a 503), or None.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The error as a JSON response with its status code."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ErrorDetail(BaseModel):
    """The ``error`` object of an OpenAI error body (:meth:`APIError.body`)."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """``{"error": {...}}``: every 4xx and 5xx answer of the worker (the OpenAPI schema names it)."""

    error: ErrorDetail


def _loc_to_param(loc: tuple) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"``."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif "[" in p or p in ("str", "int", "float", "bool"):
            continue  # union-member tags pydantic adds to the location ("list[int]", "function-after[...]")
        else:
            out += f".{p}" if out else str(p)
    return out or None


def validation_error(exc: RequestValidationError) -> APIError:
    """The 400 :class:`APIError` for the first error of a request that failed validation: the
    field as ``param`` (``code`` ``invalid_value`` or ``missing_field``), or ``param="body"`` for
    a malformed JSON body (``code`` ``invalid_json``)."""
    errors = exc.errors()
    # A value that fails a validator of its own (invalid Unicode, say) explains itself better than
    # the type errors of the other members of a union it was tried against.
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0] if errors else
                 {"loc": ("body",), "msg": "invalid request", "type": "value_error"})
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx", {}).get("error", "")
        return APIError(400, f"Malformed JSON body: {ctx}".rstrip(": "), param="body", code="invalid_json")
    param = _loc_to_param(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden" and param is not None:
        return APIError(400, f"{param}: this server does not support the parameter `{param}` (docs/worker.md, "
                        "'OpenAI-compatible API', lists the supported ones)", param=param, code="unsupported_parameter")
    if param is None:
        return APIError(400, f"body: {first.get('msg')}", param="body", code="invalid_request")
    msg = first.get("msg", "invalid value")
    if "input" in first and first.get("type") != "missing":
        msg += f" (got {json.dumps(first['input'], default=str)[:200]})"
    return APIError(400, f"{param}: {msg}", param=param, code="invalid_value" if first.get("type") != "missing" else "missing_field")


# -- request models -------------------------------------------------------------------------------
def _unicode_problem(text: str) -> str | None:
    """Why ``text`` is not valid Unicode, or None. JSON's ``"\\ud800"`` escape decodes to a lone
    UTF-16 surrogate, which is no Unicode scalar value: it cannot be encoded as UTF-8, so neither
    the tokenizer nor the chat template can take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"contains a lone UTF-16 surrogate (U+{ord(text[exc.start]):04X} at character {exc.start}); "
                "text must be valid Unicode")
    return None


def _valid_text(text: str) -> str:
    problem = _unicode_problem(text)
    if problem:
        raise ValueError(problem)
    return text


def _first_invalid_text(value: Any, path: str) -> str | None:
    """The first string inside ``value`` (nested lists and dicts, keys included) that is not valid
    Unicode, as ``path: problem``; None when there is none."""
    if isinstance(value, str):
        problem = _unicode_problem(value)
        return f"{path} {problem}" if problem else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        found = _first_invalid_text(key, f"{where} (key)") if isinstance(key, str) else None
        found = found or _first_invalid_text(item, where)
        if found:
            return found
    return None


def _valid_parts(parts: Any) -> Any:
    found = _first_invalid_text(parts, "")
    if found:
        raise ValueError(found.lstrip())
    return parts


Text = Annotated[str, AfterValidator(_valid_text)]
"""Request text that reaches the tokenizer, the chat template or the stop-string matcher: a
400 naming the field when it is not valid Unicode."""

JsonObject = Annotated[dict[str, Any], AfterValidator(_valid_parts)]
"""A JSON object of the request (a schema, template variables, a document) whose strings, keys
included, reach the chat template or the grammar compiler: a 400 naming the field when one is not
valid Unicode."""

NO_EFFECT_FIELDS = ("user", "safety_identifier", "prompt_cache_key", "metadata", "store")
"""Request fields accepted and without effect on the output: end-user identifiers (``user``,
``safety_identifier``), a routing hint for OpenAI's prompt cache (``prompt_cache_key``), and the
stored-completions bookkeeping (``metadata``; ``store`` only ``false``: nothing is stored here)."""


class SamplingRequest(BaseModel):
    """The fields completions and chat requests share (model, length, sampling, stop, stream).

    A field not declared here (or in a subclass) is a 400 naming it (module docstring).
    """

    # Types are strict, as in the OpenAI API: "max_tokens": "5" or "stream": 1 is a 400 naming the
    # field, not silently coerced (an integer is still accepted where a number is expected).
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=2**31)
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    best_of: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # structured output (structured_output): at most one of these per request
    response_format: ResponseFormat | None = None
    guided_json: JsonObject | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = Field(None, min_length=1)
    guided_grammar: Text | None = None
    # accepted, no effect (NO_EFFECT_FIELDS)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    store: Literal[False] | None = None


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema the output must match (``name`` is required
    by the OpenAI API and has no effect; ``strict`` changes nothing: the schema is always enforced)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: Text = Field(..., min_length=1)
    description: Text | None = None
    schema_: JsonObject | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` (the object ``json_schema.schema`` describes)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the token counts."""

    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: a prompt as text, token ids, or a list of either.

    ``max_tokens`` may be 0 here (OpenAI: with ``echo``, the prompt is scored, nothing generated);
    ``echo`` returns the prompt before the completion, and with ``logprobs`` the prompt tokens'
    log-probabilities first (the first one null); ``prompt_logprobs`` (vLLM's extension) adds each
    choice's ``prompt_logprobs`` with that many top tokens per prompt position.
    """

    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    suffix: Text | None = None


class FunctionDefinition(BaseModel):
    """``tools[i].function``: a function the model may call; ``parameters`` is the JSON schema of
    its arguments (an object schema; none: any object)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    name: Text = Field(..., min_length=1)
    description: Text | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    """``tools[i]``: an OpenAI function tool."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: Text = Field(..., min_length=1)


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call exactly this tool."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    """``tool_calls[j].function`` of an assistant message: ``arguments`` is JSON text (an object)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    name: Text = Field(..., min_length=1)
    arguments: Text


class MessageToolCall(BaseModel):
    """``messages[i].tool_calls[j]``: a call the assistant made earlier in the conversation."""

    model_config = ConfigDict(strict=True, extra="forbid")

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One chat message; content is text or a list of ``{"type": "text", "text": ...}`` parts.
    An assistant message may carry ``tool_calls`` (content null), a ``tool`` message the
    ``tool_call_id`` it answers."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | Annotated[list[dict[str, Any]], AfterValidator(_valid_parts)] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: Text | None = None

    @model_validator(mode="after")
    def _extra_fields_are_valid_text(self) -> ChatMessage:
        """Extra fields (``name``, ``tool_calls``, ...) reach the chat template too."""
        found = _first_invalid_text(self.model_extra or {}, "")
        if found:
            raise ValueError(found)
        return self


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    # the chat template's inputs beyond the messages (runtime/api/chat.py, render_messages)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    documents: list[JsonObject] | None = None
    chat_template_kwargs: JsonObject | None = None


SamplingRequest.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()


# -- structured output ----------------------------------------------------------------------------
def structured_output(req: SamplingRequest, tool_constraint: StructuredOutput | None = None) -> StructuredOutput | None:
    """The constraint on a request's output, from ``response_format`` (``json_object``,
    ``json_schema``; ``text`` is none), vLLM's ``guided_json`` / ``guided_regex`` /
    ``guided_choice`` / ``guided_grammar``, or ``tool_constraint`` (a chat request's
    ``tool_choice``, runtime/api/tools.py); None without one. A ``json_schema`` without ``schema``
    is any JSON object. Pure: the engine compiles the result (an invalid schema or grammar is its
    400, naming the spec's ``param``).

    Raises:
        APIError: 400 for two constraints in one request (naming the second), or a
            ``response_format`` whose ``json_schema`` does not go with its ``type``.
    """
    specs: list[StructuredOutput] = []
    fmt = req.response_format
    if fmt is not None and (fmt.json_schema is None) == (fmt.type == "json_schema"):
        message = ("required when type is json_schema" if fmt.type == "json_schema"
                   else f"only goes with type json_schema, got type {fmt.type}")
        raise APIError(400, f"response_format.json_schema: {message}", param="response_format.json_schema",
                       code="invalid_value")
    if fmt is not None and fmt.type == "json_object":
        specs.append(StructuredOutput("json_object", "", "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_
        specs.append(StructuredOutput("json_object", "", "response_format") if schema is None else
                     StructuredOutput("json_schema", json.dumps(schema, ensure_ascii=False),
                                      "response_format.json_schema.schema"))
    if req.guided_json is not None:
        value = req.guided_json if isinstance(req.guided_json, str) else json.dumps(req.guided_json, ensure_ascii=False)
        specs.append(StructuredOutput("json_schema", value, "guided_json"))
    if req.guided_regex is not None:
        specs.append(StructuredOutput("regex", req.guided_regex, "guided_regex"))
    if req.guided_choice is not None:
        specs.append(StructuredOutput("choice", json.dumps(req.guided_choice, ensure_ascii=False), "guided_choice"))
    if req.guided_grammar is not None:
        specs.append(StructuredOutput("grammar", req.guided_grammar, "guided_grammar"))
    if tool_constraint is not None:
        specs.append(tool_constraint)
    if len(specs) > 1:
        first, second = (spec.param.split(".")[0] for spec in specs[:2])
        raise APIError(400, f"{second}: a request takes one output constraint, and {first} is one already "
                       f"(send either {first} or {second})", param=second, code="invalid_value")
    return specs[0] if specs else None


# -- response pieces ------------------------------------------------------------------------------
_ID_BITS = random.Random()  # seeded once from the OS; uuid4() reads os.urandom for every request
# a forked child would otherwise draw its parent's ids (random's own module generator does the same)
os.register_at_fork(after_in_child=_ID_BITS.seed)


def random_hex() -> str:
    """32 random hex digits, as ``uuid4().hex`` gives, without a system call per request
    (``os.urandom``: 0.36 ms per call in a profile of the event loop on a sandboxed machine whose
    system calls are slow, next to ~1 ms for the rest of a request). Opaque, not secret."""
    return f"{_ID_BITS.getrandbits(128):032x}"


def new_request_id(prefix: str) -> str:
    """``prefix-`` and :func:`random_hex`: the id of a completion (``id`` in its responses)."""
    return f"{prefix}-{random_hex()}"


def sse_event(payload: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: {json}`` (or ``data: [DONE]`` for the string) and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


TEXT_SLOT = "\u0000graphserving-text-slot\u0000"
"""The placeholder of :func:`sse_text_template`: a string no JSON value of a response holds."""


def sse_text_template(payload: dict[str, Any]) -> Callable[[str], str]:
    """A function that gives :func:`sse_event` of ``payload`` with one text put in, serialising
    only that text: ``payload`` is built once per stream with :data:`TEXT_SLOT` where the text goes
    (e.g. a chunk's ``delta.content``), and each chunk then costs one ``json.dumps`` of a string
    instead of the whole chunk's (about 1.2 µs against 7.6 µs on one core; the worker's event loop
    serialises one chunk per token: docs/worker.md, "Streaming").

    Raises:
        ValueError: ``payload`` holds :data:`TEXT_SLOT` other than exactly once.
    """
    data = json.dumps(payload, ensure_ascii=False)
    parts = data.split(json.dumps(TEXT_SLOT, ensure_ascii=False))
    if len(parts) != 2:
        raise ValueError(f"the payload holds the text slot {len(parts) - 1} times, not once")
    prefix, suffix = f"data: {parts[0]}", f"{parts[1]}\n\n"
    dumps = json.dumps
    return lambda text: prefix + dumps(text, ensure_ascii=False) + suffix


def openai_finish_reason(reason: str | None) -> str | None:
    """The ``finish_reason`` a response reports for an engine finish reason: ``"stop"``,
    ``"length"``, or ``"abort"`` for a request the server cancelled (client disconnect, drain
    deadline, engine failure). ``"abort"`` is outside OpenAI's enum (stop, length, content_filter,
    tool_calls) and is what vLLM reports; the ``openai`` SDK parses responses without validating
    the enum, so it hands ``"abort"`` to the caller (tests/runtime/api/test_openai_surface.py)."""
    return reason


def token_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The ``usage`` object: prompt, completion and total token counts."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
