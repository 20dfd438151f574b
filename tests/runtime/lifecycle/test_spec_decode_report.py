"""The worker report carries speculative decoding's totals (``specDecode``) from the engine of a
running lifecycle (tiny random Llama, CPU, ``engine.speculative = ngram:3``), the same as the
engine's; absent when speculative decoding is off; validated by the contract."""

from __future__ import annotations


import pydantic
import pytest

torch = pytest.importorskip("torch")

from graphserving.contract.graph_policy import GraphMode  # noqa: E402
from graphserving.contract.report import SpecDecodeReport, WorkerReport  # noqa: E402
from graphserving.contract.worker_config import EngineLimits, GraphConfig, ReadinessPolicy, WorkerConfig  # noqa: E402
from graphserving.runtime.engine.sequence import SamplingParams  # noqa: E402
from graphserving.runtime.lifecycle.phases import RecaptureRefused, WorkerLifecycle  # noqa: E402
from graphserving.runtime.model.loader import load_model  # noqa: E402
from test_lifecycle import run_bounded  # noqa: E402

PROMPT = [11, 12, 13, 14, 11, 12, 13, 14, 11, 12, 13]  # periodic: prompt lookup drafts from the start
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir("llama3_rope"), revision=None, dtype=torch.float32, device="cpu")


def ready(tiny, **engine) -> WorkerLifecycle:
    limits = EngineLimits(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16, **engine)
    graphs = GraphConfig(mode=GraphMode.FULL, capture_sizes=[1, 2, 4], readiness=ReadinessPolicy(allow_degraded=True))
    lc = WorkerLifecycle(WorkerConfig(model_name="tiny", model_path="tiny", engine=limits, graphs=graphs), tiny)
    run_bounded(lc)
    assert lc.readiness.ready, lc.phase
    return lc


def test_the_report_carries_the_engines_acceptance_totals(tiny):
    lc = ready(tiny, speculative="ngram:3")
    assert lc.runner.num_speculative_tokens == 3  # the graph runner configures q = 4 FULL keys
    lc.engine.generate([PROMPT, PROMPT[1:]], GREEDY)
    stats = lc.engine.spec.stats
    report = lc.report()
    assert report.spec_decode == SpecDecodeReport(**stats.to_json())
    assert report.spec_decode.num_speculative_tokens == 3 and report.spec_decode.verifications > 0
    text = report.to_annotation()
    assert f'"specDecode":{{"numSpeculativeTokens":3,"verifications":{stats.verifications},' in text
    assert WorkerReport.from_annotation(text).spec_decode == report.spec_decode


def test_without_speculative_decoding_the_report_has_no_spec_decode(tiny):
    lc = ready(tiny)
    lc.engine.generate([PROMPT], GREEDY)
    assert lc.engine.spec is None and lc.report().spec_decode is None


def test_more_accepted_than_proposed_is_refused_naming_both():
    with pytest.raises(pydantic.ValidationError, match="acceptedTokens 5 exceeds proposedTokens 4"):
        SpecDecodeReport(num_speculative_tokens=2, proposed_tokens=4, accepted_tokens=5)



def test_a_recapture_into_a_mode_without_full_graphs_is_refused_while_speculating(tiny):
    lc = ready(tiny, speculative="ngram:2")
    with pytest.raises(RecaptureRefused, match=r"engine.speculative \(--speculative ngram:2\) needs a graph mode "
                                               "that captures FULL graphs.*graphs.mode is PIECEWISE"):
        lc.recapture(GraphConfig(mode=GraphMode.PIECEWISE))
    assert lc.config.graphs.mode is GraphMode.FULL


def test_the_report_names_each_verification_keys_query_length_and_proves_it(tiny):
    limits = EngineLimits(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16,
                          speculative="ngram:3")
    graphs = GraphConfig(mode=GraphMode.FULL, capture_sizes=[1, 2, 4])
    lc = WorkerLifecycle(WorkerConfig(model_name="tiny", model_path="tiny", engine=limits, graphs=graphs), tiny,
                         emulate_graphs=True)
    lc.run()
    report = lc.report()
    assert lc.readiness.ready, report.failure_reason
    assert sorted((k.size, k.query_len or 1) for k in report.keys) == [(1, 1), (1, 4), (2, 1), (2, 4), (4, 1), (4, 4)]
    assert report.coverage == 1.0
    assert all(k.captured and k.canary is not None and k.canary.passed for k in report.keys)
    assert '"query_len"' not in report.to_annotation() and '"queryLen":4' in report.to_annotation()
