"""Prompt log-probabilities from real CUDA graphs (GPU machine): FULL and PIECEWISE replays give the
numbers of eager execution (float32), and the sampled tokens do not change. The model has
SmolLM2-135M's shape with seeded random weights, as in tests/runtime/graphs/test_cuda_graphs.py
(the property does not need the checkpoint).

Two rows a step with one token of budget each make a decoding row plus a one-token prefill chunk
that scores a prompt token: a uniform-decode batch, replayed by a FULL key; a larger budget puts
multi-token prefill chunks through PIECEWISE keys.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

from graphserving.contract.graph_policy import GraphMode  # noqa: E402
from graphserving.contract.worker_config import EngineLimits  # noqa: E402
from graphserving.runtime.engine.core import LLMEngine  # noqa: E402
from graphserving.runtime.engine.sequence import SamplingParams  # noqa: E402
from graphserving.runtime.graphs.key import GraphKeyContract  # noqa: E402
from graphserving.runtime.graphs.runner import GraphRunner  # noqa: E402
from graphserving.runtime.model.kv_cache import allocate_kv_cache  # noqa: E402
from graphserving.runtime.model.loader import LoadedModel  # noqa: E402
from graphserving.runtime.model.presets import preset_config, preset_tokenizer, random_model  # noqa: E402

PROMPTS = [[5, 17, 300, 42, 9000, 12], torch.randint(3, 49152, (37,), generator=torch.Generator().manual_seed(0)).tolist()]


@pytest.fixture(scope="module")
def smollm2_cuda():
    config = preset_config("smollm2-135m")
    model = random_model(config, torch.float32, "cuda", max_positions=1024, seed=1).eval()
    return LoadedModel(model=model, config=config, tokenizer=preset_tokenizer(config.vocab_size), revision="r" * 64,
                       name="smollm2-135m-random", path=Path("preset:smollm2-135m"))


def engine(loaded, budget: int, graphs: bool) -> LLMEngine:
    limits = EngineLimits(max_num_seqs=2, max_num_batched_tokens=budget, num_kv_blocks=64, block_size=16,
                          num_scheduler_steps=1)
    kv = allocate_kv_cache(loaded.config, limits.num_kv_blocks, limits.block_size, torch.float32, "cuda")
    runner = None
    if graphs:
        runner = GraphRunner(loaded.model, kv, mode=GraphMode.FULL_AND_PIECEWISE, full_sizes=[1, 2],
                             piecewise_sizes=[2, 8, 16], contract=GraphKeyContract(model_revision="t", dtype="float32"),
                             max_blocks_per_seq=63)
        with torch.inference_mode():
            assert all(r.ok for r in runner.capture_all())
    return LLMEngine(loaded.model, loaded.config, loaded.tokenizer, limits, device="cuda", dtype=torch.float32,
                     kv_caches=kv, graph_runner=runner)


@pytest.mark.parametrize("budget,kind", [(2, "full"), (16, "piecewise")])
def test_cuda_graph_replays_give_the_prompt_logprobs_of_eager_execution(smollm2_cuda, budget, kind):
    prompts = PROMPTS
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)]
    eager = engine(smollm2_cuda, budget, graphs=False).generate(prompts, params)
    graphed_engine = engine(smollm2_cuda, budget, graphs=True)
    graphed = graphed_engine.generate(prompts, params)
    assert any(label.startswith(kind) for label in graphed_engine.runner.graph_runner.stats.replays)
    for prompt, e, g in zip(prompts, eager, graphed):
        ours, theirs = g[0].prompt_logprobs, e[0].prompt_logprobs
        assert g[0].token_ids == e[0].token_ids
        assert len(ours) == len(prompt) and ours[0] is None
        assert [x.token_id for x in ours[1:]] == prompt[1:]
        assert [x.logprob for x in ours[1:]] == pytest.approx([x.logprob for x in theirs[1:]], abs=1e-3)
        assert [x.rank for x in ours[1:]] == [x.rank for x in theirs[1:]]
