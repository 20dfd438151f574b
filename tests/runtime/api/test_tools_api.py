"""Tool calling end to end with the official ``openai`` SDK: the real SmolLM2 engine behind the
worker's app with ``--tool-call-parser hermes`` (SmolLM2's ChatML template names no format, so
``auto`` finds none). ``tool_choice: "required"`` / a named function are enforced by the grammar,
which makes even a 135M model produce a parseable call."""

from __future__ import annotations

import contextlib
import json

import openai
import pytest

from graphserving.contract.worker_config import EngineLimits
from graphserving.runtime.api.app import ServerState, build_app
from graphserving.runtime.api.tool_parsers import PARSERS
from graphserving.runtime.engine.async_engine import AsyncLLMEngine
from graphserving.runtime.engine.core import LLMEngine
from graphserving.runtime.engine.metrics import EngineMetrics
from uvicorn_server import ReadyLifecycle, serving_app

MODEL = "smollm2"
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
                   "required": ["city"], "additionalProperties": False}}}


@contextlib.contextmanager
def serving(loaded, tool_call_parser: str):
    """The worker's app over a fresh SmolLM2 engine, its parser set as ``--tool-call-parser`` sets it."""
    limits = EngineLimits(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256)
    metrics = EngineMetrics(MODEL, limits.max_num_seqs, limits.max_num_batched_tokens)
    async_engine = AsyncLLMEngine(LLMEngine(loaded.model, loaded.config, loaded.tokenizer, limits, metrics=metrics))
    async_engine.start()
    state = ServerState(MODEL, ReadyLifecycle(), metrics, engine=async_engine, tool_call_parser=tool_call_parser)
    try:
        with serving_app(build_app(state)) as url:
            yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    finally:
        async_engine.shutdown()


@pytest.fixture(scope="module")
def hermes(smollm2):
    with serving(smollm2, "hermes") as client:
        yield client


@pytest.fixture(scope="module")
def auto(smollm2):
    with serving(smollm2, "auto") as client:
        yield client


def create(client, **fields):
    return client.chat.completions.create(model=MODEL, messages=fields.pop("messages", PARIS), temperature=0,
                                          **fields)


def test_required_returns_a_tool_call(hermes):
    r = create(hermes, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    assert json.loads(call.function.arguments)["city"] in ("Paris", "London", "Rome")


def test_a_named_tool_is_the_one_called_and_streams_as_tool_call_deltas(hermes):
    choice = {"type": "function", "function": {"name": "get_time"}}
    stream = create(hermes, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False, max_tokens=40,
                    stream=True)
    chunks = [c for c in stream if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant"
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert calls[0].index == 0 and calls[0].id.startswith("call_") and calls[0].type == "function"
    assert calls[0].function.name == "get_time" and calls[0].function.arguments == ""
    assert all(tc.index == 0 and tc.id is None and tc.function.name is None for tc in calls[1:])
    arguments = "".join(tc.function.arguments for tc in calls)
    assert json.loads(arguments) in ({"city": "Paris"}, {"city": "London"})
    assert not any(d.content for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)


def test_the_streamed_call_equals_the_non_streamed_one(hermes):
    fields = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 40}
    whole = create(hermes, **fields).choices[0].message.tool_calls[0]
    calls = [tc for c in create(hermes, stream=True, **fields) if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert (calls[0].function.name, "".join(tc.function.arguments for tc in calls)) == \
        (whole.function.name, whole.function.arguments)


def test_auto_answers_prose_as_content_when_the_model_calls_nothing(hermes):
    r = create(hermes, tools=[WEATHER], max_tokens=8)
    choice = r.choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content and "<tool_call>" not in choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_the_tool_list_goes_into_the_prompt(hermes, smollm2):
    without = create(hermes, max_tokens=1).usage.prompt_tokens
    with_tools = create(hermes, tools=[WEATHER], max_tokens=1).usage.prompt_tokens
    tok = smollm2.tokenizer
    system = PARSERS["hermes"].system_prompt([WEATHER["function"]])
    expected = tok.encode(tok.apply_chat_template([{"role": "system", "content": system}, *PARIS]))
    assert with_tools == len(expected) > without


def test_a_conversation_with_earlier_calls_renders_them_in_the_family_format(hermes, smollm2):
    history = [*PARIS,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}]
    got = create(hermes, messages=history, max_tokens=1).usage.prompt_tokens
    tok = smollm2.tokenizer
    expected = tok.apply_chat_template([
        *PARIS,
        {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                         '</tool_call>'},
        {"role": "tool", "content": "<tool_response>\n22 C, sunny\n</tool_response>"}])
    assert got == len(tok.encode(expected))


def test_tools_without_a_parser_are_a_400_naming_tools_and_the_flag(auto):
    with pytest.raises(openai.BadRequestError) as info:
        create(auto, tools=[WEATHER], max_tokens=4)
    error = info.value.body
    assert error["param"] == "tools" and "--tool-call-parser" in error["message"]
    assert create(auto, tools=[WEATHER], tool_choice="none", max_tokens=1).choices[0].message.tool_calls is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
])
def test_invalid_tool_requests_are_a_400_naming_the_field(hermes, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        create(hermes, max_tokens=4, **fields)
    assert info.value.body["param"] == param
    assert info.value.body["message"].startswith(f"{param}: ")


def test_the_worker_flag_chooses_the_parser(smollm2):
    from graphserving.contract.worker_config import WorkerConfig
    from graphserving.runtime.api.tool_parsers import PARSER_CHOICES
    from graphserving.runtime.worker import TOOL_CALL_PARSERS, Worker, build_parser

    assert TOOL_CALL_PARSERS == PARSER_CHOICES
    parser = build_parser()
    assert parser.parse_args(["--model", "m.gguf"]).tool_call_parser == "auto"
    args = parser.parse_args(["--model", "m.gguf", "--tool-call-parser", "hermes"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m.gguf", "--tool-call-parser", "mistral"])
    config = WorkerConfig(model_name=MODEL, model_path=str(smollm2.path), engine=EngineLimits(num_kv_blocks=64))
    worker = Worker(config, smollm2, 0.1, environ={}, tool_call_parser=args.tool_call_parser)
    assert worker.server.tool_call_parser == "hermes"
