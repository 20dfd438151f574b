"""The worker lifecycle on a GPU (GPU machine): real CUDA graphs, real SmolLM2 weights.

Phases Loading → Warmup → Profiling → Capturing → Canary → Ready; every configured key captured
and passing its canary; graph memory estimated before the KV cache is sized and measured after.
"""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from graphserving.contract.report import Phase, WorkerReport  # noqa: E402
from graphserving.contract.worker_config import EngineLimits, GraphConfig, WorkerConfig  # noqa: E402
from graphserving.runtime.lifecycle.phases import WorkerLifecycle  # noqa: E402
from graphserving.runtime.model.loader import load_model  # noqa: E402
from graphserving.runtime.engine.sequence import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def smollm2_cuda(smollm2_path):
    return load_model(smollm2_path, revision=None, dtype=torch.bfloat16, device="cuda")


def test_gpu_worker_captures_passes_canaries_and_is_ready(smollm2_cuda, smollm2_path):
    config = WorkerConfig(
        model_name="smollm2", model_path=str(smollm2_path),
        engine=EngineLimits(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=1024),
        graphs=GraphConfig(),  # FULL_AND_PIECEWISE with the default capture sizes
    )
    lifecycle = WorkerLifecycle(config, smollm2_cuda, loading_seconds=1.0)
    thread = threading.Thread(target=lifecycle.run, daemon=True)
    thread.start()
    thread.join(600)
    assert not thread.is_alive()
    report = WorkerReport.from_annotation(lifecycle.report().to_annotation())
    assert [p.phase for p in report.phases] == [
        Phase.LOADING, Phase.WARMUP, Phase.PROFILING, Phase.CAPTURING, Phase.CANARY, Phase.READY]
    assert all(p.duration_seconds is not None and p.duration_seconds >= 0 for p in report.phases)
    assert report.phase is Phase.READY and lifecycle.readiness.ready
    assert report.coverage == 1.0
    full, piecewise = report.modes
    assert full.captured == full.configured and full.configured[-1] == 32
    assert piecewise.captured == piecewise.configured and piecewise.configured[-1] == 512
    assert all(k.canary is not None and k.canary.passed for k in report.keys)
    assert report.graph_memory.estimate_bytes > 0 and report.graph_memory.actual_bytes > 0
    assert report.kv_cache.num_blocks > 0
    assert report.effective_capacity_tokens_per_second > 0
    # it serves through the graphs it captured: decode steps replay FULL keys
    outputs = lifecycle.engine.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [len(o[0].token_ids) for o in outputs] == [8, 8]
    assert sum(lifecycle.runner.stats.replays.values()) >= 7


def test_gpu_online_canary_compares_every_served_replay_without_false_divergences(smollm2_cuda, smollm2_path):
    """Real CUDA graphs, bfloat16, real prompts of mixed lengths, batches padded up to their keys:
    every replay sampled (rate 1) and none diverges under the default thresholds; the tokens are
    the same as with the online canary off (the saved KV slots are restored)."""
    from graphserving.contract.worker_config import CanaryThresholds

    def served(rate):
        config = WorkerConfig(
            model_name="smollm2", model_path=str(smollm2_path),
            engine=EngineLimits(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512),
            graphs=GraphConfig(capture_sizes=[1, 2, 4, 8, 16], piecewise_capture_sizes=[32, 64, 128, 256],
                               canary=CanaryThresholds(sample_rate=rate)),
        )
        lifecycle = WorkerLifecycle(config, smollm2_cuda)
        lifecycle.run()
        assert lifecycle.phase is Phase.READY, lifecycle.readiness.reason
        prompts = [[(37 * i + 11 * j) % 49000 + 10 for j in range(5 + 9 * i)] for i in range(11)]
        outs = lifecycle.engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        return lifecycle, [list(o[0].token_ids) for o in outs]

    lifecycle, tokens = served(1.0)
    report = lifecycle.report()
    assert report.online_canary_comparisons >= 40
    assert report.online_canary_divergences == 0, [k.online_canary for k in report.keys if k.online_canary]
    assert not lifecycle.runner.diverged and report.phase is Phase.READY
    _, reference = served(0.0)
    assert tokens == reference
