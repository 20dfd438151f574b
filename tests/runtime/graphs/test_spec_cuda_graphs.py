"""Real CUDA graphs of speculative verification batches (GPU machine).

The behaviours of test_spec_graph_runner.py on ``torch.cuda.CUDAGraph`` through the runner: a
runner with ``num_speculative_tokens`` captures FULL keys of query length ``k + 1`` at every
decode capture size, a verification batch replays the key of its padded request count (on the
fused-kernel path: RoPE inside the K/V write, then the paged decode kernel over the expanded rows)
and equals eager execution, and the canary proves every key. Models have preset shapes with
seeded random weights (the checkpoints are not needed for these properties).
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

from graphserving.contract.graph_policy import GraphMode  # noqa: E402
from graphserving.contract.worker_config import CanaryThresholds  # noqa: E402
from graphserving.runtime.graphs.backend import CudaGraphBackend  # noqa: E402
from graphserving.runtime.graphs.canary import run_canary  # noqa: E402
from graphserving.runtime.graphs.key import GraphKeyContract, full_key, piecewise_key  # noqa: E402
from graphserving.runtime.graphs.runner import GraphRunner  # noqa: E402
from graphserving.runtime.model.kv_layout import NULL_BLOCK  # noqa: E402
from graphserving.runtime.model.presets import preset_config, random_model  # noqa: E402

WIDTH = 32
K = 3
Q = K + 1


def contract(dtype: torch.dtype) -> GraphKeyContract:
    return GraphKeyContract(model_revision="random", dtype=str(dtype).removeprefix("torch."))


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen3-moe-tiny"])
def model32(request):
    return random_model(preset_config(request.param), torch.float32, "cuda", max_positions=1024, seed=1)


def pair(model, paged_runner, blocks=2000):
    return (paged_runner(model, num_blocks=blocks, block_size=16, table_width=WIDTH, seed=0),
            paged_runner(model, num_blocks=blocks, block_size=16, table_width=WIDTH, seed=0))


def spec_runner(model, kv, dtype, full=(1, 2, 4, 8), piece=(16, 32, 64), k=K):
    runner = GraphRunner(model, kv, mode=GraphMode.FULL_AND_PIECEWISE, full_sizes=list(full),
                         piecewise_sizes=list(piece), contract=contract(dtype), max_blocks_per_seq=WIDTH,
                         num_speculative_tokens=k)
    assert isinstance(runner.backend, CudaGraphBackend)
    with torch.inference_mode():
        results = runner.capture_all()
    assert all(r.ok for r in results), [(r.key.label(), r.error) for r in results if not r.ok]
    return runner


def prefill(runners, n, vocab, seed=0):
    """The same ``n`` random prompts into each paged runner (identical block tables stay identical)."""
    g = torch.Generator().manual_seed(seed)
    for seq in range(n):
        tokens = torch.randint(0, vocab, (int(torch.randint(3, 60, (1,), generator=g)),), generator=g).tolist()
        for runner in runners:
            runner.step([(seq, tokens)])


def drafts(seqs, vocab, generator):
    return [(s, torch.randint(0, vocab, (Q,), generator=generator).tolist()) for s in seqs]


def every_row(meta, **changes):
    return dataclasses.replace(meta, logits_indices=torch.arange(meta.num_tokens, device=meta.input_ids.device),
                               **changes)


def eager_logits(paged, batch, verification: bool):
    """Every row's logits of ``batch`` on ``paged``: as a verification batch (the kernels the graph
    captured) or as a chunked-prefill batch (the general attention path)."""
    meta = every_row(paged.metadata(batch), **({"uniform_query_len": Q} if verification else {}))
    hidden = paged.model(meta, paged.kv_caches)
    return paged.model.compute_logits(hidden[meta.logits_indices])


@torch.inference_mode()
def test_cuda_verification_batches_replay_the_q4_keys_padded_like_eager(model32, paged_runner, rel_err):
    """3 requests pad to the key of 4, 7 to 8, then 2 to 2, from host metadata (the staging copy)
    with the buffers poisoned in between: logits of every row as eager verification (the same
    kernels) and within 1e-4 of the chunked-prefill path; the KV caches agree."""
    vocab = model32.config.vocab_size
    graphed, eager = pair(model32, paged_runner)
    runner = spec_runner(model32, graphed.kv_caches, torch.float32)
    reference = paged_runner(model32, num_blocks=2000, block_size=16, table_width=WIDTH, seed=0)  # general path
    prefill([graphed, eager, reference], 8, vocab)
    g = torch.Generator().manual_seed(1)
    for step, (seqs, size) in enumerate((([0, 3, 5], 4), (list(range(7)), 8), ([2, 6], 2))):
        batch = drafts(seqs, vocab, g)
        runner.buffers.poison(torch.Generator().manual_seed(step))
        ours, decision = runner.execute(every_row(graphed.metadata(batch), uniform_query_len=Q).to("cpu"))
        assert decision.key == full_key(size, contract(torch.float32), Q)
        torch.testing.assert_close(ours, eager_logits(eager, batch, verification=True), rtol=1e-4, atol=1e-4)
        assert rel_err(ours, eager_logits(reference, batch, verification=False)) < 1e-4
    for mine, theirs in zip(graphed.kv_caches, eager.kv_caches):
        torch.testing.assert_close(mine[:, NULL_BLOCK + 1:], theirs[:, NULL_BLOCK + 1:], rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_cuda_decode_and_large_verification_batches_on_a_spec_runner(model32, paged_runner):
    """A decode batch takes the q = 1 key; 9 requests of 4 rows (above the largest full size)
    replay piecewise; both as eager."""
    vocab = model32.config.vocab_size
    graphed, eager = pair(model32, paged_runner)
    runner = spec_runner(model32, graphed.kv_caches, torch.float32)
    prefill([graphed, eager], 9, vocab, seed=2)
    step = [(s, [40 + s]) for s in range(5)]
    ours, decision = runner.execute(graphed.metadata(step))
    assert decision.key == full_key(8, contract(torch.float32))
    torch.testing.assert_close(ours, eager.step(step), rtol=1e-4, atol=1e-4)
    batch = drafts(range(9), vocab, torch.Generator().manual_seed(3))
    ours, decision = runner.execute(every_row(graphed.metadata(batch), uniform_query_len=Q))
    assert decision.key == piecewise_key(64, contract(torch.float32))
    torch.testing.assert_close(ours, eager_logits(eager, batch, verification=True), rtol=1e-4, atol=1e-4)


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_every_key_of_a_spec_runner_passes_the_canary(paged_runner, dtype):
    model = random_model(preset_config("smollm2-135m"), dtype, "cuda", max_positions=1024, seed=4)
    graphed, _ = pair(model, paged_runner, blocks=4000)
    runner = spec_runner(model, graphed.kv_caches, dtype, full=(1, 2, 4, 8, 16, 32, 64), piece=(64, 256), k=4)
    g = torch.Generator().manual_seed(0)
    results = [run_canary(runner, key, graphed.free[:3000], 16, 1024, CanaryThresholds(), g)
               for key in runner.captured_keys()]
    assert results[0].key == full_key(64, contract(dtype), 5)  # 320 token rows: the largest graph
    assert {r.key.uniform_query_len for r in results if r.key.num_reqs} == {1, 5}
    assert [(r.key.label(), r.reason) for r in results if not r.passed] == []
    assert runner.graph_memory_bytes() > 0
