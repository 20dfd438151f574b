"""The worker's HTTP app: one FastAPI app for the OpenAI-compatible API and the lifecycle endpoints.

The worker builds it before warmup and capture (:func:`build_app`) and sets
:attr:`ServerState.engine` once the engine loop serves. Routes:

- lifecycle endpoints, answered from the start (runtime/api/front.py): ``GET /healthz`` (and
  ``GET /health``, the same), ``GET /readyz``, ``GET /metrics``, ``GET /version``,
  ``GET /v1/graphs``, ``POST /v1/graphs/recapture``;
- once the engine serves: ``POST /v1/completions`` (runtime/api/completions.py),
  ``POST /v1/chat/completions`` (runtime/api/chat.py), ``GET /v1/models``, ``POST /tokenize`` and
  ``POST /detokenize`` (runtime/api/tokenize.py); until then every path
  but the lifecycle endpoints gets a 503 OpenAI-style error (``code`` ``not_ready``).

Completions and chat are non-streaming or streamed as server-sent events (``data: {chunk}``
lines, then ``data: [DONE]``). Errors use the OpenAI body ``{"error": {"message", "type", "param",
"code"}}`` (runtime/api/protocol.py): invalid fields and malformed JSON are 400 with ``param``
naming the field, an unknown model or path is 404. Field types are strict (``"max_tokens": "5"``
is a 400, not coerced); at most 16 stop strings of up to 256 characters
(``sequence.MAX_STOP_STRINGS``). Request bodies above ``asgi.MAX_BODY_BYTES`` get a 413; a
well-formed JSON completion or chat request takes the direct path (runtime/api/asgi.py). One
request creates at most ``AsyncLLMEngine.max_seqs_per_request`` sequences (prompts x ``n``; a 400
naming ``n`` or ``prompt``), and an engine holding ``max_queued_seqs`` answers 503 (``code``
``overloaded``) with ``Retry-After`` (runtime/api/completions.py, ``check_fan_out`` and ``check_room``).

Every HTTP request first passes runtime/api/access.py: its ``X-Request-Id`` (accepted or
generated, echoed), the optional API key (``ServerState.api_key``; probes, metrics and the report
stay open) and one access-log line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.async_engine import AsyncLLMEngine
from ..engine.metrics import EngineMetrics
from . import access, front
from .asgi import BodyLimit, DirectRoute, answer_directly
from .chat import create_chat_completion
from .completions import create_completion
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, ErrorBody, validation_error
from .tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from .tool_parsers import PARSER_CHOICES


# -- state --------------------------------------------------------------------------------------
@dataclass
class ServerState:
    """What the routes read; kept on ``app.state.server``.

    Args:
        model_name: the served model's name (``model`` in requests, ``/v1/models``).
        lifecycle: the worker's lifecycle (phase, readiness, report, recapture).
        metrics: the registry ``/metrics`` renders (engine and graph metrics).
        engine: the running engine loop; None until the worker serves.
        api_key: the key requests must send (``Authorization: Bearer``), or None for none
            (runtime/api/access.py).
        tool_call_parser: the family whose tool-call format chat outputs are parsed in
            (``--tool-call-parser``: ``auto``, ``hermes``, ``llama3_json`` or ``none``;
            runtime/api/tool_parsers.py).
        served_by: the response headers naming this worker (``access.served_by_headers``).
    """

    model_name: str
    lifecycle: front.Lifecycle
    metrics: EngineMetrics
    engine: AsyncLLMEngine | None = None
    api_key: str | None = None
    tool_call_parser: str = "auto"
    served_by: tuple[tuple[bytes, bytes], ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if self.tool_call_parser not in PARSER_CHOICES:
            raise ValueError(f"tool_call_parser: expected one of {', '.join(PARSER_CHOICES)}, "
                             f"got {self.tool_call_parser!r}")

    @property
    def serving(self) -> bool:
        """True once the engine loop serves (the OpenAI routes answer)."""
        return self.engine is not None

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len


class ServerApp(FastAPI):
    """The FastAPI app with two paths in front of its middleware and router.

    - Every HTTP request passes :func:`access.serve` first (request id, API key, access log).
    - Until the engine serves, an HTTP request to a path that is not a lifecycle endpoint
      (``lifecycle_paths``) gets the 503 of :func:`front.not_serving`, unread.
    - A POST to a path in ``direct_routes`` takes the direct path
      (:func:`asgi.answer_directly`); the lifespan and every other request go through the full app.
    """

    lifecycle_paths: frozenset[str] = frozenset()
    direct_routes: dict[str, DirectRoute] = {}

    def openapi(self) -> dict:
        """FastAPI's schema, with the error answers the worker really gives: a 400 with the OpenAI
        error body (:class:`protocol.ErrorBody`) where FastAPI declares its 422, which this
        worker never sends (request validation errors are 400s, :func:`protocol.validation_error`)."""
        if self.openapi_schema is None:
            schema = super().openapi()
            error = {"description": "Invalid request: the OpenAI error body, with param naming the field",
                     "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}
            for operation in (op for ops in schema["paths"].values() for op in ops.values()):
                if operation.get("responses", {}).pop("422", None) is not None:
                    operation["responses"]["400"] = error
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            body = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(body.pop("$defs"))
            schemas["ErrorBody"] = body
            self.openapi_schema = schema
        return self.openapi_schema

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # the lifespan (no websocket route is served)
            await super().__call__(scope, receive, send)
            return
        server: ServerState = self.state.server
        await access.serve(self._route, server.api_key, scope, receive, send, server.served_by)

    async def _route(self, scope, receive, send) -> None:
        if scope["path"] in self.lifecycle_paths:
            await super().__call__(scope, receive, send)
            return
        state: ServerState = self.state.server
        if state.engine is None:
            await front.not_serving(state).response()(scope, receive, send)
            return
        route = self.direct_routes.get(scope["path"]) if scope["method"] == "POST" else None
        if route is None:
            await super().__call__(scope, receive, send)
        else:
            await answer_directly(route, state, scope, receive, send, super().__call__)


# -- routes -------------------------------------------------------------------------------------
async def completions_route(req: CompletionRequest, raw: Request):
    return await create_completion(raw.app.state.server, req, raw.receive)


async def chat_completions_route(req: ChatCompletionRequest, raw: Request):
    return await create_chat_completion(raw.app.state.server, req, raw.receive)


async def tokenize_route(req: TokenizeRequest, raw: Request):
    return await tokenize(raw.app.state.server, req)


async def detokenize_route(req: DetokenizeRequest, raw: Request):
    return await detokenize(raw.app.state.server, req)


async def models_route(raw: Request):
    state: ServerState = raw.app.state.server
    return {"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.created, "owned_by": "graphserving",
        "max_model_len": state.max_model_len,
    }]}


async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error(exc).response()


async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    response = APIError(exc.status_code, str(exc.detail), type=kind).response()
    response.headers.update(exc.headers or {})  # a 405 says which methods the path allows (Allow)
    return response


def build_app(state: ServerState) -> ServerApp:
    """The worker's ASGI app over ``state`` (the module docstring lists the routes)."""
    app = ServerApp(title="graphserving worker", docs_url=None, redoc_url=None)
    app.state.server = state
    app.add_middleware(BodyLimit)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for path, endpoint, method in front.ROUTES:
        app.add_api_route(path, endpoint, methods=[method])
    app.add_api_route("/v1/completions", completions_route, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions_route, methods=["POST"])
    app.add_api_route("/v1/models", models_route, methods=["GET"])
    app.add_api_route("/tokenize", tokenize_route, methods=["POST"])
    app.add_api_route("/detokenize", detokenize_route, methods=["POST"])
    # the lifecycle endpoints and the API's schema answer in every phase
    app.lifecycle_paths = frozenset([*(path for path, _, _ in front.ROUTES), app.openapi_url])
    app.direct_routes = {"/v1/completions": DirectRoute(CompletionRequest, create_completion),
                         "/v1/chat/completions": DirectRoute(ChatCompletionRequest, create_chat_completion)}
    return app
