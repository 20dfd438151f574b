"""The online canary through the lifecycle: what a served divergence does to the report, the
outcome and /metrics (issue 19, "Canary in production").

Emulated graphs on the CPU, a random-weight preset and the real engine; a graph that goes wrong
after its pre-ready canary is simulated by wrapping its replay.
"""

from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")

from prometheus_client import CollectorRegistry  # noqa: E402

from graphserving.contract.report import Phase, WorkerReport  # noqa: E402
from graphserving.contract.worker_config import (  # noqa: E402
    CanaryThresholds,
    EngineLimits,
    GraphConfig,
    ReadinessPolicy,
    WorkerConfig,
)
from graphserving.runtime.engine.sequence import SamplingParams  # noqa: E402
from graphserving.runtime.graphs.key import full_key  # noqa: E402
from graphserving.runtime.graphs.metrics import GraphMetrics  # noqa: E402
from graphserving.runtime.lifecycle.phases import WorkerLifecycle  # noqa: E402
from graphserving.runtime.model.loader import LoadedModel  # noqa: E402
from tiny_preset import tiny_loaded  # noqa: E402


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return tiny_loaded()


def lifecycle(tiny, rate: float, allow_degraded: bool, registry=None) -> WorkerLifecycle:
    graphs = GraphConfig(capture_sizes=[1, 2, 4], piecewise_capture_sizes=[16, 64],
                         canary=CanaryThresholds(sample_rate=rate),
                         readiness=ReadinessPolicy(allow_degraded=allow_degraded))
    limits = EngineLimits(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=128, block_size=16,
                          num_scheduler_steps=4)
    config = WorkerConfig(model_name="tiny", model_path="tiny", engine=limits, graphs=graphs)
    metrics = GraphMetrics(registry, "tiny") if registry is not None else None
    lc = WorkerLifecycle(config, tiny, emulate_graphs=True, graph_metrics=metrics)
    lc.run()
    assert lc.phase is Phase.READY, lc.readiness.reason
    return lc


def generate(lc: WorkerLifecycle, n: int = 2, tokens: int = 12) -> list[list[int]]:
    prompts = [[(5 * i + j) % 300 for j in range(9)] for i in range(n)]
    outs = lc.engine.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return [list(o[0].token_ids) for o in outs]


def corrupt(lc: WorkerLifecycle, key) -> None:
    graph = lc.runner.graphs[key]
    original = graph.replay

    def replay():
        original()
        lc.runner.logits_buf[:, 3] += 50.0  # token 3 wins every row: the graph has gone wrong

    graph.replay = replay


def key_entry(report: WorkerReport, kind: str, size: int):
    return next(k for k in report.keys if k.kind == kind and k.size == size)


def test_a_served_divergence_takes_the_key_out_reports_it_and_degrades_the_worker(tiny):
    registry = CollectorRegistry()
    lc = lifecycle(tiny, rate=1.0, allow_degraded=True, registry=registry)
    clean = generate(lc)
    before = lc.report()
    assert before.online_canary_comparisons > 0 and before.online_canary_divergences == 0
    assert key_entry(before, "FULL", 2).online_canary.comparisons > 0

    key = full_key(2, lc.contract)
    corrupt(lc, key)
    served = generate(lc)
    assert served == clean  # the diverged step served eager logits, later steps run eagerly

    report = lc.report()
    entry = key_entry(report, "FULL", 2)
    assert entry.eager_reason == "canary_divergence"
    assert entry.online_canary.divergences == 1 and "relative logit error" in entry.online_canary.last_divergence.reason
    assert report.online_canary_divergences == 1
    assert report.phase is Phase.DEGRADED and "online canary: full-t2-r2 diverged" in report.degraded_reason
    assert report.coverage == pytest.approx(4 / 5)
    assert key in lc.runner.diverged and key not in lc.runner.graphs
    label = {"model_name": "tiny", "key": key.label()}
    assert registry.get_sample_value("graphserving_graph_online_canary_divergences_total", label) == 1
    # the compacted report (per-key details dropped) keeps the totals
    assert report.compacted().online_canary_divergences == 1


def test_under_the_default_policy_a_divergence_fails_the_worker_out_of_traffic(tiny):
    lc = lifecycle(tiny, rate=1.0, allow_degraded=False)
    corrupt(lc, full_key(2, lc.contract))
    generate(lc)
    assert lc.phase is Phase.FAILED and not lc.readiness.ready
    assert "online canary" in lc.report().failure_reason


def test_a_recapture_brings_the_key_back_and_keeps_the_totals(tiny):
    lc = lifecycle(tiny, rate=1.0, allow_degraded=True)
    key = full_key(2, lc.contract)
    corrupt(lc, key)
    generate(lc)
    assert lc.phase is Phase.DEGRADED
    lc.recapture(lc.config.graphs)
    report = lc.report()
    assert lc.phase is Phase.READY and report.coverage == 1.0
    assert key in lc.runner.graphs and not lc.runner.diverged
    assert key_entry(report, "FULL", 2).eager_reason is None
    assert report.online_canary_divergences == 1  # the worker's history stays


def test_rate_zero_compares_nothing_and_reports_no_tallies(tiny):
    lc = lifecycle(tiny, rate=0.0, allow_degraded=True)
    generate(lc)
    report = lc.report()
    assert report.online_canary_comparisons == 0
    assert all(k.online_canary is None for k in report.keys)


def test_the_pre_ready_canary_and_capacity_passes_are_not_sampled(tiny):
    lc = lifecycle(tiny, rate=1.0, allow_degraded=True)
    assert lc.report().online_canary_comparisons == 0  # only serving replays are compared
