"""Completions ``echo``, ``max_tokens`` 0 and ``prompt_logprobs`` (issue 18, item 4): what
lm-evaluation-harness's loglikelihood requests need, on a real uvicorn server over the real SmolLM2
engine, with the official ``openai`` SDK as the client where it has the fields.

lm-eval's ``local-completions`` model sends ``{"prompt": <token ids>, "echo": true, "max_tokens": 0
or 1, "logprobs": 1, "temperature": 0, "seed"}`` and reads ``choices[i].logprobs``: ``token_logprobs``
from the context's length on (the first entry null), and whether each equals the largest value of
its ``top_logprobs`` entry (greedy).
"""

from __future__ import annotations

import json

import httpx
import pytest

torch = pytest.importorskip("torch")

from graphserving.contract.worker_config import EngineLimits  # noqa: E402
from uvicorn_server import serving_engine  # noqa: E402

MODEL = "smollm2"
CONTEXT = "The capital of France is"
CONTINUATION = " Paris"


@pytest.fixture(scope="module")
def server(smollm2):
    limits = EngineLimits(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=8)  # prompts span chunks
    with serving_engine(smollm2, limits, MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokens(smollm2):
    context = smollm2.tokenizer.encode(CONTEXT)
    return context, context + smollm2.tokenizer.encode(CONTINUATION)


@pytest.fixture(scope="module")
def reference(smollm2_reference, tokens):
    """The transformers reference's log-probability of every token of the whole request, given
    the tokens before it (the first has none)."""
    _, whole = tokens
    with torch.inference_mode():
        logprobs = torch.log_softmax(smollm2_reference(torch.tensor([whole])).logits[0].float(), dim=-1)
    return [None] + logprobs[torch.arange(len(whole) - 1), torch.tensor(whole[1:])].tolist()


def test_lm_evals_loglikelihood_request_through_the_openai_sdk(sdk, tokens, reference):
    context, whole = tokens
    out = sdk.completions.create(model=MODEL, prompt=whole, echo=True, max_tokens=0, logprobs=1, temperature=0,
                                 seed=1234)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(whole), 0)
    assert choice.text == CONTEXT + CONTINUATION
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(whole)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(reference[1:], abs=2e-3)
    assert "".join(lp.tokens) == choice.text and lp.text_offset[0] == 0
    continuation = sum(lp.token_logprobs[len(context):])  # what lm-eval sums (it drops a generated last one)
    assert continuation == pytest.approx(sum(reference[len(context):]), abs=5e-3)
    for value, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert value in top.values() and value <= max(top.values())  # the token's own entry is always there


def test_max_tokens_1_appends_the_generated_token_after_the_prompt(client, tokens):
    _, whole = tokens
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": whole, "echo": True, "max_tokens": 1,
                                                 "logprobs": 1, "temperature": 0}).json()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(whole) + 1 and lp["token_logprobs"][0] is None
    assert body["usage"]["completion_tokens"] == 1
    assert choice["text"] == CONTEXT + CONTINUATION + lp["tokens"][-1]
    assert lp["text_offset"][-1] == len(CONTEXT + CONTINUATION)
    greedy = lp["top_logprobs"][-1]
    assert lp["token_logprobs"][-1] == max(greedy.values())  # temperature 0 takes the most likely token


def test_a_text_prompt_is_echoed_as_given(client, reference):
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": CONTEXT + CONTINUATION, "echo": True,
                                                 "max_tokens": 0, "logprobs": 0}).json()
    lp = body["choices"][0]["logprobs"]
    assert body["choices"][0]["text"] == CONTEXT + CONTINUATION
    assert lp["token_logprobs"][1:] == pytest.approx(reference[1:], abs=2e-3)
    assert all(top is None for top in lp["top_logprobs"])  # logprobs 0: no alternatives


def test_echo_without_logprobs_returns_the_prompt_then_the_completion(client):
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": [CONTEXT, "Hello"], "echo": True,
                                                 "max_tokens": 2, "temperature": 0, "ignore_eos": True}).json()
    plain = client.post("/v1/completions", json={"model": MODEL, "prompt": [CONTEXT, "Hello"], "max_tokens": 2,
                                                  "temperature": 0, "ignore_eos": True}).json()
    assert [c["text"] for c in body["choices"]] == [p + c["text"] for p, c in zip([CONTEXT, "Hello"], plain["choices"])]
    assert all(c["logprobs"] is None for c in body["choices"])


def test_prompt_logprobs_come_in_vllms_shape(client, tokens, reference, smollm2):
    _, whole = tokens
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": whole, "max_tokens": 1,
                                                 "temperature": 0, "prompt_logprobs": 2}).json()
    choice = body["choices"][0]
    entries = choice["prompt_logprobs"]
    assert choice["logprobs"] is None and choice["text"] != ""  # no echo: the completion alone
    assert len(entries) == len(whole) and entries[0] is None
    for token, expected, entry in zip(whole[1:], reference[1:], entries[1:]):
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(expected, abs=2e-3)
        assert own["decoded_token"] == smollm2.tokenizer.token_to_str(token)
        assert list(entry)[0] == str(token)  # the prompt token first, then the top 2 (it may be one of them)
        ranks = sorted(v["rank"] for v in entry.values())
        assert ranks == ([1, 2] if own["rank"] <= 2 else [1, 2, own["rank"]])


def test_a_streamed_echo_opens_each_choice_with_its_prompt(client, tokens):
    _, whole = tokens
    request = {"model": MODEL, "prompt": whole, "echo": True, "max_tokens": 3, "logprobs": 1, "temperature": 0,
               "ignore_eos": True, "n": 2, "prompt_logprobs": 0}
    whole_answer = client.post("/v1/completions", json=request).json()
    with client.stream("POST", "/v1/completions", json={**request, "stream": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    for index in (0, 1):
        chunks = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        expected = whole_answer["choices"][index]
        assert chunks[0]["text"].startswith(CONTEXT + CONTINUATION)
        assert chunks[0]["logprobs"]["token_logprobs"][0] is None
        assert len(chunks[0]["prompt_logprobs"]) == len(whole)
        assert all("prompt_logprobs" not in c for c in chunks[1:])
        assert "".join(c["text"] for c in chunks) == expected["text"]
        streamed = [v for c in chunks for v in c["logprobs"]["token_logprobs"]]
        assert streamed[1:] == pytest.approx(expected["logprobs"]["token_logprobs"][1:], abs=1e-4)
        assert [o for c in chunks for o in c["logprobs"]["text_offset"]] == expected["logprobs"]["text_offset"]


def test_top_logprobs_always_hold_the_token_itself(client):
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": CONTEXT, "max_tokens": 12, "logprobs": 1,
                                                 "temperature": 2.0, "seed": 7, "ignore_eos": True}).json()
    lp = body["choices"][0]["logprobs"]
    assert all(token in top and top[token] == value
               for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
    assert max(len(top) for top in lp["top_logprobs"]) == 2  # a sampled token outside the top 1 comes with it


def test_max_tokens_0_without_echo_is_a_400_naming_max_tokens(client, sdk):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as error:
        sdk.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=0)
    assert error.value.body["param"] == "max_tokens"
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": CONTEXT, "max_tokens": 0,
                                                     "logprobs": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("field,value", [("prompt_logprobs", 21), ("prompt_logprobs", -1), ("max_tokens", -1)])
def test_out_of_range_values_are_a_400_naming_the_field(client, field, value):
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": CONTEXT, "echo": True, field: value})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field
