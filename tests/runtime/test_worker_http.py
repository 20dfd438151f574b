"""The worker's HTTP front: readiness, the report, recapture, metrics, and drain on SIGTERM.

In-process tests run a :class:`~graphserving.runtime.worker.Worker` over a tiny random Llama on
emulated graphs and talk to its ASGI app; the slow tests start the real ``graphserving-worker``
command on SmolLM2 and talk to it over a loopback socket.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from graphserving.contract.report import Phase, WorkerReport, config_hash  # noqa: E402
from graphserving.contract.worker_config import (  # noqa: E402
    EngineLimits,
    GraphConfig,
    ReadinessPolicy,
    WorkerConfig,
)
from graphserving.dev.ports import free_port  # noqa: E402
from graphserving.dev.pytest_fixtures import wait_for  # noqa: E402
from graphserving.runtime.model.loader import load_model  # noqa: E402
from graphserving.runtime.api.access import served_by_headers  # noqa: E402
from graphserving.runtime.api.asgi import MAX_BODY_BYTES  # noqa: E402
from graphserving.runtime.worker import Worker  # noqa: E402

WORKER = [sys.executable, "-m", "graphserving.runtime.worker"]
BOUND_S = 300  # keeps a hang from stalling CI; a working worker is far quicker


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir("llama3_rope"), revision=None, dtype=torch.float32, device="cpu")


def tiny_config(**graphs) -> WorkerConfig:
    graphs.setdefault("capture_sizes", [1, 2, 4])
    graphs.setdefault("piecewise_capture_sizes", [16, 32, 64])
    graphs.setdefault("readiness", ReadinessPolicy(min_coverage=0.5))
    return WorkerConfig(
        model_name="tiny", model_path="tiny",
        engine=EngineLimits(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16),
        graphs=GraphConfig(**graphs),
    )


EMULATED = {"GRAPHSERVING_EMULATE_GRAPHS": "1"}


def started(worker: Worker) -> Worker:
    worker.start()
    wait_for(lambda: worker.server.serving, timeout=BOUND_S,
             message=lambda: f"the worker to serve (phase {worker.lifecycle.phase.value})")
    return worker


def client(worker: Worker) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=worker.app), base_url="http://worker", timeout=BOUND_S)


@pytest.fixture
def stop_workers():
    workers: list[Worker] = []
    yield workers.append
    for w in workers:
        w.shutdown()


# ---------------------------------------------------------------------- metrics helpers

def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a Prometheus text exposition as {(name, labels without model_name): value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            out[(s.name, labels)] = s.value
    return out


def value(metrics: dict, name: str, **labels) -> float | None:
    return metrics.get((name, frozenset(labels.items())))


# ---------------------------------------------------------------------- in-process worker

async def test_before_the_lifecycle_finishes_the_front_is_live_but_not_ready(tiny, stop_workers):
    worker = Worker(tiny_config(), tiny, 0.1, environ=EMULATED)
    stop_workers(worker)
    async with client(worker) as http:
        assert (await http.get("/healthz")).json() == {"alive": True, "phase": "Loading"}
        ready = await http.get("/readyz")
        assert ready.status_code == 503 and ready.json()["reason"] == "starting"
        completion = await http.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert completion.status_code == 503
        assert completion.json()["error"]["code"] == "not_ready"
        recapture = await http.post("/v1/graphs/recapture", json={"capture_sizes": [1, 4]})
        assert recapture.status_code == 409 and "start-up" in recapture.json()["error"]["message"]
        huge = await http.post("/v1/graphs/recapture", content=b"{" + b" " * MAX_BODY_BYTES + b"}",
                               headers={"content-type": "application/json"})
        assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
        report = WorkerReport.model_validate_json((await http.get("/v1/graphs")).content)
        assert report.phase is Phase.LOADING


async def test_readyz_waits_for_the_server_even_when_the_lifecycle_is_ready(tiny, stop_workers):
    worker = Worker(tiny_config(mode="NONE"), tiny, 0.1, environ={})
    stop_workers(worker)
    worker.lifecycle.run()  # the verdict, without starting the engine loop and the OpenAI app
    assert worker.lifecycle.readiness.ready
    async with client(worker) as http:
        ready = await http.get("/readyz")
        assert ready.status_code == 503
        assert ready.json() == {"ready": False, "phase": "Ready", "reason": "starting the server"}


async def test_every_response_names_the_pod_and_revision_that_served_it(tiny, stop_workers):
    environ = {"POD_NAME": "smollm2-5f7c9-abcde", "GRAPHSERVING_REVISION": "5f7c9d1e"}
    worker = Worker(tiny_config(mode="NONE"), tiny, 0.1, environ=environ)
    stop_workers(worker)
    async with client(worker) as http:
        for response in (await http.get("/healthz"), await http.post("/v1/completions", json={"prompt": "hi"})):
            assert response.headers["x-graphserving-pod"] == "smollm2-5f7c9-abcde"
            assert response.headers["x-graphserving-revision"] == "5f7c9d1e"


def test_served_by_headers_leave_out_missing_and_unprintable_values():
    assert served_by_headers("w-0", None) == ((b"x-graphserving-pod", b"w-0"),)
    assert served_by_headers(None, "r1") == ((b"x-graphserving-revision", b"r1"),)
    assert served_by_headers("bad name", "r\n1") == ()


async def test_ready_worker_serves_its_validated_report(tiny, stop_workers):
    worker = started(Worker(tiny_config(), tiny, 0.1, environ=EMULATED))
    stop_workers(worker)
    async with client(worker) as http:
        ready = await http.get("/readyz")
        assert ready.status_code == 200 and ready.json()["phase"] == "Ready"
        assert (await http.get("/healthz")).json() == {"alive": True, "phase": "Ready"}
        body = (await http.get("/v1/graphs")).text
        report = WorkerReport.from_annotation(body)
        assert report.phase is Phase.READY and report.coverage == 1.0
        assert report.graph_config_hash == config_hash(worker.config.graphs)
        assert json.loads(body)["schemaVersion"] == 1  # camelCase on the wire, as on the Pod


async def test_the_front_answers_its_own_routes_and_hands_every_other_path_to_the_openai_app(tiny, stop_workers):
    worker = started(Worker(tiny_config(), tiny, 0.1, environ=EMULATED))
    stop_workers(worker)
    async with client(worker) as http:
        assert (await http.get("/healthz")).json() == {"alive": True, "phase": "Ready"}  # the front's, not the app's
        models = await http.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
        missing = await http.get("/v1/nothing-here")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
        r = await http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


class _Node:
    pass


def _cycle() -> _Node:
    node = _Node()
    node.self = node  # only the cycle collector can free it
    return node


def test_freezing_start_up_objects_leaves_them_out_of_later_collections():
    import gc
    import weakref

    from graphserving.runtime.worker import freeze_startup_objects

    alive = _cycle()  # alive at start-up, garbage later: what a frozen object may become
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > 1000  # at least the imported modules' objects
        ref = weakref.ref(alive)
        del alive
        gc.collect()
        assert ref() is not None  # a full collection does not scan the permanent generation
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None  # unfrozen, the same collection frees it: the test above was not vacuous


def test_a_recapture_leaves_start_up_objects_frozen_and_a_first_capture_leaves_nothing_frozen():
    import gc
    import weakref

    from graphserving.runtime.graphs.backend import EmulatedGraphBackend
    from graphserving.runtime.worker import freeze_startup_objects

    backend = EmulatedGraphBackend()
    with backend.capture_session():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0  # start-up capture, before the worker freezes anything

    alive = _cycle()
    try:
        freeze_startup_objects()
        with backend.capture_session():  # an in-place recapture while serving
            pass
        assert gc.get_freeze_count() > 1000
        ref = weakref.ref(alive)
        del alive
        gc.collect()
        assert ref() is not None  # still in the permanent generation after the recapture
    finally:
        gc.unfreeze()
    gc.collect()
    assert ref() is None


async def test_a_scripted_load_shows_on_metrics_with_exact_values(tiny, stop_workers):
    # piecewise-t16 fails to capture: coverage 5/6 >= minCoverage 0.5, so the worker is Ready,
    # and a 10-token prefill (padded to 16) runs eagerly with reason not_captured.
    environ = {**EMULATED, "GRAPHSERVING_FAULT_INJECT_CAPTURE": "piecewise-t16"}
    worker = started(Worker(tiny_config(), tiny, 0.1, environ=environ))
    stop_workers(worker)
    assert worker.lifecycle.phase is Phase.READY
    async with client(worker) as http:
        for prompt_len, max_tokens in ((10, 5), (20, 3)):
            r = await http.post("/v1/completions", json={
                "model": "tiny", "prompt": list(range(1000, 1000 + prompt_len)), "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == max_tokens
        text = (await http.get("/metrics")).text
    m = samples(text)
    passes = "graphserving_graph_passes_total"
    # A: prefill 10 tokens (eager, not_captured), 4 single decodes (full-t1-r1);
    # B: prefill 20 tokens (piecewise-t32, 12 padded rows), 2 single decodes (full-t1-r1)
    assert {labels: v for (name, labels), v in m.items() if name == passes and v} == {
        frozenset({("mode", "eager"), ("key", ""), ("reason", "not_captured")}): 1.0,
        frozenset({("mode", "piecewise"), ("key", "piecewise-t32"), ("reason", "")}): 1.0,
        frozenset({("mode", "full"), ("key", "full-t1-r1"), ("reason", "")}): 6.0,
    }
    assert value(m, passes, mode="full", key="full-t4-r4", reason="") == 0  # captured, never hit
    assert value(m, passes, mode="eager", key="", reason="too_many_tokens") == 0
    assert value(m, "graphserving_graph_real_rows_total") == 20 + 6
    assert value(m, "graphserving_graph_padded_rows_total") == 12
    ratio = "graphserving_graph_padding_ratio"
    assert value(m, f"{ratio}_count") == 7
    assert value(m, f"{ratio}_sum") == pytest.approx(12 / 32)
    assert value(m, f"{ratio}_bucket", le="0.0") == 6
    assert value(m, f"{ratio}_bucket", le="0.3") == 6 and value(m, f"{ratio}_bucket", le="0.4") == 7
    # capture, memory, coverage, phase, capacity: as the report says
    report = worker.lifecycle.report()
    captured = {f"full-t{n}-r{n}" for n in (1, 2, 4)} | {"piecewise-t32", "piecewise-t64"}
    assert {dict(labels)["key"] for (name, labels) in m if name == "graphserving_graph_capture_seconds"} == captured
    assert all(v >= 0 for (name, _), v in m.items() if name == "graphserving_graph_capture_seconds")
    assert value(m, "graphserving_graph_capture_failures_total") == 1
    assert value(m, "graphserving_graph_memory_bytes", kind="estimate") == report.graph_memory.estimate_bytes
    assert value(m, "graphserving_graph_memory_bytes", kind="actual") == report.graph_memory.actual_bytes
    assert value(m, "graphserving_graph_coverage_ratio") == pytest.approx(5 / 6) == report.coverage
    assert value(m, "graphserving_graph_captured_keys", kind="full") == 3
    assert value(m, "graphserving_graph_captured_keys", kind="piecewise") == 2
    assert {dict(labels)["phase"]: v for (name, labels), v in m.items() if name == "graphserving_worker_phase"} == {
        p.value: (1.0 if p is Phase.READY else 0.0) for p in Phase}
    assert value(m, "graphserving_worker_degraded") == 0
    assert value(m, "graphserving_effective_capacity_tokens_per_second") > 0
    for phase in ("Warmup", "Profiling", "Capturing", "Canary"):
        assert value(m, "graphserving_worker_phase_duration_seconds", phase=phase) >= 0
    # the engine's own metrics
    assert value(m, "graphserving_requests_total", finish_reason="length") == 2
    assert value(m, "graphserving_prompt_tokens_total") == 30
    assert value(m, "graphserving_generation_tokens_total") == 8
    assert value(m, "graphserving_time_to_first_token_seconds_count") == 2
    assert value(m, "graphserving_time_per_output_token_seconds_count") == 2
    assert value(m, "graphserving_batch_size_count") == 8  # one pass per step: as many as graph passes
    assert value(m, "graphserving_batch_size_sum") == 8
    assert value(m, "graphserving_batch_tokens_sum") == 10 + 4 + 20 + 2


async def test_recapture_over_http_accepts_a_graph_config_and_changes_the_keys(tiny, stop_workers):
    worker = started(Worker(tiny_config(), tiny, 0.1, environ=EMULATED))
    stop_workers(worker)
    async with client(worker) as http:
        r = await http.post("/v1/graphs/recapture", json={
            "mode": "FULL_AND_PIECEWISE", "capture_sizes": [1, 3], "piecewise_capture_sizes": [32]})
        assert r.status_code == 200, r.text
        report = WorkerReport.from_annotation(r.text)
        assert [(m.kind, m.captured) for m in report.modes] == [("FULL", [1, 3, 4]), ("PIECEWISE", [32, 64])]
        assert report.phase is Phase.READY and Phase.RECAPTURING in [p.phase for p in report.phases]
        served = WorkerReport.from_annotation((await http.get("/v1/graphs")).text)
        assert served.generation > report.generation and served.modes == report.modes
        assert (await http.get("/readyz")).status_code == 200
        m = samples((await http.get("/metrics")).text)
    # the capture gauges describe the graphs that exist now, not the ones recaptured away
    assert {dict(labels)["key"] for (name, labels) in m if name == "graphserving_graph_capture_seconds"} == {
        "full-t1-r1", "full-t3-r3", "full-t4-r4", "piecewise-t32", "piecewise-t64"}
    assert value(m, "graphserving_graph_captured_keys", kind="full") == 3
    assert value(m, "graphserving_graph_captured_keys", kind="piecewise") == 2
    assert value(m, "graphserving_worker_phase", phase="Ready") == 1
    assert value(m, "graphserving_worker_phase", phase="Recapturing") == 0
    assert value(m, "graphserving_worker_phase_duration_seconds", phase="Recapturing") >= 0


async def test_recapture_over_http_accepts_a_recapture_request(tiny, stop_workers):
    worker = started(Worker(tiny_config(), tiny, 0.1, environ=EMULATED))
    stop_workers(worker)
    graphs = GraphConfig(mode="FULL", capture_sizes=[2])
    async with client(worker) as http:
        r = await http.post("/v1/graphs/recapture", json={
            "graphConfigHash": config_hash(graphs), "graphs": graphs.model_dump(mode="json")})
        assert r.status_code == 200, r.text
        report = WorkerReport.from_annotation(r.text)
        assert report.graph_config_hash == config_hash(graphs)
        assert [(m.kind, m.captured) for m in report.modes] == [("FULL", [2, 4])]
        m = samples((await http.get("/metrics")).text)
    assert value(m, "graphserving_graph_captured_keys", kind="full") == 2
    assert value(m, "graphserving_graph_captured_keys", kind="piecewise") == 0


async def test_recapture_rejects_bad_bodies_naming_the_field_and_keeps_the_graphs(tiny, stop_workers):
    worker = started(Worker(tiny_config(), tiny, 0.1, environ=EMULATED))
    stop_workers(worker)
    before = worker.lifecycle.report().graph_config_hash
    async with client(worker) as http:
        not_json = await http.post("/v1/graphs/recapture", content=b"{nope")
        assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_json"
        unknown = await http.post("/v1/graphs/recapture", json={"capture_size": [1]})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "capture_size"
        wrong_type = await http.post("/v1/graphs/recapture", json={"capture_sizes": "many"})
        assert wrong_type.status_code == 400 and wrong_type.json()["error"]["param"] == "capture_sizes"
        too_big = await http.post("/v1/graphs/recapture", json={"capture_sizes": [1, 8]})
        assert too_big.status_code == 400
        assert "max_num_seqs=4" in too_big.json()["error"]["message"]
        assert (await http.get("/readyz")).status_code == 200
    assert worker.lifecycle.report().graph_config_hash == before


async def test_draining_turns_readyz_503_with_the_reason(tiny, stop_workers):
    worker = started(Worker(tiny_config(mode="NONE"), tiny, 0.1, environ={}))
    stop_workers(worker)
    async with client(worker) as http:
        assert (await http.get("/readyz")).status_code == 200
        worker.drain()
        ready = await http.get("/readyz")
        assert ready.status_code == 503
        assert ready.json() == {"ready": False, "phase": "Draining", "reason": "draining"}
        # requests already admitted (and new ones reaching this process) are still served
        r = await http.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2,
                                                     "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


async def test_a_partial_recapture_body_keeps_the_other_graph_settings(tiny, stop_workers):
    config = tiny_config(readiness=ReadinessPolicy(min_coverage=0.5, allow_degraded=True))
    worker = started(Worker(config, tiny, 0.1, environ=EMULATED))
    stop_workers(worker)
    async with client(worker) as http:
        r = await http.post("/v1/graphs/recapture", json={"capture_sizes": [2, 4]})
        assert r.status_code == 200, r.text
    graphs = worker.lifecycle.config.graphs
    assert graphs.capture_sizes == [2, 4]
    assert graphs.readiness.allow_degraded and graphs.piecewise_capture_sizes == [16, 32, 64]


async def test_recapture_refuses_hostile_bodies_and_a_draining_worker(tiny, stop_workers):
    worker = started(Worker(tiny_config(), tiny, 0.1, environ=EMULATED))
    stop_workers(worker)
    async with client(worker) as http:
        nested = await http.post("/v1/graphs/recapture", content=b"[" * 5000 + b"]" * 5000,
                                 headers={"content-type": "application/json"})
        assert nested.status_code == 400
        not_object = await http.post("/v1/graphs/recapture", json=[1, 2])
        assert not_object.status_code == 400 and "JSON object" in not_object.json()["error"]["message"]
        piecewise = await http.post("/v1/graphs/recapture", json={"piecewise_capture_sizes": [16, 128]})
        assert piecewise.status_code == 400 and piecewise.json()["error"]["param"] == "piecewise_capture_sizes"
        worker.drain()
        refused = await http.post("/v1/graphs/recapture", json={"capture_sizes": [1, 4]})
        assert refused.status_code == 409 and "draining" in refused.json()["error"]["message"]
        assert (await http.get("/readyz")).status_code == 503


# ---------------------------------------------------------------------- the real command

class WorkerProcess:
    """``graphserving-worker`` on a free loopback port; its output goes to a log file."""

    def __init__(self, log: Path, *args: str, env: dict | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._out = open(log, "w")
        self.proc = subprocess.Popen([*WORKER, "--port", str(self.port), *args], stdout=self._out,
                                     stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def wait_ready(self) -> None:
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"the worker exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                return httpx.get(f"{self.base}/readyz", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        try:
            wait_for(ready, timeout=BOUND_S, interval=0.5, message="the worker to be ready")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{self.log.read_text()[-3000:]}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


def smollm2_args(path: Path, *extra: str) -> list[str]:
    return ["--model", str(path), "--max-model-len", "512", "--num-kv-blocks", "128", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "64", "--log-level", "info", *extra]


@pytest.mark.slow
def test_recapture_under_a_steady_load_loses_no_request_and_changes_the_keys(smollm2_path, tmp_path):
    worker = WorkerProcess(tmp_path / "worker.log", *smollm2_args(
        smollm2_path, "--capture-sizes", "1,2,4", "--piecewise-capture-sizes", "32,64", "--allow-degraded"),
        env=EMULATED)
    try:
        worker.wait_ready()
        before = WorkerReport.from_annotation(httpx.get(f"{worker.base}/v1/graphs", timeout=30).text)
        assert before.phase is Phase.READY
        assert [(m.kind, m.captured) for m in before.modes] == [("FULL", [1, 2, 4]), ("PIECEWISE", [32, 64])]

        results: list[tuple[float, float, int, dict]] = []  # (start, end, status, body)
        stop = threading.Event()
        lock = threading.Lock()

        def client_loop(i: int) -> None:
            with httpx.Client(base_url=worker.base, timeout=BOUND_S) as http:
                for n in range(40):
                    if stop.is_set():
                        return
                    start = time.monotonic()
                    r = http.post("/v1/completions", json={
                        "model": smollm2_path.stem, "prompt": f"Story {i}.{n}: once upon a time",
                        "max_tokens": 6, "temperature": 0, "ignore_eos": True})
                    with lock:
                        results.append((start, time.monotonic(), r.status_code, r.json()))

        clients = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(3)]
        for c in clients:
            c.start()
        wait_for(lambda: len(results) >= 3, timeout=BOUND_S, message="requests before the recapture")
        begin = time.monotonic()
        r = httpx.post(f"{worker.base}/v1/graphs/recapture", timeout=BOUND_S, json={
            "mode": "FULL_AND_PIECEWISE", "capture_sizes": [1, 3], "piecewise_capture_sizes": [16, 64],
            "readiness": {"allow_degraded": True}})
        end = time.monotonic()
        assert r.status_code == 200, r.text
        done_at_recapture = len(results)
        wait_for(lambda: len(results) >= done_at_recapture + 3, timeout=BOUND_S, message="requests after")
        stop.set()
        for c in clients:
            c.join(BOUND_S)

        failed = [(status, body) for _, _, status, body in results if status != 200]
        assert failed == []
        assert all(body["usage"]["completion_tokens"] == 6 for *_, body in results)
        # the load was steady: some requests were in flight while the graphs were recaptured
        assert any(start < end and stop_ > begin for start, stop_, _, _ in results)
        after = WorkerReport.from_annotation(httpx.get(f"{worker.base}/v1/graphs", timeout=30).text)
        assert [(m.kind, m.captured) for m in after.modes] == [("FULL", [1, 3, 4]), ("PIECEWISE", [16, 64])]
        assert after.phase is Phase.READY and after.generation > before.generation
        assert after.worker.instance == before.worker.instance  # same process: nothing was reloaded
        assert Phase.RECAPTURING in [p.phase for p in after.phases]
        assert httpx.get(f"{worker.base}/readyz", timeout=30).status_code == 200
    finally:
        worker.stop()


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_and_exits_0(smollm2_path, tmp_path):
    worker = WorkerProcess(tmp_path / "worker.log", *smollm2_args(smollm2_path, "--graph-mode", "NONE",
                                                                   "--drain-seconds", "120"))
    try:
        worker.wait_ready()
        first_chunk = threading.Event()
        streamed: dict = {"text": "", "finish": None, "usage": None, "error": None}
        plain: dict = {}

        def stream() -> None:
            try:
                with httpx.stream("POST", f"{worker.base}/v1/completions", timeout=BOUND_S, json={
                    "model": smollm2_path.stem, "prompt": "Tell me a long story:", "max_tokens": 48,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line.removeprefix("data: "))
                        if chunk.get("usage"):
                            streamed["usage"] = chunk["usage"]
                        for choice in chunk["choices"]:
                            streamed["text"] += choice.get("text") or ""
                            streamed["finish"] = choice.get("finish_reason") or streamed["finish"]
                        first_chunk.set()
            except Exception as exc:  # reported by the assertions below
                streamed["error"] = repr(exc)
                first_chunk.set()

        def non_streaming() -> None:
            r = httpx.post(f"{worker.base}/v1/completions", timeout=BOUND_S, json={
                "model": smollm2_path.stem, "prompt": "Count to twenty:", "max_tokens": 32, "temperature": 0,
                "ignore_eos": True})
            plain.update(status=r.status_code, body=r.json())

        threads = [threading.Thread(target=stream, daemon=True), threading.Thread(target=non_streaming, daemon=True)]
        for t in threads:
            t.start()
        assert first_chunk.wait(BOUND_S)
        worker.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(BOUND_S)

        assert streamed["error"] is None
        assert streamed["finish"] == "length"
        assert streamed["usage"]["completion_tokens"] == 48 and streamed["text"]
        assert plain["status"] == 200 and plain["body"]["usage"]["completion_tokens"] == 32
        assert plain["body"]["choices"][0]["finish_reason"] == "length"
        # no new request is admitted once draining started
        try:
            refused = httpx.get(f"{worker.base}/readyz", timeout=5)
            assert refused.status_code == 503 and refused.json()["reason"] == "draining"
        except httpx.TransportError:
            pass  # the listener is already closed
        assert worker.proc.wait(BOUND_S) == 0, worker.log.read_text()[-3000:]
    finally:
        worker.stop()


@pytest.mark.slow
def test_after_sigterm_new_requests_are_served_for_the_shutdown_delay_with_readyz_failing(smollm2_path, tmp_path):
    delay = 4.0
    worker = WorkerProcess(tmp_path / "worker.log", *smollm2_args(smollm2_path, "--graph-mode", "NONE",
                                                                   "--shutdown-delay-seconds", str(delay)))
    try:
        worker.wait_ready()
        signalled = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)
        # the gateway has not seen the endpoint change yet: what it still sends here is answered
        readyz = wait_for(lambda: (r := httpx.get(f"{worker.base}/readyz", timeout=5)).status_code == 503 and r,
                          timeout=delay, interval=0.05, message="/readyz failing after SIGTERM")
        assert readyz.json()["reason"] == "draining"
        answered = httpx.post(f"{worker.base}/v1/completions", timeout=BOUND_S, json={
            "model": smollm2_path.stem, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert answered.status_code == 200 and time.monotonic() - signalled < delay
        assert worker.proc.wait(BOUND_S) == 0, worker.log.read_text()[-3000:]
        assert time.monotonic() - signalled >= delay  # the listener stayed open the whole delay
    finally:
        worker.stop()


@pytest.mark.parametrize("flag", ["--shutdown-delay-seconds", "--drain-seconds"])
def test_a_negative_or_infinite_shutdown_time_is_refused_naming_the_flag(flag, capsys):
    from graphserving.runtime.worker import build_parser

    for bad in ("-1", "inf", "soon"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--model", "x", flag, bad])
        assert flag in capsys.readouterr().err
