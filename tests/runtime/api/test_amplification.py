"""Request amplification (issue 19, item 7) on a real uvicorn server over the real SmolLM2 engine:
one request may create at most ``max_seqs_per_request`` sequences (prompts x n), a full engine
answers 503 with ``Retry-After``, and a client that leaves takes every sequence of its request
with it, KV blocks included."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import httpx
import pytest

from graphserving.contract.worker_config import EngineLimits
from graphserving.runtime.engine.async_engine import AsyncLLMEngine
from graphserving.runtime.engine.metrics import EngineMetrics
from uvicorn_server import serving_engine

MODEL = "smollm2"
ABORTS = f'graphserving_requests_total{{finish_reason="abort",model_name="{MODEL}"}}'
LIMITS = EngineLimits(num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256)
LONG = {"max_tokens": 1000, "ignore_eos": True, "temperature": 0}


class Server:
    def __init__(self, base_url: str, engine: AsyncLLMEngine, metrics: EngineMetrics):
        self.base_url, self.engine, self.metrics = base_url, engine, metrics
        self.host, self.port = base_url.removeprefix("http://").split(":")

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout)

    def aborts(self) -> float:
        with self.client() as c:
            line = next((ln for ln in c.get("/metrics").text.splitlines() if ln.startswith(ABORTS)), None)
        return float(line.rsplit(" ", 1)[1]) if line else 0.0

    def wait_for(self, condition, deadline_s: float) -> float:
        """Poll ``condition()`` every 20 ms for up to ``deadline_s``; the seconds it took (or the deadline)."""
        t0 = time.monotonic()
        while not condition() and time.monotonic() - t0 < deadline_s:
            time.sleep(0.02)
        return time.monotonic() - t0

    def drained(self) -> bool:
        core = self.engine.engine
        return (not core.has_unfinished() and core.block_manager.num_used_blocks == 0
                and self.engine.num_outstanding_seqs == 0)


@contextlib.contextmanager
def serving(smollm2, **bounds):
    """A uvicorn server over a fresh engine (``bounds``: AsyncLLMEngine's admission bounds)."""
    with serving_engine(smollm2, LIMITS, MODEL, **bounds) as s:
        yield Server(s.url, s.async_engine, s.metrics)


@pytest.fixture(scope="module")
def server(smollm2):
    """The worker's default bounds over max_num_seqs 8: 128 sequences per request and in all."""
    with serving(smollm2) as s:
        yield s


def post_and_hang_up(server: Server, body: dict, until) -> None:
    """Send ``body`` to /v1/completions on a raw socket, wait (bounded) until ``until()`` holds,
    then close the connection without reading the answer (a non-streaming client that left)."""
    payload = json.dumps(body).encode()
    with socket.create_connection((server.host, int(server.port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
        server.wait_for(until, 60)
        assert until(), "the request was not admitted in time"


# -- the bound on one request ---------------------------------------------------------------------
def test_the_default_bounds_follow_the_engine_limits(server):
    assert server.engine.max_seqs_per_request == 128  # OpenAI's n bound, more than one batch of 8
    assert server.engine.max_queued_seqs == 128  # 16 batches of 8, never below one largest request


def test_a_3kb_body_of_500_prompts_times_n_128_is_a_400_naming_the_prompt_and_queues_nothing(server):
    body = {"model": MODEL, "prompt": ["Hi"] * 500, "n": 128}
    with server.client() as c:
        r = c.post("/v1/completions", json=body)
    assert len(json.dumps(body)) < 4000
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"], error["type"]) == ("prompt", "invalid_value", "invalid_request_error")
    assert "500 prompts x n=128 would create 64000 sequences" in error["message"]
    assert "at most 128 for one request" in error["message"]
    assert server.engine.engine.num_requests == 0
    assert server.engine.num_outstanding_seqs == 0


def test_token_id_prompts_count_as_prompts_too(server):
    body = {"model": MODEL, "prompt": [[1, 2]] * 65, "n": 2, "max_tokens": 1}
    with server.client() as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt"
    assert "65 prompts x n=2 would create 130 sequences" in r.json()["error"]["message"]


def test_a_request_at_the_bound_is_served_and_a_bad_one_does_not_stop_it(server):
    with server.client() as c:
        assert c.post("/v1/completions", json={"model": MODEL, "prompt": ["Hi"] * 129}).status_code == 400
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": ["Hi"] * 2, "n": 64, "max_tokens": 1,
                                            "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert sorted(ch["index"] for ch in r.json()["choices"]) == list(range(128))
    assert server.wait_for(server.drained, 10) < 10


def test_a_chat_n_above_a_configured_bound_is_a_400_naming_n(smollm2):
    with serving(smollm2, max_seqs_per_request=4, max_queued_seqs=8) as tight, tight.client() as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "n": 5, "max_tokens": 1,
                                                 "messages": [{"role": "user", "content": "Hi"}]})
        ok = c.post("/v1/chat/completions", json={"model": MODEL, "n": 4, "max_tokens": 1,
                                                  "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("n", "invalid_value")
    assert error["message"] == "n: 5 choices are more than the 4 sequences this server runs for one request"
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


# -- the bound on the worker's queue and aborts on disconnect -------------------------------------
def test_a_full_engine_answers_503_with_retry_after_and_a_leaving_client_frees_all_its_sequences(server):
    before = server.aborts()
    filler = {"model": MODEL, "prompt": ["Hi", "Yes", "No", "Maybe"], "n": 32, **LONG}  # 128 sequences
    with server.client() as c:
        with c.stream("POST", "/v1/completions", json={**filler, "stream": True}) as stream:
            next(line for line in stream.iter_lines() if line.startswith("data: "))
            assert server.engine.num_outstanding_seqs == 128
            r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1,
                                                     "messages": [{"role": "user", "content": "Hi"}]})
        took = server.wait_for(server.drained, 10)  # the stream is closed: the client left
        after = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "1"
    error = r.json()["error"]
    assert (error["code"], error["type"], error["param"]) == ("overloaded", "service_unavailable", None)
    assert "128 sequences are running or waiting, at most 128 may be, and the request needs 1 more" in error["message"]
    assert took < 10, "the sequences of the request that left were not all aborted within 10 s"
    assert server.aborts() == before + 128
    assert server.engine.engine.block_manager.num_used_blocks == 0
    assert after.status_code == 200, after.text


def test_a_non_streaming_client_that_leaves_aborts_every_sequence_of_every_prompt(server):
    before = server.aborts()
    body = {"model": MODEL, "prompt": ["Hi", "Yes", "No"], "n": 8, **LONG}  # 24 sequences over 3 prompts
    core = server.engine.engine
    post_and_hang_up(server, body, until=lambda: server.engine.num_outstanding_seqs == 24
                     and core.scheduler.num_running == 8 and core.block_manager.num_used_blocks > 0)
    took = server.wait_for(server.drained, 10)
    assert took < 10, "the sequences of the request that left were not all aborted within 10 s"
    assert server.aborts() == before + 24
    assert (core.num_requests, core.scheduler.num_waiting, core.scheduler.num_running) == (0, 0, 0)
    assert core.block_manager.num_used_blocks == 0
