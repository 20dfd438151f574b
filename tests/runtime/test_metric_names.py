"""The worker's /metrics follows the Prometheus naming conventions, has no ``_created`` series and
shows every series whose labels are known in advance before the first event.

The exposition is the real one: a :class:`~graphserving.runtime.worker.Worker` over a tiny random
Llama on emulated graphs, scraped through its ASGI app. The linter is ``promtool check metrics``
when it is built (``python -m graphserving.dev.binaries promtool``), else the port of its rules in
tests/metric_lint.py.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

torch = pytest.importorskip("torch")

from metric_lint import lint, parse, promlint_problems, promtool, promtool_problems, silent_families  # noqa: E402

from graphserving.contract.report import Phase  # noqa: E402
from graphserving.contract.worker_config import EngineLimits, GraphConfig, ReadinessPolicy, WorkerConfig  # noqa: E402
from graphserving.dev.pytest_fixtures import wait_for  # noqa: E402
from graphserving.runtime.engine.metrics import EngineMetrics  # noqa: E402
from graphserving.runtime.graphs.key import FallbackReason  # noqa: E402
from graphserving.runtime.graphs.metrics import GraphMetrics  # noqa: E402
from graphserving.runtime.model.loader import load_model  # noqa: E402
from graphserving.runtime.worker import Worker  # noqa: E402

#: Families whose label values only events reveal: per graph key (known from its capture on), the
#: duration of a phase that has run.
EVENT_LABELLED = ["graphserving_graph_capture_seconds", "graphserving_graph_online_canary_comparisons_total",
                  "graphserving_graph_online_canary_divergences_total", "graphserving_worker_phase_duration_seconds"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir("llama3_rope"), revision=None, dtype=torch.float32, device="cpu")


async def _serve_one_and_scrape(worker: Worker) -> str:
    transport = httpx.ASGITransport(app=worker.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://worker", timeout=300) as http:
        r = await http.post("/v1/completions", json={"model": "tiny", "prompt": [1000, 1001, 1002],
                                                     "max_tokens": 3, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return (await http.get("/metrics")).text


@pytest.fixture(scope="module")
def worker_metrics(tiny) -> tuple[str, int]:
    """The /metrics text of a Ready worker that served one completion, and its usable KV blocks."""
    config = WorkerConfig(
        model_name="tiny", model_path="tiny",
        engine=EngineLimits(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16),
        graphs=GraphConfig(capture_sizes=[1, 2], piecewise_capture_sizes=[16, 32],
                           readiness=ReadinessPolicy(min_coverage=0.5)),
    )
    worker = Worker(config, tiny, 0.1, environ={"GRAPHSERVING_EMULATE_GRAPHS": "1"})
    worker.start()
    try:
        wait_for(lambda: worker.server.serving, timeout=300, message="the worker to serve")
        return asyncio.run(_serve_one_and_scrape(worker)), worker.lifecycle.engine.block_manager.num_total_blocks
    finally:
        worker.shutdown()


@pytest.mark.slow
def test_the_worker_exposition_passes_the_linter(worker_metrics):
    text, _ = worker_metrics
    assert lint(text) == []


@pytest.mark.slow
def test_the_worker_exposition_has_no_created_series(worker_metrics):
    text, _ = worker_metrics
    assert [name for name in parse(text) if name.endswith("_created")] == []
    assert "_created" not in text


@pytest.mark.slow
def test_kv_cache_gauges_name_their_unit_and_do_not_end_in_total(worker_metrics):
    text, usable_blocks = worker_metrics
    families = parse(text)
    assert families["graphserving_kv_cache_capacity_blocks"].type == "gauge"
    assert 0 < usable_blocks < 64  # the null block, and the canary's reserve, are not usable
    assert families["graphserving_kv_cache_capacity_blocks"].samples == [
        ("graphserving_kv_cache_capacity_blocks", {"model_name": "tiny"}, float(usable_blocks))]
    assert families["graphserving_kv_cache_used_blocks"].samples == [
        ("graphserving_kv_cache_used_blocks", {"model_name": "tiny"}, 0.0)]
    assert "graphserving_kv_cache_blocks_total" not in families


@pytest.mark.slow
def test_graph_coverage_is_a_ratio(worker_metrics):
    (sample,) = parse(worker_metrics[0])["graphserving_graph_coverage_ratio"].samples
    assert sample == ("graphserving_graph_coverage_ratio", {"model_name": "tiny"}, 1.0)


def test_a_fresh_worker_registry_shows_every_known_series_at_zero():
    engine = EngineMetrics("tiny")
    GraphMetrics(engine.registry, "tiny")
    text = engine.render().decode()
    assert silent_families(text) == EVENT_LABELLED
    families = parse(text)
    requests = {s[1]["finish_reason"]: s[2] for s in families["graphserving_requests_total"].samples}
    assert requests == {"stop": 0.0, "length": 0.0, "abort": 0.0, "error": 0.0}
    eager = {s[1]["reason"]: s[2] for s in families["graphserving_graph_passes_total"].samples}
    assert eager == {reason.value: 0.0 for reason in FallbackReason}
    phases = {s[1]["phase"]: s[2] for s in families["graphserving_worker_phase"].samples}
    assert phases == {phase.value: 0.0 for phase in Phase}
    assert ("graphserving_time_to_first_token_seconds_count", {"model_name": "tiny"}, 0.0) in \
        families["graphserving_time_to_first_token_seconds"].samples


def test_a_captured_key_has_a_zero_replay_count_before_its_first_hit():
    engine = EngineMetrics("tiny")
    graphs = GraphMetrics(engine.registry, "tiny")
    graphs.observe_capture("full-t8-r8", ok=True, seconds=0.25)
    graphs.observe_capture("piecewise-t64", ok=False, seconds=0.0)
    value = engine.registry.get_sample_value
    assert value("graphserving_graph_passes_total",
                 {"model_name": "tiny", "mode": "full", "key": "full-t8-r8", "reason": ""}) == 0.0
    assert value("graphserving_graph_online_canary_comparisons_total", {"model_name": "tiny", "key": "full-t8-r8"}) == 0.0
    assert value("graphserving_graph_passes_total",
                 {"model_name": "tiny", "mode": "piecewise", "key": "piecewise-t64", "reason": ""}) is None
    assert value("graphserving_graph_capture_failures_total", {"model_name": "tiny"}) == 1.0


#: Names the linter refuses: a gauge ending in ``_total`` (the KV-cache gauge before its rename), a
#: counter without ``_total``, a non-base unit.
OLD_NAMES = "\n".join([
    "# HELP graphserving_kv_cache_blocks_total Usable KV-cache blocks.",
    "# TYPE graphserving_kv_cache_blocks_total gauge",
    'graphserving_kv_cache_blocks_total{model_name="tiny"} 63.0',
    "# HELP graphserving_requests Finished requests.",
    "# TYPE graphserving_requests counter",
    'graphserving_requests{finish_reason="stop"} 1.0',
    "# HELP graphserving_step_milliseconds Step time.",
    "# TYPE graphserving_step_milliseconds gauge",
    "graphserving_step_milliseconds 3.0",
    "",
])


def test_the_linter_port_rejects_the_old_names():
    assert {name: promlint_problems(family) for name, family in parse(OLD_NAMES).items()} == {
        "graphserving_kv_cache_blocks_total": ['non-counter metrics should not have "_total" suffix'],
        "graphserving_requests": ['counter metrics should have "_total" suffix'],
        "graphserving_step_milliseconds": ['use base unit "seconds" instead of "milliseconds"'],
    }


def test_the_linter_port_agrees_with_promtool():
    binary = promtool()
    if binary is None:
        pytest.skip("promtool is not built (python -m graphserving.dev.binaries promtool)")
    port = [f"{name} {problem}" for name, family in parse(OLD_NAMES).items() for problem in promlint_problems(family)]
    assert sorted(promtool_problems(OLD_NAMES, binary)) == sorted(port)
