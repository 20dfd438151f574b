"""Real CUDA graphs (GPU machine): the graph-runner behaviours of test_graph_runner.py on a GPU.

The model has SmolLM2-135M's shape with seeded random weights (the checkpoint is not needed for
these properties). float32 is compared tightly; bfloat16 through the canary bound.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

from graphserving.contract.graph_policy import GraphMode, resolve_capture_sizes  # noqa: E402
from graphserving.contract.worker_config import CanaryThresholds  # noqa: E402
from graphserving.runtime.graphs.canary import run_canary  # noqa: E402
from graphserving.runtime.model.kv_layout import NULL_BLOCK  # noqa: E402
from graphserving.runtime.graphs.backend import CudaGraphBackend  # noqa: E402
from graphserving.runtime.graphs.key import FallbackReason, GraphKeyContract, full_key, piecewise_key  # noqa: E402
from graphserving.runtime.graphs.runner import GraphRunner  # noqa: E402
from graphserving.runtime.model.presets import preset_config, random_model  # noqa: E402

WIDTH = 32
C32 = GraphKeyContract(model_revision="random", dtype="float32")
C16 = GraphKeyContract(model_revision="random", dtype="bfloat16")


@pytest.fixture(scope="module")
def model32():
    return random_model(preset_config("smollm2-135m"), torch.float32, "cuda", max_positions=1024, seed=1)


@pytest.fixture(scope="module")
def model16():
    return random_model(preset_config("smollm2-135m"), torch.bfloat16, "cuda", max_positions=1024, seed=1)


def pair(model, paged_runner, blocks=2000):
    return (paged_runner(model, num_blocks=blocks, block_size=16, table_width=WIDTH, seed=0),
            paged_runner(model, num_blocks=blocks, block_size=16, table_width=WIDTH, seed=0))


def runner_for(model, kv, contract, mode=GraphMode.FULL_AND_PIECEWISE, full=(1, 2, 4, 8, 16, 24, 32),
               piece=(16, 32, 64, 128), **kw):
    runner = GraphRunner(model, kv, mode=mode, full_sizes=list(full), piecewise_sizes=list(piece),
                         contract=contract, max_blocks_per_seq=WIDTH, **kw)
    assert isinstance(runner.backend, CudaGraphBackend)
    with torch.inference_mode():
        results = runner.capture_all()
    assert all(r.ok for r in results), [(r.key.label(), r.error) for r in results if not r.ok]
    return runner


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 49152, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


@torch.inference_mode()
def test_cuda_decode_19_after_32_with_poisoned_buffers(model32, paged_runner):
    graphed, eager = pair(model32, paged_runner)
    runner = runner_for(model32, graphed.kv_caches, C32)
    for seq, tokens in enumerate(prompts(32)):
        graphed.step([(seq, tokens)])
        eager.step([(seq, tokens)])
    step32 = [(s, [7]) for s in range(32)]
    ours, d = runner.execute(graphed.metadata(step32))
    assert d.key == full_key(32, C32)
    torch.testing.assert_close(ours, eager.step(step32), rtol=1e-4, atol=1e-4)
    runner.buffers.poison(torch.Generator().manual_seed(5))
    step19 = [(s, [11]) for s in range(19)]
    ours, d = runner.execute(graphed.metadata(step19))
    assert d.key == full_key(24, C32)
    torch.testing.assert_close(ours, eager.step(step19), rtol=1e-4, atol=1e-4)
    for mine, theirs in zip(graphed.kv_caches, eager.kv_caches):
        torch.testing.assert_close(mine[:, NULL_BLOCK + 1:], theirs[:, NULL_BLOCK + 1:], rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_cuda_max_num_seqs_100_replays_full(model16, paged_runner):
    graphed, _ = pair(model16, paged_runner)
    runner = runner_for(model16, graphed.kv_caches, C16, mode=GraphMode.FULL,
                        full=resolve_capture_sizes(None, 100), piece=())
    for s in range(100):
        graphed.step([(s, [1, 2, 3])])
    _, d = runner.execute(graphed.metadata([(s, [4]) for s in range(100)]))
    assert d.key == full_key(100, C16)


@torch.inference_mode()
def test_cuda_weight_reload_in_place_replays_new_weights(paged_runner):
    model = random_model(preset_config("smollm2-135m"), torch.float32, "cuda", max_positions=1024, seed=2)
    graphed, eager = pair(model, paged_runner)
    runner = runner_for(model, graphed.kv_caches, C32, piece=())
    for s in range(4):
        graphed.step([(s, [1, 2, 3])])
        eager.step([(s, [1, 2, 3])])
    before, _ = runner.execute(graphed.metadata([(s, [4]) for s in range(4)]))
    eager.step([(s, [4]) for s in range(4)])
    g = torch.Generator(device="cuda").manual_seed(9)
    with torch.no_grad():
        new = {}
        for name in model.expected_weight_names():
            target, rows = model._target(name)
            shape = (target.data if rows is None else target.data[rows]).shape
            new[name] = 0.02 * torch.randn(shape, generator=g, device="cuda")
    model.load_weights(new)
    assert runner.check_addresses()
    after, d = runner.execute(graphed.metadata([(s, [5]) for s in range(4)]))
    assert d.key == full_key(4, C32)
    torch.testing.assert_close(after, eager.step([(s, [5]) for s in range(4)]), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(after, before)


@torch.inference_mode()
def test_cuda_unrelated_allocations_after_capture_do_not_change_replay(model32, paged_runner):
    graphed, _ = pair(model32, paged_runner)
    runner = runner_for(model32, graphed.kv_caches, C32, mode=GraphMode.FULL, piece=())
    for s in range(8):
        graphed.step([(s, [9, 8, 7])])
    meta = graphed.metadata([(s, [1]) for s in range(8)])
    first = runner.replay(full_key(8, C32), meta)
    junk = [torch.randn(1 << 20, device="cuda") for _ in range(200)]
    del junk[::2]
    torch.cuda.empty_cache()
    junk += [torch.full((1 << 20,), float("nan"), device="cuda") for _ in range(100)]
    second = runner.replay(full_key(8, C32), meta)
    torch.testing.assert_close(first, second)


@torch.inference_mode()
def test_cuda_mixed_batch_replays_piecewise(model32, paged_runner):
    graphed, eager = pair(model32, paged_runner)
    runner = runner_for(model32, graphed.kv_caches, C32)
    for s in range(3):
        graphed.step([(s, [3, 4, 5, 6])])
        eager.step([(s, [3, 4, 5, 6])])
    batch = [(0, [8]), (1, [9]), (2, [10, 11, 12]), (3, list(range(20, 60)))]
    ours, d = runner.execute(graphed.metadata(batch))
    assert d.key == piecewise_key(64, C32)
    torch.testing.assert_close(ours, eager.step(batch), rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_cuda_every_default_key_passes_canary_in_bfloat16(model16, paged_runner):
    graphed, _ = pair(model16, paged_runner, blocks=4000)
    full = resolve_capture_sizes(None, 256)
    runner = runner_for(model16, graphed.kv_caches, C16, full=full, piece=(64, 512, 2048))
    g = torch.Generator().manual_seed(0)
    results = [run_canary(runner, k, graphed.free[:3000], 16, 1024, CanaryThresholds(), g) for k in runner.captured_keys()]
    assert results[0].key == full_key(256, C16)
    assert [(r.key.label(), r.reason) for r in results if not r.passed] == []
    assert runner.graph_memory_bytes() > 0


@torch.inference_mode()
def test_cuda_injected_capture_failure_falls_back(model16, paged_runner):
    graphed, _ = pair(model16, paged_runner)

    def fault(key):
        if key.num_reqs == 8:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")

    runner = GraphRunner(model16, graphed.kv_caches, mode=GraphMode.FULL, full_sizes=[4, 8, 16], piecewise_sizes=[],
                         contract=C16, max_blocks_per_seq=WIDTH, capture_fault=fault)
    with torch.inference_mode():
        results = runner.capture_all()
    assert [r.ok for r in results] == [True, False, True]
    graphed.step([(s, [1, 2]) for s in range(6)])
    _, d = runner.execute(graphed.metadata([(s, [3]) for s in range(6)]))
    assert d.reason is FallbackReason.NOT_CAPTURED
    _, d = runner.execute(graphed.metadata([(s, [4]) for s in range(3)]))
    assert d.key == full_key(4, C16)


@torch.inference_mode()
def test_cuda_host_metadata_is_padded_in_staging_and_equals_eager(model32, paged_runner):
    """The model runner hands host metadata to the graph runner: two packed copies per step."""
    graphed, eager = pair(model32, paged_runner)
    runner = runner_for(model32, graphed.kv_caches, C32)
    for seq, tokens in enumerate(prompts(12, seed=3)):
        graphed.step([(seq, tokens)])
        eager.step([(seq, tokens)])
    for step, n in enumerate((12, 5, 9)):
        runner.buffers.poison(torch.Generator().manual_seed(step))
        batch = [(s, [20 + step]) for s in range(n)]
        host = graphed.metadata(batch).to("cpu")
        ours, d = runner.execute(host)
        assert d.key is not None and d.key.num_reqs >= n
        torch.testing.assert_close(ours, eager.step(batch), rtol=1e-4, atol=1e-4)
    mixed = [(0, [1]), (1, list(range(30, 50)))]
    ours, d = runner.execute(graphed.metadata(mixed).to("cpu"))
    assert d.key == piecewise_key(32, C32)
    torch.testing.assert_close(ours, eager.step(mixed), rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_cuda_fused_rope_decode_attention_replays_equal_to_the_two_kernel_path(model32, paged_runner, monkeypatch):
    """The fused RoPE-write-attend decode kernel on: FULL decode graphs (captured with it) equal eager steps
    without it, outputs and every written KV slot."""
    from graphserving.runtime.model.kernels import decode_attention

    graphed, eager = pair(model32, paged_runner)
    for seq, tokens in enumerate(prompts(12, seed=4)):
        graphed.step([(seq, tokens)])
        eager.step([(seq, tokens)])
    monkeypatch.setattr(decode_attention, "FUSE_ROPE_DECODE", "1")
    runner = runner_for(model32, graphed.kv_caches, C32, mode=GraphMode.FULL, piece=())
    for step, n in enumerate((12, 7)):
        batch = [(s, [100 + step]) for s in range(n)]
        ours, d = runner.execute(graphed.metadata(batch))
        assert d.key.mode.name == "FULL"
        monkeypatch.setattr(decode_attention, "FUSE_ROPE_DECODE", "0")
        torch.testing.assert_close(ours, eager.step(batch), rtol=1e-4, atol=1e-4)
        monkeypatch.setattr(decode_attention, "FUSE_ROPE_DECODE", "1")
    for mine, theirs in zip(graphed.kv_caches, eager.kv_caches):
        torch.testing.assert_close(mine[:, NULL_BLOCK + 1:], theirs[:, NULL_BLOCK + 1:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 7, 49, 61, 64, 127, 256])
def test_identical_logits_pass_the_canary_comparison_on_the_device(rows):
    """Agreement is counted, not averaged: a CUDA float mean of all-agreeing rows can come out
    below 1 (61 * (1/61) is 0.99999994 in float32), and it failed agreeing graphs on the H200."""
    from graphserving.runtime.graphs.canary import compare_logits

    g = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(rows, 4096, device="cuda", generator=g)
    logits[:, 0] += 20.0  # every row's top-1 token wins by far more than the margin
    result = compare_logits(full_key(rows, C16), logits, logits.clone(), CanaryThresholds(), torch.bfloat16)
    assert result.passed, result.reason
    assert result.top1_agreement == 1.0 and result.rows_above_margin == rows
