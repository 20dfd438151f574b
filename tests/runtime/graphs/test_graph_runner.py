"""The graph runner on the CPU capture/replay backend (same contract as CUDA graphs).

Each test is a behaviour serving systems have broken in public (issue: graph runner, tests 1-8).
On a CUDA machine the same tests run on real CUDA graphs (tests/gpu/test_cuda_graphs.py).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from graphserving.contract.graph_policy import GraphMode, resolve_capture_sizes  # noqa: E402
from graphserving.contract.worker_config import CanaryThresholds  # noqa: E402
from graphserving.runtime.graphs.canary import run_canary  # noqa: E402
from graphserving.runtime.model.kv_layout import NULL_BLOCK  # noqa: E402
from graphserving.runtime.graphs.backend import StaleGraphError  # noqa: E402
from graphserving.runtime.graphs.key import (  # noqa: E402
    FallbackReason,
    GraphKeyContract,
    full_key,
    piecewise_key,
)
from graphserving.runtime.graphs.runner import CaptureWindowError, GraphRunner  # noqa: E402
from graphserving.runtime.model.loader import load_model  # noqa: E402

CONTRACT = GraphKeyContract(model_revision="test", dtype="float32")
WIDTH = 24


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir("llama3_rope"), revision=None, dtype=torch.float32, device="cpu")


def make_pair(model, paged_runner, seed=0):
    """Two paged runners with identical block allocation: one for graphs, one eager reference."""
    return paged_runner(model, num_blocks=600, table_width=WIDTH, seed=seed), paged_runner(
        model, num_blocks=600, table_width=WIDTH, seed=seed
    )


def make_runner(model, kv_caches, mode=None, full=(1, 2, 4, 8, 16, 24, 32), piece=(8, 16, 32, 64, 128), **kw):
    mode = mode or (GraphMode.FULL_AND_PIECEWISE if piece else GraphMode.FULL)
    runner = GraphRunner(
        model, kv_caches, mode=mode, full_sizes=list(full), piecewise_sizes=list(piece),
        contract=CONTRACT, max_blocks_per_seq=WIDTH, **kw,
    )
    with torch.inference_mode():
        runner.capture_all()
    return runner


def prompts(n, generator, lo=3, hi=12, vocab=49152):
    return [torch.randint(0, vocab, (int(torch.randint(lo, hi, (1,), generator=generator)),), generator=generator).tolist() for _ in range(n)]


@torch.inference_mode()
def test_decode_of_19_after_32_with_poisoned_buffers_equals_eager(tiny, paged_runner):
    g = torch.Generator().manual_seed(1)
    graphed, eager = make_pair(tiny.model, paged_runner)
    runner = make_runner(tiny.model, graphed.kv_caches)
    batch = list(enumerate(prompts(32, g)))
    for seq, tokens in batch:  # prefill each (piecewise replay vs eager reference)
        ours, _ = runner.execute(graphed.metadata([(seq, tokens)]))
        ref = eager.step([(seq, tokens)])
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    step32 = [(s, [7]) for s in range(32)]
    ours, decision = runner.execute(graphed.metadata(step32))
    assert decision.key == full_key(32, CONTRACT)
    torch.testing.assert_close(ours, eager.step(step32), rtol=1e-5, atol=1e-5)

    runner.buffers.poison(torch.Generator().manual_seed(2))
    step19 = [(s, [11]) for s in range(19)]
    ours, decision = runner.execute(graphed.metadata(step19))
    assert decision.key == full_key(24, CONTRACT)
    ref = eager.step(step19)
    assert ours.shape == (19, tiny.config.vocab_size)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # nothing padded reached a real sequence's KV slots: every block but the null block matches
    for mine, theirs in zip(graphed.kv_caches, eager.kv_caches):
        torch.testing.assert_close(mine[:, NULL_BLOCK + 1 :], theirs[:, NULL_BLOCK + 1 :], rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_batch_of_exactly_max_num_seqs_replays_a_full_graph(tiny, paged_runner):
    sizes = resolve_capture_sizes(None, 100)
    graphed, _ = make_pair(tiny.model, paged_runner)
    runner = make_runner(tiny.model, graphed.kv_caches, mode=GraphMode.FULL, full=sizes, piece=())
    meta = graphed.metadata([(s, [5]) for s in range(100)])
    _, decision = runner.execute(meta)
    assert decision.key == full_key(100, CONTRACT)
    assert runner.stats.padded_rows == 0


@torch.inference_mode()
def test_off_grid_explicit_list_is_captured_exactly(tiny, paged_runner):
    graphed, _ = make_pair(tiny.model, paged_runner)
    runner = make_runner(tiny.model, graphed.kv_caches, mode=GraphMode.FULL, full=resolve_capture_sizes([3, 7], 13), piece=())
    assert [k.num_reqs for k in runner.captured_keys()] == [13, 7, 3]


@torch.inference_mode()
def test_after_weight_reload_replay_equals_eager_with_new_weights(tiny_model_dir, paged_runner):
    loaded = load_model(tiny_model_dir("qwen2_bias"), revision=None, dtype=torch.float32, device="cpu")
    model = loaded.model
    graphed, eager = make_pair(model, paged_runner)
    runner = make_runner(model, graphed.kv_caches, piece=())
    for seq in range(4):
        graphed.step([(seq, [1, 2, 3])])
        eager.step([(seq, [1, 2, 3])])
    before, _ = runner.execute(graphed.metadata([(s, [4]) for s in range(4)]))
    eager.step([(s, [4]) for s in range(4)])

    g = torch.Generator().manual_seed(3)
    new_state = {name: 0.08 * torch.randn(p.shape, generator=g) for name, p in _hf_shapes(model).items()}
    model.load_weights(new_state)
    assert runner.check_addresses(), "an in-place reload must keep every address"
    after, decision = runner.execute(graphed.metadata([(s, [5]) for s in range(4)]))
    assert decision.key == full_key(4, CONTRACT)
    ref = eager.step([(s, [5]) for s in range(4)])
    torch.testing.assert_close(after, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(after, before)


def _hf_shapes(model):
    """Hugging Face weight names of ``model`` with the shapes load_weights expects."""
    shapes = {}
    for name in model.expected_weight_names():
        target, rows = model._target(name)
        shapes[name] = target.data if rows is None else target.data[rows]
    return shapes


@torch.inference_mode()
def test_reallocated_weight_is_detected_not_replayed(tiny_model_dir, paged_runner):
    loaded = load_model(tiny_model_dir("mistral"), revision=None, dtype=torch.float32, device="cpu")
    graphed, _ = make_pair(loaded.model, paged_runner)
    runner = make_runner(loaded.model, graphed.kv_caches, piece=())
    graphed.step([(0, [1, 2])])
    key = full_key(1, CONTRACT)
    loaded.model.norm = torch.nn.Parameter(loaded.model.norm.detach().clone())  # a new address
    with pytest.raises(StaleGraphError):
        runner.replay(key, graphed.metadata([(0, [3])]))
    assert not runner.check_addresses()
    assert runner.plan(graphed.metadata([(0, [4])])).reason is FallbackReason.NOT_CAPTURED


@torch.inference_mode()
def test_unrelated_allocations_after_capture_do_not_change_replay(tiny, paged_runner):
    graphed, _ = make_pair(tiny.model, paged_runner)
    runner = make_runner(tiny.model, graphed.kv_caches, piece=())
    for seq in range(8):
        graphed.step([(seq, [9, 8, 7])])
    meta = graphed.metadata([(s, [1]) for s in range(8)])
    first = runner.replay(full_key(8, CONTRACT), meta)
    junk = [torch.randn(256, 1024) for _ in range(64)]
    del junk[::2]
    second = runner.replay(full_key(8, CONTRACT), meta)
    torch.testing.assert_close(first, second)


@torch.inference_mode()
def test_mixed_prefill_and_decode_batch_replays_piecewise(tiny, paged_runner):
    graphed, eager = make_pair(tiny.model, paged_runner)
    runner = make_runner(tiny.model, graphed.kv_caches)
    for seq in range(3):
        graphed.step([(seq, [3, 4, 5, 6])])
        eager.step([(seq, [3, 4, 5, 6])])
    batch = [(0, [8]), (1, [9]), (2, [10, 11, 12]), (3, list(range(20, 40)))]
    ours, decision = runner.execute(graphed.metadata(batch))
    assert decision.key == piecewise_key(32, CONTRACT)
    torch.testing.assert_close(ours, eager.step(batch), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_every_key_including_the_largest_passes_the_canary(tiny, paged_runner):
    graphed, _ = make_pair(tiny.model, paged_runner)
    runner = make_runner(tiny.model, graphed.kv_caches)
    blocks = graphed.free[:400]
    g = torch.Generator().manual_seed(4)
    results = [
        run_canary(runner, key, blocks, graphed.block_size, 256, CanaryThresholds(), g)
        for key in runner.captured_keys()
    ]
    assert results[0].key == full_key(32, CONTRACT)  # largest first
    failed = [(r.key.label(), r.reason) for r in results if not r.passed]
    assert failed == []
    assert all(r.rows_compared >= 1 for r in results)


@torch.inference_mode()
def test_canary_catches_a_graph_that_diverges_from_eager(tiny, paged_runner):
    graphed, _ = make_pair(tiny.model, paged_runner)
    runner = make_runner(tiny.model, graphed.kv_caches, full=(4,), piece=())
    runner.logits_buf.fill_(0)
    key = full_key(4, CONTRACT)
    runner.graphs[key].replay = lambda: None  # a graph that no longer computes anything
    result = run_canary(runner, key, graphed.free[:100], graphed.block_size, 256, CanaryThresholds(), torch.Generator().manual_seed(0))
    assert not result.passed and "relative logit error" in result.reason


@torch.inference_mode()
def test_injected_capture_failure_is_recorded_and_falls_back(tiny, paged_runner):
    graphed, _ = make_pair(tiny.model, paged_runner)

    def fault(key):
        if key == full_key(8, CONTRACT):
            raise RuntimeError("injected capture failure")

    runner = make_runner(tiny.model, graphed.kv_caches, piece=(), capture_fault=fault)
    failed = [c for c in runner.captures.values() if not c.ok]
    assert [(c.key, c.error) for c in failed] == [(full_key(8, CONTRACT), "RuntimeError: injected capture failure")]
    meta = graphed.metadata([(s, [1]) for s in range(6)])
    _, decision = runner.execute(meta)
    assert decision.key is None and decision.reason is FallbackReason.NOT_CAPTURED


def test_capture_outside_the_window_is_refused(tiny, paged_runner):
    graphed, _ = make_pair(tiny.model, paged_runner)
    runner = GraphRunner(tiny.model, graphed.kv_caches, mode=GraphMode.FULL, full_sizes=[1], piecewise_sizes=[],
                         contract=CONTRACT, max_blocks_per_seq=WIDTH)
    with pytest.raises(CaptureWindowError):
        runner._capture_key(full_key(1, CONTRACT))


@torch.inference_mode()
@torch.inference_mode()
def test_a_recapture_after_replays_writes_into_no_real_kv_block(tiny, paged_runner):
    """invalidate() then capture_all() on a serving runner: the capture runs each FULL key's forward
    pass, which writes K/V through the static slot mapping. That mapping must not be the last
    replayed batch's: its blocks may have been freed and handed to other requests since."""
    g = torch.Generator().manual_seed(6)
    graphed, _ = make_pair(tiny.model, paged_runner)
    runner = make_runner(tiny.model, graphed.kv_caches, mode=GraphMode.FULL, full=(4, 8), piece=())
    batch = list(enumerate(prompts(6, g)))
    for seq, tokens in batch:
        runner.execute(graphed.metadata([(seq, tokens)]))  # prefill (eager: FULL keys only)
    _, decision = runner.execute(graphed.metadata([(s, [5]) for s in range(6)]))
    assert decision.key == full_key(8, CONTRACT)  # the static slot mapping now names 6 real slots
    # the sequences finish; their blocks go to other requests, which write K/V of their own there
    for cache in graphed.kv_caches:
        cache.fill_(7.0)
    runner.invalidate("recapture requested")
    runner.capture_all()
    for cache in graphed.kv_caches:
        others = torch.cat([cache[:, :NULL_BLOCK], cache[:, NULL_BLOCK + 1:]], dim=1)
        assert torch.equal(others, torch.full_like(others, 7.0))
    assert sorted(k.num_reqs for k in runner.captured_keys()) == [4, 8]


def test_reconfigure_recaptures_new_sizes_on_the_same_runner_and_replays_like_eager(tiny, paged_runner):
    """A recapture with other sizes: graphs and stats dropped, keys and static buffers of the new
    configuration, a disable undone, the capture fault replaced, and ``generation`` moving on."""
    g = torch.Generator().manual_seed(5)
    graphed, eager = make_pair(tiny.model, paged_runner)
    runner = make_runner(tiny.model, graphed.kv_caches, mode=GraphMode.FULL, full=(1, 2, 4), piece=())
    assert runner.q_buf is None and runner.logits_buf.shape[0] == 4
    runner.disable(FallbackReason.DEGRADED)
    generation = runner.generation

    def fault(key):
        if key == piecewise_key(8, CONTRACT):
            raise RuntimeError("injected capture failure")

    runner.reconfigure(GraphMode.FULL_AND_PIECEWISE, [8, 2], [16, 8], capture_fault=fault)
    assert runner.generation > generation
    assert not runner.graphs and not runner.captures and runner.stats.replays == {}
    assert runner.enabled and runner.full_sizes == [2, 8] and runner.piecewise_sizes == [8, 16]
    assert runner.logits_buf.shape[0] == 8 and runner.q_buf.shape[0] == 16
    generation = runner.generation
    runner.capture_all()
    assert runner.generation > generation
    assert sorted(k.label() for k in runner.captured_keys()) == sorted(
        k.label() for k in (full_key(8, CONTRACT), full_key(2, CONTRACT), piecewise_key(16, CONTRACT)))
    vocab = tiny.config.vocab_size
    for seq, n in enumerate((5, 11, 3, 10, 7, 12)):  # prefill: piecewise-16 above 8 tokens, eager up to 8 (failed)
        tokens = torch.randint(0, vocab, (n,), generator=g).tolist()
        ours, decision = runner.execute(graphed.metadata([(seq, tokens)]))
        if n > 8:
            assert decision.key == piecewise_key(16, CONTRACT)
        else:
            assert decision.key is None and decision.reason is FallbackReason.NOT_CAPTURED
        torch.testing.assert_close(ours, eager.step([(seq, tokens)]), rtol=1e-5, atol=1e-5)
    step = [(s, [9]) for s in range(6)]
    ours, decision = runner.execute(graphed.metadata(step))
    assert decision.key == full_key(8, CONTRACT)
    torch.testing.assert_close(ours, eager.step(step), rtol=1e-5, atol=1e-5)
    assert runner.check_addresses()


def test_reconfigure_during_a_capture_is_refused(tiny, paged_runner):
    graphed, _ = make_pair(tiny.model, paged_runner)
    runner = GraphRunner(tiny.model, graphed.kv_caches, mode=GraphMode.FULL, full_sizes=[1], piecewise_sizes=[],
                         contract=CONTRACT, max_blocks_per_seq=WIDTH,
                         capture_fault=lambda key: runner.reconfigure(GraphMode.FULL, [2], []))
    with torch.inference_mode():
        [result] = runner.capture_all()
    assert not result.ok and result.error.startswith("CaptureWindowError: reconfigure refused")
    assert runner.full_sizes == [1] and runner.keys == [full_key(1, CONTRACT)]


@torch.inference_mode()
def test_plan_remembers_a_decision_only_while_the_captured_keys_stay(tiny, paged_runner):
    """plan() keeps its decision per batch shape; dropping a key, the online canary's divergence,
    disabling and recapturing each change the answer at once."""
    graphed, _ = make_pair(tiny.model, paged_runner)
    runner = make_runner(tiny.model, graphed.kv_caches, full=(1, 2), piece=())
    graphed.step([(0, [1, 2]), (1, [3, 4])])
    decode = graphed.metadata([(0, [5]), (1, [6])])
    key = full_key(2, CONTRACT)
    assert runner.plan(decode).key == key and runner.plan(decode) is runner.plan(decode)
    runner.drop(key, "test")
    assert runner.plan(decode).reason is FallbackReason.NOT_CAPTURED
    runner.capture_all()
    assert runner.plan(decode).key == key
    runner.diverged[key] = "test"
    runner.graphs.pop(key)
    assert runner.plan(decode).reason is FallbackReason.CANARY_DIVERGENCE
    runner.capture_all()
    assert runner.plan(decode).key == key
    runner.disable(FallbackReason.DEGRADED)
    assert runner.plan(decode).key is None
