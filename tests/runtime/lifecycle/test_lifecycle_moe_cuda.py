"""A Qwen3-MoE worker on a GPU (GPU machine): real CUDA graphs over the fused MoE kernels, every FULL
and PIECEWISE key captured and proven by its canary, and decode served through the FULL graphs.

The model is the qwen3-30b-a3b preset's layer shape (128 experts, top 8, H 2048, expert width 768)
cut to 2 layers and a small vocabulary, random weights, bfloat16: the expert dispatch of the real
model inside every captured graph, in seconds.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from graphserving.contract.report import Phase  # noqa: E402
from graphserving.contract.worker_config import EngineLimits, GraphConfig, WorkerConfig  # noqa: E402
from graphserving.runtime.engine.sequence import SamplingParams  # noqa: E402
from graphserving.runtime.lifecycle.phases import WorkerLifecycle  # noqa: E402
from graphserving.runtime.model.loader import LoadedModel  # noqa: E402
from graphserving.runtime.model.presets import preset_config, preset_tokenizer, random_model  # noqa: E402


@pytest.fixture(scope="module")
def moe_cuda() -> LoadedModel:
    config = dataclasses.replace(preset_config("qwen3-30b-a3b"), num_hidden_layers=2, moe_layers=(0, 1),
                                 vocab_size=4096, max_position_embeddings=2048)
    model = random_model(config, torch.bfloat16, "cuda", max_positions=config.max_model_len).eval()
    return LoadedModel(model=model, config=config, tokenizer=preset_tokenizer(config.vocab_size), revision="m" * 64,
                       name="qwen3-moe-2l", path=Path("preset:qwen3-moe-2l"))


def test_gpu_moe_worker_captures_every_key_passes_canaries_and_serves_through_graphs(moe_cuda):
    config = WorkerConfig(
        model_name="qwen3-moe-2l", model_path="preset:qwen3-moe-2l",
        engine=EngineLimits(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=1024),
        graphs=GraphConfig(),  # FULL_AND_PIECEWISE with the default capture sizes
    )
    lifecycle = WorkerLifecycle(config, moe_cuda, loading_seconds=1.0)
    thread = threading.Thread(target=lifecycle.run, daemon=True)
    thread.start()
    thread.join(600)
    assert not thread.is_alive()
    report = lifecycle.report()
    assert report.phase is Phase.READY, report.failure_reason
    assert lifecycle.contract.moe_layout == "e128-top8-ep1"
    assert report.coverage == 1.0
    assert all(k.captured and k.canary is not None and k.canary.passed for k in report.keys), [
        (k.kind, k.size, k.canary) for k in report.keys if not (k.canary and k.canary.passed)]
    assert report.graph_memory.actual_bytes > 0
    prompts = [[(97 * i + 13 * j) % 4000 + 3 for j in range(4 + 5 * i)] for i in range(7)]
    replays = sum(lifecycle.runner.stats.replays.values())
    outputs = lifecycle.engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [len(o[0].token_ids) for o in outputs] == [8] * 7
    assert sum(lifecycle.runner.stats.replays.values()) - replays >= 7
