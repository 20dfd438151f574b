"""The worker's /metrics follows the Prometheus naming conventions, has no ``_created`` series and
shows every series whose labels are known in advance before the first event. The one exception to
the conventions is the router protocol's names (``ROUTER_ALIASES``, vLLM's), whose colons promtool
flags and nothing else.

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
from graphserving.runtime.engine.metrics import ROUTER_ALIASES, EngineMetrics  # noqa: E402
from graphserving.runtime.graphs.key import FallbackReason  # noqa: E402
from graphserving.runtime.graphs.metrics import GraphMetrics  # noqa: E402
from graphserving.runtime.model.loader import load_model  # noqa: E402
from graphserving.runtime.worker import Worker  # noqa: E402

#: Families whose label values only events reveal: per graph key (known from its capture on), the
#: duration of a phase that has run.
EVENT_LABELLED = ["graphserving_graph_capture_seconds", "graphserving_graph_online_canary_comparisons_total",
                  "graphserving_graph_online_canary_divergences_total", "graphserving_worker_phase_duration_seconds"]

#: What promtool says of the router protocol's names (vLLM's, which the endpoint picker reads;
#: docs/dashboards.md, "Router-facing metrics"), and of nothing else: colons are reserved for
#: recording rules.
ALIAS_PROBLEMS = sorted(f"{alias} metric names should not contain ':'" for alias in ROUTER_ALIASES)


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
def test_the_worker_exposition_passes_the_linter_but_for_the_colons_of_the_router_aliases(worker_metrics):
    text, _ = worker_metrics
    assert sorted(lint(text)) == ALIAS_PROBLEMS


@pytest.mark.slow
def test_the_router_aliases_are_gauges_with_our_values(worker_metrics):
    families = parse(worker_metrics[0])
    assert families["graphserving_kv_cache_usage_ratio"].type == "gauge"
    for alias, ours in ROUTER_ALIASES.items():
        assert families[alias].type == "gauge"
        assert [s[1:] for s in families[alias].samples] == [s[1:] for s in families[ours].samples] == [
            ({"model_name": "tiny"}, 0.0)], alias


@pytest.mark.slow
def test_queue_time_and_itl_are_histograms_of_the_served_completion(worker_metrics):
    families = parse(worker_metrics[0])
    value = {name: {(s[0], s[1].get("le")): s[2] for s in families[name].samples}
             for name in ("graphserving_request_queue_time_seconds", "graphserving_inter_token_latency_seconds")}
    queue, itl = value["graphserving_request_queue_time_seconds"], value["graphserving_inter_token_latency_seconds"]
    assert families["graphserving_inter_token_latency_seconds"].type == "histogram"
    assert queue[("graphserving_request_queue_time_seconds_count", None)] == 1.0
    # 3 tokens (max_tokens 3, ignore_eos): 2 intervals
    assert itl[("graphserving_inter_token_latency_seconds_count", None)] == 2.0
    assert itl[("graphserving_inter_token_latency_seconds_bucket", "+Inf")] == 2.0
    assert itl[("graphserving_inter_token_latency_seconds_sum", None)] > 0


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
    itl = families["graphserving_inter_token_latency_seconds"]
    assert itl.type == "histogram"
    assert ("graphserving_inter_token_latency_seconds_count", {"model_name": "tiny"}, 0.0) in itl.samples
    assert ("graphserving_inter_token_latency_seconds_bucket", {"model_name": "tiny", "le": "+Inf"}, 0.0) in itl.samples
    assert [s[0] for s in itl.samples][-2:] == ["graphserving_inter_token_latency_seconds_count",
                                                "graphserving_inter_token_latency_seconds_sum"]
    for alias in ROUTER_ALIASES:
        assert families[alias].samples == [(alias, {"model_name": "tiny"}, 0.0)]


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


def test_promtool_and_its_port_flag_only_the_colons_of_the_router_aliases_in_a_fresh_registry():
    text = EngineMetrics("tiny").render().decode()
    port = [f"{name} {problem}" for name, family in parse(text).items() for problem in promlint_problems(family)]
    assert sorted(port) == ALIAS_PROBLEMS
    binary = promtool()
    if binary is None:
        pytest.skip("promtool is not built (python -m graphserving.dev.binaries promtool)")
    assert sorted(promtool_problems(text, binary)) == ALIAS_PROBLEMS
