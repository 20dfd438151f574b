"""Tool-call parsers on literal model outputs of each family (pure), their streaming deltas, and
the grammars that force a call (validated and matched with llguidance on SmolLM2's tokenizer)."""

from __future__ import annotations

import json

import pytest

from graphserving.runtime.api.tool_parsers import (
    PARSER_CHOICES,
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    collect,
    detect_family,
    resolve_parser,
)

HERMES = HermesParser()
LLAMA = Llama3JsonParser()

# -- literal outputs: (text, expected content, expected [(name, arguments JSON)]) ----------------
HERMES_OUTPUTS = [
    pytest.param(  # Qwen2.5-7B-Instruct, one call
        '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
        '</tool_call>',
        None, [("get_current_temperature", '{"location": "San Francisco, CA, USA"}')], id="qwen-one"),
    pytest.param(  # Qwen2.5, two calls in one turn
        '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "Paris", "date": "2024-10-01"}}\n'
        '</tool_call>',
        None, [("get_current_temperature", '{"location": "Paris"}'),
               ("get_temperature_date", '{"location": "Paris", "date": "2024-10-01"}')], id="qwen-two"),
    pytest.param(  # Hermes-2-Pro writes the arguments first
        '<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n</tool_call>',
        None, [("get_stock_fundamentals", '{"symbol": "TSLA"}')], id="hermes2pro-arguments-first"),
    pytest.param(  # Qwen3 after its reasoning, nested arguments with braces inside strings
        "Let me look that up.\n\n<tool_call>\n"
        '{"name": "search", "arguments": {"query": "a {b} \\"c\\"", "filters": [{"k": "v"}], "n": 3}}\n</tool_call>',
        "Let me look that up.", [("search", '{"query": "a {b} \\"c\\"", "filters": [{"k": "v"}], "n": 3}')],
        id="qwen3-text-then-call"),
    pytest.param("The capital of France is Paris.", "The capital of France is Paris.", [], id="no-call"),
    pytest.param("Use <b>bold</b> and <tool>.", "Use <b>bold</b> and <tool>.", [], id="marker-lookalikes"),
    pytest.param(  # not JSON inside the markers: passed through as content
        "<tool_call>\nget_weather(city='Paris')\n</tool_call>", "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
        [], id="not-json"),
    pytest.param('Well <tool_call>\n{"tool": "f", "args": {}}\n</tool_call> ok',  # an object that is no call
                 'Well <tool_call>\n{"tool": "f", "args": {}}\n</tool_call> ok', [], id="object-that-is-no-call"),
]

LLAMA_OUTPUTS = [
    pytest.param(  # Llama 3.1/3.2 JSON tool call (model card)
        '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}',
        None, [("get_current_conditions", '{"location": "San Francisco, CA", "unit": "Fahrenheit"}')], id="one"),
    pytest.param(  # Llama 3.1 with the python tag kept (skip_special_tokens false)
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None, [("get_weather", '{"city": "Paris"}')], id="python-tag"),
    pytest.param(
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
        None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")], id="two"),
    pytest.param("Paris is the capital of France.", "Paris is the capital of France.", [], id="no-call"),
    pytest.param('Here you go: {"name": "x"}', 'Here you go: {"name": "x"}', [], id="json-after-text-is-content"),
    pytest.param('{"city": "Paris"}', '{"city": "Paris"}', [], id="json-that-is-no-call"),
]


def calls_of(calls) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_OUTPUTS)
def test_hermes_parses_whole_outputs(text, content, calls):
    got_content, got_calls = HERMES.parse(text)
    assert (got_content, calls_of(got_calls)) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA_OUTPUTS)
def test_llama3_json_parses_whole_outputs(text, content, calls):
    got_content, got_calls = LLAMA.parse(text)
    assert (got_content, calls_of(got_calls)) == (content, calls)


def test_calls_get_distinct_openai_ids_and_json_arguments():
    _, calls = HERMES.parse(HERMES_OUTPUTS[1].values[0])
    ids = [c.id for c in calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") and len(i) == 29 for i in ids)
    assert calls[1].openai() == {"id": ids[1], "type": "function", "function": {
        "name": "get_temperature_date", "arguments": '{"location": "Paris", "date": "2024-10-01"}'}}
    assert json.loads(calls[1].arguments) == {"location": "Paris", "date": "2024-10-01"}


# -- streaming ------------------------------------------------------------------------------------
def stream(parser, text: str, size: int, max_calls=None) -> list[dict]:
    streamer = parser.streamer(max_calls)
    deltas = []
    for i in range(0, len(text), size):
        deltas += streamer.feed(text[i:i + size])
    return deltas + streamer.finish()


@pytest.mark.parametrize("size", [1, 2, 5, 13, 10_000])
@pytest.mark.parametrize(("parser", "case"), [(HERMES, c) for c in HERMES_OUTPUTS] + [(LLAMA, c) for c in LLAMA_OUTPUTS])
def test_streamed_deltas_add_up_to_the_whole_parse(parser, case, size):
    text, content, calls = case.values
    got_content, got_calls = collect(stream(parser, text, size))
    assert (got_content, calls_of(got_calls)) == (content, calls)


@pytest.mark.parametrize("size", [1, 4])
def test_a_streamed_call_opens_with_its_name_then_sends_argument_fragments(size):
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    deltas = stream(HERMES, text, size)
    texts = [d["content"] for d in deltas if "content" in d]
    assert "".join(texts) == "Sure." and deltas[:len(texts)] == [{"content": t} for t in texts]
    opening = deltas[len(texts)]["tool_calls"][0]
    assert opening == {"index": 0, "id": opening["id"], "type": "function",
                       "function": {"name": "get_weather", "arguments": ""}}
    fragments = [d["tool_calls"][0] for d in deltas[len(texts) + 1:]]
    assert all(set(f) == {"index", "function"} and set(f["function"]) == {"arguments"} for f in fragments)
    assert "".join(f["function"]["arguments"] for f in fragments) == '{"city": "Paris"}'
    if size == 1:
        assert len(fragments) == len('{"city": "Paris"}')  # sent as the text arrives, not at the end


def test_text_that_may_open_a_call_is_held_back_until_it_does_not():
    streamer = HERMES.streamer()
    assert streamer.feed("Use <tool") == [{"content": "Use"}]  # the space waits for what follows
    assert streamer.feed("box> now") == [{"content": " <toolbox> now"}]
    assert streamer.finish() == []


def test_whitespace_around_calls_is_dropped():
    text = ('\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n\n'
            '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\n')
    deltas = stream(HERMES, text, 3)
    assert not any("content" in d for d in deltas)
    content, calls = HERMES.parse(text)
    assert content is None and calls_of(calls) == [("f", "{}"), ("g", "{}")]
    assert HERMES.parse("  Hi \n") == ("  Hi \n", [])  # without calls the text is untouched


def test_max_calls_keeps_the_first_call():
    text = HERMES_OUTPUTS[1].values[0]
    assert calls_of(HERMES.parse(text, max_calls=1)[1]) == [("get_current_temperature", '{"location": "Paris"}')]
    two = LLAMA_OUTPUTS[2].values[0]
    assert calls_of(LLAMA.parse(two, max_calls=1)[1]) == [("get_weather", '{"city": "Paris"}')]
    assert calls_of(collect(stream(HERMES, text, 3, max_calls=1))[1]) == [("get_current_temperature",
                                                                          '{"location": "Paris"}')]


def test_an_output_cut_inside_a_call():
    named = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    content, calls = HERMES.parse(named)
    assert content is None and calls_of(calls) == [("get_weather", '{"city": "Par')]  # finish_reason says length
    unnamed = '<tool_call>\n{"arguments": {"city": "Par'
    assert HERMES.parse(unnamed) == (unnamed, [])


# -- grammars -------------------------------------------------------------------------------------
WEATHER = {"name": "get_weather", "description": "Weather // in a city # now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
ADD = {"name": "add", "parameters": {"type": "object", "properties": {"x": {"$ref": "#/$defs/count"}},
                                     "required": ["x"], "$defs": {"count": {"type": "integer", "minimum": 0}}}}
NO_PARAMS = {"name": "now"}


@pytest.fixture(scope="module")
def ll_tokenizer(smollm2):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(smollm2.tokenizer.hf_tokenizer, eos_token=smollm2.tokenizer.eos_token_ids[0])


def matches(ll_tokenizer, tokenizer, grammar: str, text: str) -> bool:
    """Whether ``text`` (as SmolLM2 tokenizes it) is a complete output of ``grammar``."""
    import llguidance

    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    ids = tokenizer.encode(text)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


@pytest.mark.parametrize("parser", [HERMES, LLAMA])
@pytest.mark.parametrize("parallel", [False, True])
def test_the_grammars_compile(ll_tokenizer, parser, parallel):
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_lark(parser.grammar([WEATHER, ADD, NO_PARAMS], parallel))
    assert llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer) == ""


def hermes_call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def llama_call(name: str, args: str) -> str:
    return f'{{"name": "{name}", "parameters": {args}}}'


@pytest.mark.parametrize(("parser", "call", "sep"), [(HERMES, hermes_call, "\n"), (LLAMA, llama_call, "; ")])
def test_a_grammar_accepts_exactly_calls_of_the_given_tools(smollm2, ll_tokenizer, parser, call, sep):
    tok = smollm2.tokenizer
    one, parallel = parser.grammar([WEATHER, ADD], False), parser.grammar([WEATHER, ADD], True)
    weather, add = call("get_weather", '{"city": "Paris"}'), call("add", '{"x": 3}')
    assert matches(ll_tokenizer, tok, one, weather) and matches(ll_tokenizer, tok, one, add)
    assert not matches(ll_tokenizer, tok, one, weather + sep + add)  # one call without parallel_tool_calls
    assert matches(ll_tokenizer, tok, parallel, weather + sep + add)
    assert not matches(ll_tokenizer, tok, one, call("get_time", "{}"))  # not one of the tools
    assert not matches(ll_tokenizer, tok, one, call("get_weather", '{"city": "Paris", "country": "FR"}'))
    assert not matches(ll_tokenizer, tok, one, call("add", '{"x": -1}'))  # the $ref'd schema holds
    assert not matches(ll_tokenizer, tok, one, call("add", '{"x":3}'))  # compact separators only
    assert not matches(ll_tokenizer, tok, one, "Sure! " + weather)


def test_a_named_tool_grammar_allows_only_that_tool(smollm2, ll_tokenizer):
    grammar = HERMES.grammar([ADD], False)
    assert matches(ll_tokenizer, smollm2.tokenizer, grammar, hermes_call("add", '{"x": 0}'))
    assert not matches(ll_tokenizer, smollm2.tokenizer, grammar, hermes_call("get_weather", '{"city": "Paris"}'))


def test_a_tool_without_parameters_takes_any_object(smollm2, ll_tokenizer):
    grammar = HERMES.grammar([NO_PARAMS], False)
    assert matches(ll_tokenizer, smollm2.tokenizer, grammar, hermes_call("now", "{}"))
    assert matches(ll_tokenizer, smollm2.tokenizer, grammar, hermes_call("now", '{"tz": "UTC"}'))


# -- prompt text, family detection ----------------------------------------------------------------
def test_hermes_system_prompt_lists_the_tools():
    assert HERMES.system_prompt([NO_PARAMS]) == (
        "# Tools\n\nThese functions can be called, one JSON signature per line between <tools> and </tools>:\n"
        '<tools>\n{"type": "function", "function": {"name": "now"}}\n</tools>\n\n'
        "To call one (or several, one after the other), write for each call its name and arguments as "
        "one JSON object between <tool_call> and </tool_call>:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def test_llama3_system_prompt_lists_the_tools():
    assert LLAMA.system_prompt([NO_PARAMS]) == (
        'These functions can be called, one JSON signature per line:\n\n{"type": "function", "function": {"name": "now"}}'
        '\n\nTo call one, answer with only a JSON object {"name": <function name>, "parameters": '
        "<an object of argument names and literal values>}.")


def test_earlier_calls_and_results_as_family_text():
    assert HERMES.call_text([("f", {"a": 1}), ("g", {})]) == (
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n'
        '</tool_call>')
    assert HERMES.result_text("22 C") == "<tool_response>\n22 C\n</tool_response>"
    assert LLAMA.call_text([("f", {"a": 1}), ("g", {})]) == (
        '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}')
    assert LLAMA.result_text("22 C") == "22 C"


@pytest.mark.parametrize(("template", "family"), [
    ("{%- if tools %}...<tool_call>\\n{\"name\": <function-name>, ...}</tool_call>{%- endif %}", "hermes"),  # Qwen2.5
    ("{%- if builtin_tools is defined or tools is not none %}{{- '<|python_tag|>' }}", "llama3_json"),  # Llama 3.1
    ("{%- elif message.role == \"tool\" or message.role == \"ipython\" %}", "llama3_json"),  # Llama 3.2
    ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}{% endfor %}", "none"),  # SmolLM2
    (None, "none"),
])
def test_the_family_is_detected_from_the_template(template, family):
    assert detect_family(template) == family
    assert resolve_parser("auto", template) is PARSERS.get(family)


def test_an_explicit_parser_overrides_detection_and_none_disables():
    assert resolve_parser("hermes", None) is PARSERS["hermes"]
    assert resolve_parser("none", "<tool_call>") is None
    assert PARSER_CHOICES == ("auto", "hermes", "llama3_json", "none")
    with pytest.raises(ValueError, match="--tool-call-parser: expected one of auto, hermes, llama3_json, none"):
        resolve_parser("mistral", None)
