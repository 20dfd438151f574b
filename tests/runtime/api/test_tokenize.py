"""``POST /tokenize`` and ``POST /detokenize`` (issue 18, item 4) on a real uvicorn server over the
real SmolLM2 engine: the counts agree with what the completion routes charge as prompt tokens."""

from __future__ import annotations

import httpx
import pytest

from graphserving.contract.worker_config import EngineLimits
from uvicorn_server import serving_engine

MODEL = "smollm2"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(smollm2):
    limits = EngineLimits(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256)
    with serving_engine(smollm2, limits, MODEL) as s, httpx.Client(base_url=s.url, timeout=120) as c:
        yield c


def test_a_prompts_tokens_are_the_ones_a_completion_charges(client, smollm2):
    text = "The capital of France is"
    body = client.post("/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert body["tokens"] == smollm2.tokenizer.encode(text, add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) > 3
    assert body["max_model_len"] == client.get("/v1/models").json()["data"][0]["max_model_len"]
    usage = client.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == body["count"]


def test_chat_messages_are_rendered_as_the_chat_route_renders_them(client):
    body = client.post("/tokenize", json={"model": MODEL, "messages": FRANCE}).json()
    usage = client.post("/v1/chat/completions", json={"model": MODEL, "messages": FRANCE, "max_tokens": 1}).json()
    assert usage["usage"]["prompt_tokens"] == body["count"]
    without = client.post("/tokenize", json={"model": MODEL, "messages": FRANCE, "add_generation_prompt": False})
    assert without.json()["count"] < body["count"]  # the assistant turn's opening is left out


def test_detokenize_turns_tokens_back_into_their_text(client):
    text = "Paris is the capital of France."
    tokens = client.post("/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert client.post("/detokenize", json={"model": MODEL, "tokens": tokens}).json() == {"prompt": text}
    assert client.post("/detokenize", json={"model": MODEL, "tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path,payload,status,param", [
    ("/tokenize", {"model": MODEL, "prompt": "a", "messages": FRANCE}, 400, None),
    ("/tokenize", {"model": MODEL}, 400, None),
    ("/tokenize", {"model": MODEL, "prompt": "a", "truncate": 3}, 400, "truncate"),
    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
    ("/detokenize", {"model": MODEL, "tokens": [5, 10 ** 9]}, 400, "tokens[1]"),
    ("/detokenize", {"model": MODEL, "tokens": ["5"]}, 400, "tokens[0]"),
])
def test_bad_input_is_a_4xx_naming_the_field(client, path, payload, status, param):
    response = client.post(path, json=payload)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    assert error["message"]
