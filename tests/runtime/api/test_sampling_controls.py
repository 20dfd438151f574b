"""``logit_bias`` and ``min_tokens`` over HTTP, with the official ``openai`` SDK as the client.

A real uvicorn server over the real SmolLM2 engine (CPU).
"""

import openai
import pytest

from graphserving.contract.worker_config import EngineLimits
from uvicorn_server import serving_engine

MODEL = "smollm2"
PROMPT = "My favourite animal is"


@pytest.fixture(scope="module")
def client(smollm2):
    limits = EngineLimits(num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256)
    with serving_engine(smollm2, limits, MODEL) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)


def test_logit_bias_forces_a_token_in_completions_and_chat(client, smollm2):
    banana = smollm2.tokenizer.encode(" banana")[0]
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                     logit_bias={str(banana): 100}, extra_body={"ignore_eos": True})
    assert done.choices[0].text == " banana" * 3
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          temperature=0, logit_bias={str(banana): 100})
    assert chat.choices[0].message.content == " banana" * 2


def test_min_tokens_holds_back_the_end_of_sequence(client, smollm2):
    eos = smollm2.tokenizer.eos_token_ids[0]
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logit_bias={str(eos): 100})
    assert client.completions.create(**kwargs).usage.completion_tokens == 1  # EOS at once
    held = client.completions.create(**kwargs, extra_body={"min_tokens": 4})
    assert held.usage.completion_tokens == 5  # four tokens, then the EOS
    assert held.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logit_bias": {"banana": 1}}, "logit_bias"),  # keys are token ids
        ({"logit_bias": {"1": 500}}, "logit_bias"),  # bias in [-100, 100]
        ({"logit_bias": {"49152": 1}}, "logit_bias"),  # outside SmolLM2's vocabulary of 49152
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
    ],
)
def test_bad_values_are_a_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=extra.pop("max_tokens", 4), extra_body=extra)
    assert err.value.body["param"] == param, err.value.body
    # the server goes on serving
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).usage.completion_tokens == 1


def test_chat_prompt_logprobs_cover_the_rendered_prompt(client):
    messages = [{"role": "user", "content": "Name a colour."}]
    done = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0,
                                          extra_body={"prompt_logprobs": 2})
    entries = done.to_dict()["prompt_logprobs"]
    assert len(entries) == done.usage.prompt_tokens and entries[0] is None
    for entry in entries[1:]:  # the prompt token itself, plus up to two of the most likely
        assert 1 <= len(entry) <= 3
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 for v in entry.values())
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, stream=True,
                                       extra_body={"prompt_logprobs": 1})
    assert err.value.body["param"] == "prompt_logprobs"
