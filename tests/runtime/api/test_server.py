"""The OpenAI-compatible HTTP API on a real uvicorn server over the real SmolLM2 engine."""

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from graphserving.contract.report import Phase
from graphserving.contract.worker_config import EngineLimits
from graphserving.runtime.engine.core import LLMEngine
from graphserving.runtime.engine.metrics import EngineMetrics
from graphserving.runtime.api.app import ServerState, build_app
from graphserving.runtime.lifecycle.outcome import Readiness
from uvicorn_server import serving_engine

MODEL = "smollm2"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


class ServingLifecycle:
    """The part of the worker's lifecycle the lifecycle endpoints read (``/healthz``, ``/readyz``),
    over an engine this module builds itself: serving, with a readiness the tests flip. The report
    and recapture endpoints are tested on a real worker (tests/runtime/test_worker_http.py)."""

    def __init__(self):
        self.phase = Phase.READY
        self.readiness = Readiness()


class Server:
    def __init__(self, base_url: str, app, engine: LLMEngine):
        self.base_url, self.app, self.engine = base_url, app, engine

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout)

    def metric(self, line_prefix: str) -> float:
        with self.client() as c:
            for line in c.get("/metrics").text.splitlines():
                if line.startswith(line_prefix):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    def wait_idle(self, deadline_s: float = 120.0) -> None:
        """Wait (bounded) until the engine has nothing queued, waiting or running."""
        end = time.monotonic() + deadline_s
        while self.engine.has_unfinished() and time.monotonic() < end:
            time.sleep(0.05)


@pytest.fixture(scope="module")
def server(smollm2):
    limits = EngineLimits(num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256)
    lifecycle = ServingLifecycle()
    lifecycle.readiness.set_ready("eager")
    with serving_engine(smollm2, limits, MODEL, lifecycle=lifecycle) as s:
        yield Server(s.url, s.app, s.engine)


def sse_events(response: httpx.Response) -> list:
    """Parsed ``data:`` payloads of a server-sent-event stream (``"[DONE]"`` kept as a string)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def chat(messages=FRANCE, **fields) -> dict:
    return {"model": MODEL, "messages": messages, "temperature": 0, **fields}


# -- answers ----------------------------------------------------------------------------------
def test_chat_answers_the_capital_of_france_with_paris(server):
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=chat(max_tokens=24))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop"


def test_completion_usage_counts_prompt_and_generated_tokens(server, smollm2):
    prompt = "The three primary colours are"
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                                            "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    n_prompt = len(smollm2.tokenizer.encode(prompt, add_special_tokens=True))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 4, "total_tokens": n_prompt + 4}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["object"] == "text_completion"


def test_streamed_chat_carries_the_same_answer_as_non_streamed(server):
    with server.client() as c:
        plain = c.post("/v1/chat/completions", json=chat(max_tokens=12)).json()
        with c.stream("POST", "/v1/chat/completions",
                      json=chat(max_tokens=12, stream=True, stream_options={"include_usage": True})) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(e["object"] == "chat.completion.chunk" for e in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    finishes = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]]
    assert finishes[-1] == plain["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]


def test_streamed_completion_deltas_concatenate_to_the_full_text(server):
    req = {"model": MODEL, "prompt": "Counting: one, two,", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with server.client() as c:
        plain = c.post("/v1/completions", json=req).json()
        with c.stream("POST", "/v1/completions", json={**req, "stream": True}) as r:
            events = sse_events(r)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text == plain["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_a_streamed_stop_string_never_reaches_the_client(server):
    req = {"model": MODEL, "prompt": "Counting: one, two,", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with server.client() as c:
        free = c.post("/v1/completions", json=req).json()["choices"][0]["text"]
        stop = free[len(free) // 2 : len(free) // 2 + 4]
        with c.stream("POST", "/v1/completions", json={**req, "stop": [stop], "stream": True}) as r:
            events = sse_events(r)
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert streamed == free[: free.index(stop)]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["choices"][0]["stop_reason"] == stop


def test_streamed_choices_of_n_carry_their_index(server):
    req = chat(max_tokens=3, n=2, seed=5, temperature=1.0, stream=True)
    with server.client() as c, c.stream("POST", "/v1/chat/completions", json=req) as r:
        events = sse_events(r)
    indices = {e["choices"][0]["index"] for e in events[:-1]}
    assert indices == {0, 1}
    finished = [e["choices"][0]["index"] for e in events[:-1] if e["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]


def test_chat_logprobs_list_each_token_with_its_top_alternatives(server):
    with server.client() as c:
        body = c.post("/v1/chat/completions", json=chat(max_tokens=3, logprobs=True, top_logprobs=2)).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    for entry in content:
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])
        assert bytes(entry["bytes"]).decode("utf-8") == entry["token"]


def test_completion_logprobs_follow_the_legacy_shape(server):
    req = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    with server.client() as c:
        lp = c.post("/v1/completions", json=req).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 2
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    assert list(lp["top_logprobs"][0]) == [lp["tokens"][0]]


def test_n_seeded_choices_are_returned_with_their_indices(server):
    req = chat(max_tokens=4, n=2, seed=11, temperature=1.0)
    with server.client() as c:
        first = c.post("/v1/chat/completions", json=req).json()
        second = c.post("/v1/chat/completions", json=req).json()
    assert [ch["index"] for ch in first["choices"]] == [0, 1]
    assert [ch["message"]["content"] for ch in first["choices"]] == [ch["message"]["content"] for ch in second["choices"]]


# -- errors -----------------------------------------------------------------------------------
LONG = "word " * 2000


@pytest.mark.parametrize(
    "path,payload,status,param,code",
    [
        ("/v1/chat/completions", {"model": "gpt-4", "messages": FRANCE}, 404, "model", "model_not_found"),
        ("/v1/chat/completions", chat(temperature=-1), 400, "temperature", "invalid_value"),
        ("/v1/chat/completions", chat(top_p=0), 400, "top_p", "invalid_value"),
        ("/v1/chat/completions", chat(presence_penalty=3), 400, "presence_penalty", "invalid_value"),
        ("/v1/chat/completions", chat(n=0), 400, "n", "invalid_value"),
        ("/v1/chat/completions", chat(max_tokens=0), 400, "max_tokens", "invalid_value"),
        ("/v1/chat/completions", chat(top_logprobs=2), 400, "top_logprobs", "invalid_value"),
        ("/v1/chat/completions", chat(max_tokens=10**6), 400, "max_tokens", "context_length_exceeded"),
        ("/v1/chat/completions", chat(messages=[{"role": "robot", "content": "hi"}]), 400, "messages[0].role",
         "invalid_value"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages", "missing_field"),
        ("/v1/chat/completions", chat(messages=[{"role": "user", "content": LONG}]), 400, "messages",
         "context_length_exceeded"),
        ("/v1/completions", {"model": MODEL, "prompt": LONG}, 400, "prompt", "context_length_exceeded"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 6}, 400, "logprobs", "invalid_value"),
        ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, "prompt", "invalid_value"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_k": -5}, 400, "top_k", "invalid_value"),
        # strict types, as in the OpenAI API: no silent coercion of strings, floats or 0/1
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", "invalid_value"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5.0}, 400, "max_tokens", "invalid_value"),
        ("/v1/chat/completions", chat(stream=1), 400, "stream", "invalid_value"),
        ("/v1/chat/completions", chat(stop=[f"s{i}" for i in range(17)]), 400, "stop", "invalid_value"),
        ("/v1/chat/completions", chat(stop="x" * 257), 400, "stop", "invalid_value"),
        # a lone UTF-16 surrogate ("\ud800" in JSON) is no Unicode text: the tokenizer cannot take it
        ("/v1/completions", {"model": MODEL, "prompt": "a\ud800b"}, 400, "prompt", "invalid_value"),
        ("/v1/completions", {"model": MODEL, "prompt": ["ok", "a\udfffb"]}, 400, "prompt[1]", "invalid_value"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True, "stop": ["\ud800"]}, 400, "stop[0]",
         "invalid_value"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "suffix": "\udc00"}, 400, "suffix", "invalid_value"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a\ud800b"}]}, 400,
         "messages[0].content", "invalid_value"),
        ("/v1/chat/completions", {"model": MODEL, "stream": True,
                                  "messages": [{"role": "user", "content": [{"type": "text", "text": "x\ud800"}]}]},
         400, "messages[0].content", "invalid_value"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi", "name": "\udc00"}]},
         400, "messages[0]", "invalid_value"),
    ],
)
def test_bad_input_gets_an_openai_error_naming_the_field(server, path, payload, status, param, code):
    with server.client() as c:  # json.dumps escapes non-ASCII ("\ud800"), as clients send it
        r = c.post(path, content=json.dumps(payload), headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert error["code"] == code
    assert set(error) == {"message", "type", "param", "code"}
    assert param.split("[")[0] in error["message"]


def test_malformed_json_is_a_400_naming_the_body(server):
    with server.client() as c:
        r = c.post("/v1/chat/completions", content=b'{"model": "smollm2", "messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "body"
    assert error["code"] == "invalid_json"
    assert "Malformed JSON" in error["message"]


def test_bad_requests_do_not_affect_a_concurrent_good_one(server):
    good = chat(max_tokens=24)
    with ThreadPoolExecutor(4) as pool, server.client() as c:
        fut = pool.submit(c.post, "/v1/chat/completions", json=good)
        bad = [pool.submit(c.post, "/v1/chat/completions", json=chat(temperature=5)) for _ in range(3)]
        bad_status = [f.result().status_code for f in bad]
        r = fut.result()
    assert bad_status == [400, 400, 400]
    assert r.status_code == 200
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


# -- cancellation -----------------------------------------------------------------------------
ABORTS = f'graphserving_requests_total{{finish_reason="abort",model_name="{MODEL}"}}'


def test_a_streaming_client_that_disconnects_cancels_its_request(server):
    before = server.metric(ABORTS)
    req = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
           "stream": True}
    with server.client() as c, c.stream("POST", "/v1/completions", json=req) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # first token arrived; hang up
    server.wait_idle()
    assert not server.engine.has_unfinished()
    assert server.metric(ABORTS) == before + 1
    assert server.engine.block_manager.num_used_blocks == 0


def test_a_non_streaming_client_that_disconnects_cancels_its_request(server):
    before = server.metric(ABORTS)
    req = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    with server.client(timeout=2.0) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json=req)
    server.wait_idle()
    assert server.metric(ABORTS) == before + 1
    assert server.engine.block_manager.num_used_blocks == 0


# -- service routes ---------------------------------------------------------------------------
def test_completion_ids_are_prefixed_random_hex_and_distinct(server):
    ids = []
    for path, body, prefix in (("/v1/completions", {"prompt": "Hi"}, "cmpl"),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "chatcmpl")):
        for _ in range(2):
            with server.client() as c:
                r = c.post(path, json={"model": MODEL, "max_tokens": 1, **body})
            assert r.status_code == 200, r.text
            assert re.fullmatch(prefix + r"-[0-9a-f]{32}", r.json()["id"])
            ids.append(r.json()["id"])
    assert len(set(ids)) == 4


def test_a_forked_process_draws_other_completion_ids_than_its_parent():
    import os

    from graphserving.runtime.api.protocol import new_request_id

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: send its next id and leave at once
        try:
            os.write(write, new_request_id("cmpl").encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        child = pipe.read()
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", child)
    assert child != new_request_id("cmpl")


def test_models_lists_the_served_model(server):
    with server.client() as c:
        data = c.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL]
    assert data[0]["max_model_len"] == server.engine.max_model_len


def test_readyz_follows_the_readiness_flag_and_healthz_the_engine(server):
    lifecycle = server.app.state.server.lifecycle
    with server.client() as c:
        assert c.get("/healthz").status_code == 200
        lifecycle.phase = Phase.RECAPTURING
        lifecycle.readiness.set_not_ready("capturing graphs")
        r = c.get("/readyz")
        assert (r.status_code, r.json()) == (503, {"ready": False, "phase": "Recapturing", "reason": "capturing graphs"})
        lifecycle.phase = Phase.READY
        lifecycle.readiness.set_ready("eager")
        assert c.get("/readyz").status_code == 200


def test_metrics_are_served_in_the_prometheus_text_format(server):
    with server.client() as c:
        c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0,
                                        "ignore_eos": True})
        r = c.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("graphserving_requests_total", "graphserving_time_to_first_token_seconds_bucket",
                 "graphserving_time_per_output_token_seconds_bucket", "graphserving_e2e_request_latency_seconds_bucket",
                 "graphserving_requests_running", "graphserving_requests_waiting", "graphserving_kv_cache_used_blocks",
                 "graphserving_kv_cache_capacity_blocks", "graphserving_batch_size_bucket", "graphserving_iteration_seconds_bucket",
                 "graphserving_prompt_tokens_total", "graphserving_generation_tokens_total"):
        assert f"\n{name}" in text, name
    assert server.metric(f'graphserving_kv_cache_capacity_blocks{{model_name="{MODEL}"}}') == 63.0


def test_an_oversized_body_gets_a_413_before_it_is_read_and_the_server_keeps_serving(server):
    from graphserving.runtime.api.asgi import MAX_BODY_BYTES

    body = b'{"model": "' + b"x" * (MAX_BODY_BYTES + 1) + b'"}'
    with server.client() as c:
        r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"
        assert "Paris" in c.post("/v1/chat/completions", json=chat()).json()["choices"][0]["message"]["content"]


def test_a_chunked_body_is_limited_too_and_a_small_one_is_served(server):
    from graphserving.runtime.api.asgi import MAX_BODY_BYTES

    def chunks(total: int):
        yield b'{"model": "'
        for _ in range(total // 65536 + 1):
            yield b"x" * 65536
        yield b'"}'

    small = json.dumps({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3,
                        "temperature": 0.0}).encode()
    with server.client() as c:
        r = c.post("/v1/completions", content=chunks(MAX_BODY_BYTES), headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large"
        assert f"over {MAX_BODY_BYTES} bytes" in r.json()["error"]["message"]
        assert f"the limit is {MAX_BODY_BYTES}" in r.json()["error"]["message"]
        r = c.post("/v1/completions", content=iter([small[:10], small[10:]]), headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3


def test_the_direct_path_and_the_full_app_answer_alike(server):
    # application/json takes the direct path; application/x+json goes through FastAPI's router
    body = json.dumps({"model": MODEL, "prompt": "Counting: one, two,", "max_tokens": 4, "temperature": 0,
                       "ignore_eos": True})
    answers = []
    with server.client() as c:
        for content_type in ("application/json", "application/x+json"):
            r = c.post("/v1/completions", content=body, headers={"content-type": content_type})
            assert r.status_code == 200, r.text
            answers.append({k: v for k, v in r.json().items() if k not in ("id", "created")})
            assert r.headers["content-type"] == "application/json"
        bad = [c.post("/v1/completions", content=json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "5"}),
                      headers={"content-type": t}) for t in ("application/json", "application/x+json")]
    assert answers[0] == answers[1]
    assert answers[0]["usage"]["completion_tokens"] == 4
    assert [b.status_code for b in bad] == [400, 400] and bad[0].json() == bad[1].json()
    assert bad[0].json()["error"]["param"] == "max_tokens"


def test_a_repeated_content_type_is_read_as_the_full_app_reads_it(server):
    # Starlette reads the first of repeated headers: a text/plain body is no JSON body there, so
    # the direct path must not serve it as one because a later Content-Type says application/json
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1}).encode()
    with server.client() as c:
        plain_first = c.post("/v1/completions", content=body,
                             headers=[("content-type", "text/plain"), ("content-type", "application/json")])
        json_first = c.post("/v1/completions", content=body,
                            headers=[("content-type", "application/json"), ("content-type", "text/plain")])
    assert plain_first.status_code == 400, plain_first.text
    assert plain_first.json()["error"]["param"] == "body"
    assert json_first.status_code == 200, json_first.text
    assert json_first.json()["usage"]["completion_tokens"] == 1


def test_a_wrong_method_is_a_405_that_names_the_allowed_ones(server):
    with server.client() as c:
        r = c.get("/v1/chat/completions")
        lifecycle = c.post("/healthz")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert lifecycle.status_code == 405 and lifecycle.headers["allow"] == "GET"


async def test_before_the_engine_serves_only_the_lifecycle_endpoints_and_the_schema_answer():
    lifecycle = ServingLifecycle()
    lifecycle.phase = Phase.CAPTURING
    app = build_app(ServerState(MODEL, lifecycle, EngineMetrics(MODEL, 8, 256)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as http:
        schema = await http.get("/openapi.json")
        models = await http.get("/v1/models")
        ready = await http.get("/readyz")
    assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]
    assert models.status_code == 503 and models.json()["error"]["code"] == "not_ready"
    assert ready.status_code == 503 and ready.json()["phase"] == "Capturing"


def test_the_schema_declares_the_400_error_body_the_server_sends_and_no_422(server):
    from graphserving.runtime.api.protocol import ErrorBody

    with server.client() as c:
        schema = c.get("/openapi.json").json()
        bad = c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": "5"})
    responses = {(path, method): op["responses"] for path, ops in schema["paths"].items() for method, op in ops.items()}
    assert not [key for key, codes in responses.items() if "422" in codes]
    for path in ("/v1/completions", "/v1/chat/completions"):
        declared = responses[(path, "post")]["400"]["content"]["application/json"]["schema"]
        assert declared == {"$ref": "#/components/schemas/ErrorBody"}
    assert set(schema["components"]["schemas"]["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    assert bad.status_code == 400
    assert ErrorBody.model_validate(bad.json()).error.param == "max_tokens"
