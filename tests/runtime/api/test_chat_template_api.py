"""What a chat request gives the chat template beyond the messages: ``chat_template_kwargs`` and
``documents`` reach it (a model served with a custom template), and what a template cannot take
is a 400 naming the field (the shipped SmolLM2 template). Client: the ``openai`` SDK."""

from __future__ import annotations

import dataclasses

import openai
import pytest

from graphserving.contract.worker_config import EngineLimits
from graphserving.runtime.model.tokenizer import Tokenizer
from uvicorn_server import serving_engine

MODEL = "smollm2"
LIMITS = EngineLimits(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256)
HI = [{"role": "user", "content": "Hi"}]
CUSTOM = ("{% if persona %}<|im_start|>system\nYou are {{ persona }}.<|im_end|>\n{% endif %}"
          "{% for d in documents or [] %}<|im_start|>system\n[{{ d.title }}] {{ d.text }}<|im_end|>\n{% endfor %}"
          "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def custom(smollm2):
    """SmolLM2 served with :data:`CUSTOM` as its chat template."""
    tokenizer = Tokenizer(smollm2.tokenizer.hf_tokenizer, chat_template=CUSTOM,
                          eos_token_ids=smollm2.tokenizer.eos_token_ids)
    with serving_engine(dataclasses.replace(smollm2, tokenizer=tokenizer), LIMITS, MODEL) as s:
        yield client_of(s.url)


@pytest.fixture(scope="module")
def shipped(smollm2):
    with serving_engine(smollm2, LIMITS, MODEL) as s:
        yield client_of(s.url)


def prompt_tokens(client, **extra) -> int:
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, temperature=0, extra_body=extra)
    return r.usage.prompt_tokens


def test_chat_template_kwargs_reach_the_template(custom, smollm2):
    expected = "<|im_start|>system\nYou are a pirate.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert prompt_tokens(custom, chat_template_kwargs={"persona": "a pirate"}) == len(smollm2.tokenizer.encode(expected))
    assert prompt_tokens(custom) == len(smollm2.tokenizer.encode(expected.split("<|im_end|>\n", 1)[1]))


def test_documents_reach_the_template(custom, smollm2):
    documents = [{"title": "Paris", "text": "The capital of France."}]
    expected = ("<|im_start|>system\n[Paris] The capital of France.<|im_end|>\n"
                "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert prompt_tokens(custom, documents=documents) == len(smollm2.tokenizer.encode(expected))


@pytest.mark.parametrize(("extra", "param", "message"), [
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs.enable_thinking",
     "the model's chat template does not read this variable (it reads: add_generation_prompt, messages)"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize", "set by the server"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt",
     "set by the server"),
    ({"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs", "dictionary"),
    ({"documents": [{"title": "t", "text": "x"}]}, "documents", "does not render documents"),
])
def test_what_the_shipped_template_cannot_take_is_a_400_naming_it(shipped, extra, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        prompt_tokens(shipped, **extra)
    assert info.value.body["param"] == param
    assert message in info.value.body["message"]


def test_earlier_tool_calls_without_a_tool_call_format_are_a_400(shipped):
    history = [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    with pytest.raises(openai.BadRequestError) as info:
        shipped.chat.completions.create(model=MODEL, messages=history, max_tokens=1)
    assert info.value.body["param"] == "messages[1].tool_calls"
