"""A Qwen3-MoE worker through the whole lifecycle on the CPU (emulated graphs): every FULL and
PIECEWISE key captures and passes its canary, padded rows route to no expert, the key contract
names the MoE layout, and generation through the graphs equals eager generation."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from graphserving.contract.report import Phase  # noqa: E402
from graphserving.contract.worker_config import EngineLimits, GraphConfig, WorkerConfig  # noqa: E402
from graphserving.runtime.engine.sequence import SamplingParams  # noqa: E402
from graphserving.runtime.graphs.key import GraphKeyContract  # noqa: E402
from graphserving.runtime.lifecycle.phases import WorkerLifecycle  # noqa: E402
from graphserving.runtime.model.loader import load_model  # noqa: E402

from test_lifecycle import run_bounded  # noqa: E402

LIMITS = EngineLimits(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def moe_model(tiny_model_dir):
    return load_model(tiny_model_dir("qwen3_moe"), revision=None, dtype=torch.float32, device="cpu")


def _config(mode: str) -> WorkerConfig:
    return WorkerConfig(model_name="tiny-moe", model_path="tiny-moe", engine=LIMITS,
                        graphs=GraphConfig(mode=mode, capture_sizes=[1, 2, 4], piecewise_capture_sizes=[16, 64]))


def test_moe_worker_captures_and_proves_every_key_and_generates_as_eager(moe_model):
    graphs = run_bounded(WorkerLifecycle(_config("FULL_AND_PIECEWISE"), moe_model, emulate_graphs=True))
    report = graphs.report()
    assert report.phase is Phase.READY, report.failure_reason
    assert report.coverage == 1.0
    assert all(key.captured and key.canary.passed for key in report.keys)
    assert graphs.contract.moe_layout == "e8-top3-ep1"
    assert graphs.contract.digest() != GraphKeyContract(graphs.contract.model_revision, graphs.contract.dtype).digest()

    eager = run_bounded(WorkerLifecycle(_config("NONE"), moe_model))
    # 3 prompts: a FULL key of 4 replays them with one padded row (slot -1, routed to no expert)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    replayed = graphs.runner.stats.replays.copy()
    with_graphs = [c.token_ids for [c] in graphs.engine.generate(prompts, params)]
    assert sum(graphs.runner.stats.replays.values()) > sum(replayed.values())  # the graphs served the decode
    assert graphs.runner.stats.padded_rows > 0
    assert with_graphs == [c.token_ids for [c] in eager.engine.generate(prompts, params)]
