"""A chat request's tools -> what the template sees, whether the output is parsed, and the grammar
that forces a call (runtime/api/tools.py; pure: no model)."""

from __future__ import annotations

import pytest

from graphserving.runtime.api.protocol import APIError, ChatCompletionRequest
from graphserving.runtime.api.tool_parsers import PARSERS
from graphserving.runtime.api.tools import ToolPlan, plan_tools, template_messages

HERMES, LLAMA = PARSERS["hermes"], PARSERS["llama3_json"]
CHATML = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']}}{% endfor %}"
RENDERS_TOOLS = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.tool_calls }}{% endfor %}"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], **fields})


def refused(fields: dict, family=HERMES, template=CHATML) -> APIError:
    with pytest.raises(APIError) as info:
        plan_tools(request(**fields), family, template)
    assert info.value.status == 400
    return info.value


def test_without_tools_nothing_changes():
    assert plan_tools(request(), HERMES, CHATML) == ToolPlan(family=HERMES)
    assert plan_tools(request(), None, CHATML) == ToolPlan()


def test_auto_parses_the_output_without_a_constraint():
    plan = plan_tools(request(tools=[WEATHER]), HERMES, CHATML)
    assert plan.parse and plan.family is HERMES and plan.constraint is None and plan.max_calls is None
    assert plan.functions == [WEATHER["function"]]
    assert plan.template_tools is None  # the ChatML template never mentions tools: the system message lists them


def test_a_template_that_renders_tools_gets_them():
    assert plan_tools(request(tools=[WEATHER, TIME]), HERMES, RENDERS_TOOLS).template_tools == [WEATHER, TIME]


def test_tool_choice_none_shows_and_parses_nothing():
    assert plan_tools(request(tools=[WEATHER], tool_choice="none"), None, CHATML) == ToolPlan()


def test_required_forces_one_call_of_any_tool():
    plan = plan_tools(request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), HERMES, CHATML)
    assert plan.max_calls == 1
    assert (plan.constraint.kind, plan.constraint.param) == ("grammar", "tool_choice")
    assert plan.constraint.value == HERMES.grammar([WEATHER["function"], TIME["function"]], parallel=False)


def test_a_named_tool_forces_that_tool():
    choice = {"type": "function", "function": {"name": "get_time"}}
    plan = plan_tools(request(tools=[WEATHER, TIME], tool_choice=choice), LLAMA, CHATML)
    assert plan.constraint.value == LLAMA.grammar([TIME["function"]], parallel=True)


def test_tools_without_a_parser_name_the_flag():
    error = refused({"tools": [WEATHER]}, family=None)
    assert (error.param, error.code) == ("tools", "unsupported")
    assert "--tool-call-parser" in error.message and "hermes or llama3_json" in error.message


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "'get_weather' is already the name of tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters", 'must be a JSON schema of type object, got type "string"'),
    ({"tool_choice": "required"}, "tool_choice", "only allowed together with tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "function 'get_time' is not one of tools ('get_weather')"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strng"}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters", "invalid JSON schema: "),
])
def test_invalid_tools_are_a_400_naming_the_field(fields, param, message):
    error = refused(fields)
    assert error.param == param
    assert error.message.startswith(f"{param}: ") and message in error.message


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools[0].function.parameters"),
    ({"tool_choice": "any"}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"documents": "Paris is in France"}, "documents"),
])
def test_shape_errors_are_caught_by_the_request_model(body, param):
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from graphserving.runtime.api.protocol import validation_error

    with pytest.raises(ValidationError) as info:
        request(**body)
    error = validation_error(RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]))
    assert (error.status, error.param) == (400, param)


# -- messages for the template ----------------------------------------------------------------------
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "content": "22 C", "tool_call_id": "call_1"},
]


def test_earlier_calls_reach_a_template_that_renders_them_with_dict_arguments():
    out = template_messages(HISTORY, ToolPlan(family=None), RENDERS_TOOLS)
    assert out[1]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert out[2] == {"role": "tool", "content": "22 C", "tool_call_id": "call_1", "name": "get_weather"}
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the request is not changed


def test_a_template_without_tool_calls_sees_them_in_the_family_format():
    plan = plan_tools(request(tools=[WEATHER]), HERMES, CHATML)
    out = template_messages(HISTORY, plan, CHATML)
    assert out[0] == {"role": "system", "content": HERMES.system_prompt([WEATHER["function"]])}
    assert out[2] == {"role": "assistant",
                      "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert out[3]["content"] == "<tool_response>\n22 C\n</tool_response>"


def test_the_tool_list_joins_an_existing_system_message():
    plan = plan_tools(request(tools=[TIME]), LLAMA, CHATML)
    out = template_messages([{"role": "system", "content": "Be brief."}, *HISTORY[:1]], plan, CHATML)
    assert out[0] == {"role": "system", "content": "Be brief.\n\n" + LLAMA.system_prompt([TIME["function"]])}
    assert len(out) == 2


def test_earlier_calls_without_a_way_to_render_them_are_refused():
    with pytest.raises(APIError) as info:
        template_messages(HISTORY, ToolPlan(family=None), CHATML)
    assert info.value.param == "messages[1].tool_calls"


@pytest.mark.parametrize(("arguments", "message"), [("{city", "not valid JSON"), ("[1]", "must be a JSON object")])
def test_earlier_call_arguments_must_be_a_json_object(arguments, message):
    broken = [{**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0],
                                             "function": {"name": "get_weather", "arguments": arguments}}]}]
    with pytest.raises(APIError) as info:
        template_messages(broken, ToolPlan(family=HERMES), RENDERS_TOOLS)
    assert info.value.param == "messages[0].tool_calls[0].function.arguments" and message in info.value.message
