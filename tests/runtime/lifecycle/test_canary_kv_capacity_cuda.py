"""A recapture while requests hold every KV block, on a GPU (GPU machine): real CUDA graphs, the
SmolLM2 shape with random weights. The canary runs over the blocks reserved for it, every key is
proven again, and the live requests' K/V are untouched (issue 19, item 4)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from graphserving.contract.report import Phase  # noqa: E402
from graphserving.contract.worker_config import EngineLimits, GraphConfig, WorkerConfig  # noqa: E402
from graphserving.runtime.engine.sequence import SamplingParams  # noqa: E402
from graphserving.runtime.graphs.canary import canary_blocks_needed  # noqa: E402
from graphserving.runtime.graphs.key import full_key, piecewise_key  # noqa: E402
from graphserving.runtime.lifecycle.phases import WorkerLifecycle  # noqa: E402
from graphserving.runtime.model.presets import load_preset  # noqa: E402

LIMITS = EngineLimits(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024, num_kv_blocks=400)


def test_a_gpu_recapture_with_every_kv_block_held_proves_every_key_on_the_reserve():
    loaded = load_preset("preset:smollm2-135m", torch.bfloat16, "cuda")
    config = WorkerConfig(model_name="smollm2", model_path="preset:smollm2-135m", engine=LIMITS,
                          graphs=GraphConfig(capture_sizes=[1, 2, 4, 8, 16], piecewise_capture_sizes=[64, 128, 256]))
    lc = WorkerLifecycle(config, loaded)
    lc.run()
    assert lc.phase is Phase.READY, lc.readiness.reason
    engine, bm = lc.engine, lc.engine.block_manager
    reserve = max(canary_blocks_needed(full_key(16, lc.contract), 16, 1024),
                  canary_blocks_needed(piecewise_key(256, lc.contract), 16, 1024))
    assert len(bm.reserved_blocks) == reserve == 32

    for i in range(16):
        engine.add_request(f"fill-{i}", [(11 * i + j) % 1000 + 3 for j in range(100)],
                           SamplingParams(max_tokens=900, temperature=0, ignore_eos=True))
    for _ in range(2000):
        engine.step()
        if bm.num_free_blocks == 0:
            break
    engine.flush()
    assert bm.num_free_blocks == 0 and engine.num_requests == 16
    live = torch.tensor(sorted(b for table in bm.block_tables.values() for b in table), device="cuda")
    before = [cache[:, live].clone() for cache in engine.kv_caches]

    report = lc.recapture(GraphConfig(capture_sizes=[1, 4, 16], piecewise_capture_sizes=[128, 256]))

    assert report.phase is Phase.READY and lc.readiness.ready, report.failure_reason or report.degraded_reason
    assert report.coverage == 1.0 and report.canary_failures == 0
    assert all(k.captured and k.canary.passed and k.eager_reason is None for k in report.keys)
    assert len(report.keys) == 5
    for cache, saved in zip(engine.kv_caches, before):
        assert torch.equal(cache[:, live], saved)
    while engine.has_unfinished():
        engine.step()
    assert bm.num_used_blocks == 0 and sum(lc.runner.stats.replays.values()) > 0
