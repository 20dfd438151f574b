"""Chat templates rendered through transformers' own renderer: parity on the shipped SmolLM2
template, and the inputs beyond the messages (tools, documents, template variables) reaching it.

The expected prompts are written out from SmolLM2-135M-Instruct's template (its GGUF
``tokenizer.chat_template``): a default system turn when the first message is not a system one,
then ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`` per message, then ``<|im_start|>assistant\\n`` with
the generation prompt.
"""

from __future__ import annotations

import pytest

from graphserving.runtime.model.tokenizer import RESERVED_TEMPLATE_KWARGS, Tokenizer, TokenizerError

SMOLLM2_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def turn(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


ASSISTANT_OPENING = "<|im_start|>assistant\n"

PARITY_CASES = [
    pytest.param([{"role": "user", "content": "Hi"}], True,
                 SMOLLM2_SYSTEM + turn("user", "Hi") + ASSISTANT_OPENING, id="user-generation-prompt"),
    pytest.param([{"role": "user", "content": "Hi"}], False,
                 SMOLLM2_SYSTEM + turn("user", "Hi"), id="user-no-generation-prompt"),
    pytest.param([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], True,
                 turn("system", "Be brief.") + turn("user", "Hi") + ASSISTANT_OPENING, id="system"),
    pytest.param([{"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Spain?"}], True,
                 SMOLLM2_SYSTEM + turn("user", "What is the capital of France?") + turn("assistant", "Paris.")
                 + turn("user", "And of Spain?") + ASSISTANT_OPENING, id="multi-turn"),
    pytest.param([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
                  {"role": "assistant", "content": "Paris."}], False,
                 turn("system", "Be brief.") + turn("user", "Capital of France?") + turn("assistant", "Paris."),
                 id="multi-turn-system-ends-with-assistant"),
    pytest.param([{"role": "user", "content": "Grüße 🚀\n{{ not a template }} {% raw %}"},
                  {"role": "assistant", "content": ""}], False,
                 SMOLLM2_SYSTEM + turn("user", "Grüße 🚀\n{{ not a template }} {% raw %}") + turn("assistant", ""),
                 id="content-is-not-re-rendered"),
]


@pytest.mark.parametrize(("messages", "add_generation_prompt", "expected"), PARITY_CASES)
def test_the_shipped_template_renders_the_chatml_prompt(smollm2, messages, add_generation_prompt, expected):
    assert smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_template_variables_reach_a_custom_template(smollm2):
    template = "{{ greeting }}, {{ messages[0]['content'] }}{% if add_generation_prompt %} ->{% endif %}"
    tokenizer = Tokenizer(smollm2.tokenizer.hf_tokenizer, chat_template=template)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Ada"}], greeting="Hello") == "Hello, Ada ->"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Ada"}], add_generation_prompt=False,
                                         greeting="Bye") == "Bye, Ada"


def test_a_template_passed_per_call_replaces_the_model_template(smollm2):
    prompt = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Ada"}],
                                                   chat_template="[{{ messages | length }}] {{ eos_token }}")
    assert prompt == "[1] <|im_end|>"


def test_tools_and_documents_reach_the_template(smollm2):
    template = ("{% for t in tools %}{{ t.function.name }}({{ t.function.parameters.required | join(',') }});"
                "{% endfor %}{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}")
    tokenizer = Tokenizer(smollm2.tokenizer.hf_tokenizer, chat_template=template)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    documents = [{"title": "Paris", "text": "Capital of France."}]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=tools, documents=documents)
    assert prompt == "get_weather(city);[Paris: Capital of France.]"


def test_earlier_tool_calls_reach_the_template_with_dict_arguments(smollm2):
    template = ("{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.name }}"
                "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}")
    tokenizer = Tokenizer(smollm2.tokenizer.hf_tokenizer, chat_template=template)
    messages = [{"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"city": "Köln"}}}]}]
    assert tokenizer.apply_chat_template(messages) == 'f{"city": "Köln"}'


def test_keys_whose_value_is_none_are_dropped_before_rendering(smollm2):
    tokenizer = Tokenizer(smollm2.tokenizer.hf_tokenizer,
                          chat_template="{{ messages[0].get('name', 'anonymous') }}:{{ messages[0].content }}")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi", "name": None}]) == "anonymous:hi"


def test_the_generation_tag_of_transformers_templates_renders(smollm2):
    template = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    tokenizer = Tokenizer(smollm2.tokenizer.hf_tokenizer, chat_template=template)
    assert tokenizer.apply_chat_template([{"role": "assistant", "content": "done"}]) == "done"


@pytest.mark.parametrize("name", ["tokenize", "return_dict", "conversation", "continue_final_message"])
def test_a_reserved_variable_is_refused(smollm2, name):
    assert name in RESERVED_TEMPLATE_KWARGS
    with pytest.raises(TokenizerError, match=f"template variable '{name}' is set by the renderer itself"):
        smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], **{name: True})


def test_a_template_with_a_syntax_error_names_its_line(smollm2):
    tokenizer = Tokenizer(smollm2.tokenizer.hf_tokenizer, chat_template="ok\n{% for m in messages %}{{ m }}")
    with pytest.raises(TokenizerError, match=r"not valid Jinja2 \(line 2\)"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_no_template_is_a_tokenizer_error(smollm2):
    tokenizer = Tokenizer(smollm2.tokenizer.hf_tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(TokenizerError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_variables_lists_what_the_template_reads(smollm2):
    assert smollm2.tokenizer.template_variables() == frozenset({"messages", "add_generation_prompt"})
    tokenizer = Tokenizer(smollm2.tokenizer.hf_tokenizer,
                          chat_template="{% set x = 1 %}{% if enable_thinking %}{{ x }}{% endif %}{{ bos_token }}")
    assert tokenizer.template_variables() == frozenset({"enable_thinking", "bos_token"})
    assert Tokenizer(smollm2.tokenizer.hf_tokenizer, chat_template="{% if %}").template_variables() is None
