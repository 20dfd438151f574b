"""``response_format`` and vLLM's ``guided_*`` fields -> the engine's :class:`StructuredOutput`
(protocol.structured_output; pure), and end to end through the ``openai`` SDK on the real SmolLM2
engine (the engine compiles and enforces the grammar: runtime/engine/structured.py)."""

from __future__ import annotations

import json

import openai
import pytest

from graphserving.contract.worker_config import EngineLimits
from graphserving.runtime.api.completions import sampling_params
from graphserving.runtime.api.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                               structured_output)
from graphserving.runtime.engine.structured import StructuredOutput
from uvicorn_server import serving_engine

MODEL = "smollm2"
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}], **fields})


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object", "", "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}},
     StructuredOutput("json_schema", json.dumps(CITY), "response_format.json_schema.schema")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
     StructuredOutput("json_object", "", "response_format")),
    ({"guided_json": CITY}, StructuredOutput("json_schema", json.dumps(CITY), "guided_json")),
    ({"guided_json": '{"type": "object"}'}, StructuredOutput("json_schema", '{"type": "object"}', "guided_json")),
    ({"guided_regex": "(yes|no)"}, StructuredOutput("regex", "(yes|no)", "guided_regex")),
    ({"guided_choice": ["Paris", "Rome"]}, StructuredOutput("choice", '["Paris", "Rome"]', "guided_choice")),
    ({"guided_grammar": 'start: "a"+'}, StructuredOutput("grammar", 'start: "a"+', "guided_grammar")),
])
@pytest.mark.parametrize("make", [completion, chat])
def test_each_field_maps_to_its_structured_output(make, fields, expected):
    req = make(**fields)
    assert structured_output(req) == expected
    assert sampling_params(req, max_tokens=4, logprobs=None).structured == expected


def test_the_tool_choice_constraint_is_passed_on():
    tools = StructuredOutput("grammar", 'start: "x"', "tool_choice")
    assert structured_output(chat(), tools) is tools
    assert sampling_params(chat(), max_tokens=4, logprobs=None, structured=tools).structured is tools


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "guided_regex: a request takes one output constraint, and response_format is one already"),
    ({"guided_json": CITY, "guided_choice": ["a"]}, "guided_choice",
     "guided_choice: a request takes one output constraint, and guided_json is one already"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "response_format.json_schema: required when type is json_schema"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": CITY}}},
     "response_format.json_schema", "response_format.json_schema: only goes with type json_schema, got type json_object"),
])
def test_inconsistent_constraints_are_a_400_naming_the_field(fields, param, message):
    with pytest.raises(APIError) as info:
        structured_output(completion(**fields))
    assert (info.value.status, info.value.param) == (400, param)
    assert info.value.message.startswith(message)


def test_two_constraints_with_tool_choice_name_tool_choice():
    with pytest.raises(APIError) as info:
        structured_output(chat(response_format={"type": "json_object"}),
                          StructuredOutput("grammar", 'start: "x"', "tool_choice"))
    assert info.value.param == "tool_choice"


# -- end to end -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(smollm2):
    limits = EngineLimits(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256)
    with serving_engine(smollm2, limits, MODEL) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)


def test_guided_choice_constrains_a_completion(client):
    r = client.completions.create(model=MODEL, prompt="The capital of Italy is", max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": ["Paris", "Rome", "Madrid"]})
    assert r.choices[0].text in ("Paris", "Rome", "Madrid")
    assert r.choices[0].finish_reason == "stop"


def test_a_json_schema_response_format_constrains_a_chat_answer(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": {**CITY, "x-guidance": {
        "whitespace_flexible": False}}}}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Capital of Italy?"}],
                                       response_format=fmt, max_tokens=16, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert json.loads(r.choices[0].message.content)["city"] in ("Paris", "Rome")


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json"),
])
def test_invalid_constraints_are_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       extra_body=body)
    assert info.value.body["param"] == param
