"""The worker report carries the prefix cache's totals (``prefixCache``): from the engine of a
running lifecycle (tiny random Llama, CPU, mode NONE), validated by the contract, optional for
reports of workers that predate it."""

from __future__ import annotations


import pydantic
import pytest

torch = pytest.importorskip("torch")

from graphserving.contract.graph_policy import GraphMode  # noqa: E402
from graphserving.contract.report import PrefixCacheReport, WorkerReport  # noqa: E402
from graphserving.contract.worker_config import EngineLimits, GraphConfig, WorkerConfig  # noqa: E402
from graphserving.runtime.engine.sequence import SamplingParams  # noqa: E402
from graphserving.runtime.lifecycle.phases import WorkerLifecycle  # noqa: E402
from graphserving.runtime.model.loader import load_model  # noqa: E402
from test_lifecycle import run_bounded  # noqa: E402

PROMPT = list(range(100, 140))  # 2 full blocks of 16, and 8 tokens
GREEDY = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir("llama3_rope"), revision=None, dtype=torch.float32, device="cpu")


def ready(tiny, **engine) -> WorkerLifecycle:
    limits = EngineLimits(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16, **engine)
    config = WorkerConfig(model_name="tiny", model_path="tiny", engine=limits, graphs=GraphConfig(mode=GraphMode.NONE))
    lc = WorkerLifecycle(config, tiny)
    run_bounded(lc)
    assert lc.readiness.ready, lc.phase
    return lc


def test_the_report_counts_the_queries_and_hits_of_the_engine(tiny):
    lc = ready(tiny)
    lc.engine.generate([PROMPT], GREEDY)
    lc.engine.generate([[*PROMPT[:32], 7, 8]], GREEDY)
    report = lc.report()
    assert report.prefix_cache == PrefixCacheReport(enabled=True, query_tokens=40 + 34, hit_tokens=32,
                                                    cached_blocks=lc.engine.block_manager.num_cached_blocks)
    assert report.prefix_cache.cached_blocks >= 2
    text = report.to_annotation()
    assert '"prefixCache":{"enabled":true,"queryTokens":74,"hitTokens":32,' in text
    assert WorkerReport.from_annotation(text).prefix_cache == report.prefix_cache


def test_with_prefix_caching_off_the_report_says_so_and_counts_nothing(tiny):
    lc = ready(tiny, prefix_caching=False)
    lc.engine.generate([PROMPT, PROMPT], GREEDY)
    assert lc.report().prefix_cache == PrefixCacheReport(enabled=False, query_tokens=0, hit_tokens=0, cached_blocks=0)


def test_more_hits_than_queries_is_refused_naming_both():
    with pytest.raises(pydantic.ValidationError, match="prefixCache.hitTokens 5 exceeds queryTokens 4"):
        PrefixCacheReport(enabled=True, query_tokens=4, hit_tokens=5)


def test_a_report_without_prefix_cache_is_still_valid(tiny):
    lc = ready(tiny)
    data = lc.report().model_dump(mode="json", by_alias=True, exclude_none=True)
    del data["prefixCache"]
    assert WorkerReport.model_validate(data).prefix_cache is None
