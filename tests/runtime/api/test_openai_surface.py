"""The OpenAI-compatible surface beyond answers: unknown fields, vLLM's extra parameters, aborts,
the stream interval, the API key, X-Request-Id, the access log, /health and /version.

Real uvicorn servers over the real SmolLM2 engine; the ``openai`` SDK is one of the clients.
"""

import contextlib
import importlib.metadata
import json
import logging
import re
import threading
import time

import httpx
import pytest

from graphserving.contract.worker_config import EngineLimits
from graphserving.runtime.engine.async_engine import AsyncLLMEngine
from graphserving.runtime.engine.core import LLMEngine
from uvicorn_server import serving_engine

MODEL = "smollm2"
KEY = "sk-test-0123456789"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


class Server:
    def __init__(self, base_url: str, engine: LLMEngine, async_engine: AsyncLLMEngine):
        self.base_url, self.engine, self.async_engine = base_url, engine, async_engine

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=120.0, **kwargs)

    def wait_idle(self, deadline_s: float = 120.0) -> None:
        end = time.monotonic() + deadline_s
        while self.engine.has_unfinished() and time.monotonic() < end:
            time.sleep(0.02)

    def wait_running(self, deadline_s: float = 60.0) -> None:
        end = time.monotonic() + deadline_s
        while self.engine.scheduler.num_running == 0 and time.monotonic() < end:
            time.sleep(0.005)
        assert self.engine.scheduler.num_running > 0, "no request started running"


@contextlib.contextmanager
def serving(smollm2, *, api_key: str | None = None):
    limits = EngineLimits(num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256)
    assert limits.num_scheduler_steps == 8  # multi-step runs: the stream interval splits their bursts
    with serving_engine(smollm2, limits, MODEL, api_key=api_key) as s:
        yield Server(s.url, s.engine, s.async_engine)


@pytest.fixture(scope="module")
def server(smollm2):
    with serving(smollm2) as s:
        yield s


@pytest.fixture(scope="module")
def keyed(smollm2):
    with serving(smollm2, api_key=KEY) as s:
        yield s


def chat(messages=FRANCE, **fields) -> dict:
    return {"model": MODEL, "messages": messages, "temperature": 0, **fields}


def completion(prompt="The capital of France is", **fields) -> dict:
    return {"model": MODEL, "prompt": prompt, "temperature": 0, **fields}


def parsed(lines) -> list:
    """The ``data:`` payloads of server-sent-event lines (``"[DONE]"`` kept as a string)."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def sse_events(response: httpx.Response) -> list:
    return parsed(response.iter_lines())


# -- unknown and unsupported fields -------------------------------------------------------------
@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/chat/completions", chat(guided_decoding_backend="xgrammar"), "guided_decoding_backend"),
    ("/v1/chat/completions", chat(chat_template="{{ messages }}"), "chat_template"),
    ("/v1/chat/completions", chat(continue_final_message=True), "continue_final_message"),
    ("/v1/completions", completion(priority=1), "priority"),
    ("/v1/completions", completion(stream=True, stream_options={"continuous_usage_stats": True}),
     "stream_options.continuous_usage_stats"),
    ("/v1/completions", completion(store=True), "store"),
])
def test_an_unsupported_field_is_a_400_naming_it(server, path, body, field):
    with server.client() as c:
        r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field
    assert error["type"] == "invalid_request_error"
    if field != "store":  # store is declared (false only): a value error, not an unknown field
        assert error["code"] == "unsupported_parameter"
        assert error["message"].startswith(f"{field}: this server does not support the parameter")


def test_fields_without_effect_are_accepted(server):
    body = chat(max_tokens=4, user="u-1", safety_identifier="s", prompt_cache_key="k",
                metadata={"team": "a"}, store=False)
    with server.client() as c:
        with_them, without = c.post("/v1/chat/completions", json=body), c.post("/v1/chat/completions", json=chat(max_tokens=4))
    assert with_them.status_code == 200, with_them.text
    assert with_them.json()["choices"][0]["message"] == without.json()["choices"][0]["message"]


# -- vLLM's extra parameters ----------------------------------------------------------------------
def test_include_stop_str_in_output_keeps_the_stop_string(server):
    with server.client() as c:
        plain = c.post("/v1/completions", json=completion(max_tokens=12, ignore_eos=True)).json()["choices"][0]["text"]
        stop = plain[4:7]
        cut = c.post("/v1/completions", json=completion(max_tokens=12, stop=[stop])).json()["choices"][0]
        kept = c.post("/v1/completions", json=completion(max_tokens=12, stop=[stop],
                                                         include_stop_str_in_output=True)).json()["choices"][0]
    end = plain.find(stop)
    assert cut["text"] == plain[:end] and cut["finish_reason"] == "stop"
    assert kept["text"] == plain[:end + len(stop)] and kept["stop_reason"] == stop


def test_skip_special_tokens_false_keeps_special_tokens_in_the_text(server):
    body = chat(max_tokens=24, ignore_eos=True, logprobs=True)
    with server.client() as c:
        skipped = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        shown = c.post("/v1/chat/completions", json={**body, "skip_special_tokens": False}).json()["choices"][0]
    assert "<|im_end|>" in [t["token"] for t in skipped["logprobs"]["content"]]  # the model did end its answer
    assert "<|im_end|>" not in skipped["message"]["content"]
    assert "<|im_end|>" in shown["message"]["content"]
    assert shown["message"]["content"].replace("<|im_end|>", "").startswith(skipped["message"]["content"][:10])


def test_add_generation_prompt_false_leaves_the_assistant_header_out(server, smollm2):
    tok = smollm2.tokenizer
    header = len(tok.encode(tok.apply_chat_template(FRANCE, add_generation_prompt=True))) - \
        len(tok.encode(tok.apply_chat_template(FRANCE, add_generation_prompt=False)))
    with server.client() as c:
        with_header = c.post("/v1/chat/completions", json=chat(max_tokens=1)).json()["usage"]["prompt_tokens"]
        without = c.post("/v1/chat/completions",
                         json=chat(max_tokens=1, add_generation_prompt=False)).json()["usage"]["prompt_tokens"]
    assert header > 0
    assert with_header - without == header


# -- aborts ---------------------------------------------------------------------------------------
def test_a_stream_aborted_by_the_server_ends_with_finish_reason_abort(server):
    with server.client() as c, c.stream("POST", "/v1/completions",
                                        json=completion(max_tokens=400, ignore_eos=True, stream=True)) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        server.async_engine.abort_all("the test's drain deadline")
        events = parsed([first, *lines])
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])
    server.wait_idle()


def test_a_non_streaming_request_aborted_by_the_server_answers_finish_reason_abort(server):
    result = {}

    def post():
        with server.client() as c:
            result["r"] = c.post("/v1/chat/completions", json=chat(max_tokens=400, ignore_eos=True))

    thread = threading.Thread(target=post)
    thread.start()
    server.wait_running()
    server.async_engine.abort_all("the test's drain deadline")
    thread.join(60)
    body = result["r"].json()
    assert result["r"].status_code == 200, body
    assert body["choices"][0]["finish_reason"] == "abort"
    assert 0 < body["usage"]["completion_tokens"] < 400


def test_an_engine_failure_ends_the_stream_with_abort_then_the_error(server):
    with server.client() as c, c.stream("POST", "/v1/chat/completions",
                                        json=chat(max_tokens=400, ignore_eos=True, stream=True)) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        server.async_engine.call_in_loop(lambda: server.engine.fail_all(RuntimeError("injected failure"))).result(30)
        events = parsed(lines)
    assert events[-1] == "[DONE]"
    assert "injected failure" in events[-2]["error"]["message"]
    assert events[-3]["choices"][0]["finish_reason"] == "abort"


def test_the_openai_sdk_hands_finish_reason_abort_to_the_caller(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    stream = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=400, stream=True,
                                            temperature=0, extra_body={"ignore_eos": True})
    reasons = []
    for i, chunk in enumerate(stream):
        if i == 1:
            server.async_engine.abort_all("the test's drain deadline")
        reasons += [ch.finish_reason for ch in chunk.choices]
    assert reasons[-1] == "abort"
    server.wait_idle()


def test_a_client_disconnect_is_logged_with_its_request_id(server, caplog):
    caplog.set_level(logging.INFO, logger="graphserving.runtime.engine.core")
    with server.client() as c, c.stream("POST", "/v1/completions", headers={"X-Request-Id": "gone-1"},
                                        json=completion(max_tokens=400, ignore_eos=True, stream=True)) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    server.wait_idle()
    aborts = [m for m in caplog.messages if " aborted (" in m]
    assert any("aborted (the client disconnected; X-Request-Id gone-1)" in m for m in aborts), aborts


# -- stream interval ------------------------------------------------------------------------------
def test_a_multi_step_run_streams_one_token_per_chunk(server):
    with server.client() as c, c.stream("POST", "/v1/completions",
                                        json=completion(max_tokens=24, ignore_eos=True, stream=True, logprobs=0)) as r:
        chunks = [e for e in sse_events(r) if e != "[DONE]"]
    assert [len(e["choices"][0]["logprobs"]["tokens"]) for e in chunks] == [1] * 24


def test_a_multi_step_run_streams_one_chunk_per_token_without_logprobs(server):
    with server.client() as c, c.stream("POST", "/v1/chat/completions",
                                        json=chat(max_tokens=24, ignore_eos=True, stream=True)) as r:
        chunks = [e for e in sse_events(r) if e != "[DONE]"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(chunks) == 1 + 24 and chunks[-1]["choices"][0]["finish_reason"] == "length"


# -- API key --------------------------------------------------------------------------------------
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_the_api_needs_the_key(keyed, headers):
    with keyed.client(headers=headers) as c:
        answers = [c.post("/v1/chat/completions", json=chat(max_tokens=1)), c.get("/v1/models"),
                   c.post("/v1/graphs/recapture", json={})]
    for r in answers:
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert r.headers["www-authenticate"] == "Bearer"


def test_the_right_key_is_let_in(keyed):
    with keyed.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        r = c.post("/v1/chat/completions", json=chat(max_tokens=2))
        models = c.get("/v1/models")
    assert r.status_code == 200, r.text
    assert models.json()["data"][0]["id"] == MODEL


def test_probes_and_metrics_need_no_key(keyed):
    with keyed.client() as c:
        answers = {path: c.get(path).status_code for path in ("/healthz", "/readyz", "/health", "/version", "/metrics")}
    assert answers == {"/healthz": 200, "/readyz": 200, "/health": 200, "/version": 200, "/metrics": 200}


def test_the_openai_sdk_authenticates_with_the_key(keyed):
    openai = pytest.importorskip("openai")
    good = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key=KEY, max_retries=0)
    answer = good.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=2, temperature=0)
    assert answer.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.base_url + "/v1", api_key="wrong", max_retries=0).models.list()


# -- request id, access log, /health, /version ----------------------------------------------------
def test_x_request_id_is_echoed(server):
    with server.client() as c:
        given = c.post("/v1/chat/completions", json=chat(max_tokens=1), headers={"X-Request-Id": "trace-42"})
        generated = c.get("/healthz")
    assert given.headers["x-request-id"] == "trace-42"
    assert re.fullmatch(r"[0-9a-f]{32}", generated.headers["x-request-id"])


def test_an_invalid_x_request_id_is_a_400_naming_the_header(server):
    with server.client() as c:
        r = c.get("/v1/models", headers={"X-Request-Id": "has space"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "X-Request-Id"


def test_every_request_gets_one_access_log_line(server, caplog):
    caplog.set_level(logging.INFO, logger="graphserving.access")
    with server.client() as c:
        c.post("/v1/chat/completions", json=chat(max_tokens=1), headers={"X-Request-Id": "log-1"})
        c.get("/v1/nowhere", headers={"X-Request-Id": "log-2"})
    # (a line of the previous test's last request may land here: it is written after its response)
    lines = [r.getMessage() for r in caplog.records
             if r.name == "graphserving.access" and re.search(r"request_id=log-\d$", r.getMessage())]
    assert len(lines) == 2
    assert re.fullmatch(r"POST /v1/chat/completions 200 \d+\.\dms request_id=log-1", lines[0])
    assert re.fullmatch(r"GET /v1/nowhere 404 \d+\.\dms request_id=log-2", lines[1])


def test_health_and_version(server):
    with server.client() as c:
        health, version = c.get("/health"), c.get("/version")
    assert health.status_code == 200 and health.json() == {"alive": True, "phase": "Ready"}
    assert version.json() == {"version": importlib.metadata.version("graphserving")}


def test_the_worker_takes_the_key_from_the_flag_or_the_environment():
    from graphserving.runtime.worker import StartupError, build_parser, resolve_api_key

    parse = build_parser().parse_args
    assert resolve_api_key(parse(["--api-key", "flag-key"]), {"GRAPHSERVING_API_KEY": "env-key"}) == "flag-key"
    assert resolve_api_key(parse([]), {"GRAPHSERVING_API_KEY": "env-key"}) == "env-key"
    assert resolve_api_key(parse([]), {"GRAPHSERVING_API_KEY": ""}) is None
    assert resolve_api_key(parse([]), {}) is None
    with pytest.raises(StartupError, match="GRAPHSERVING_API_KEY: the API key must be visible ASCII"):
        resolve_api_key(parse([]), {"GRAPHSERVING_API_KEY": "two words"})
    assert parse(["--stream-interval", "4"]).stream_interval == 4
    with pytest.raises(SystemExit):
        parse(["--stream-interval", "0"])
