"""FULL graphs of speculative verification batches (query length k + 1) on the CPU capture backend.

A runner built with ``num_speculative_tokens = k`` captures FULL keys of query lengths 1 and
``k + 1`` at every full capture size (runtime/graphs/key.py). A verification batch (R requests of
``k + 1`` token rows, every row producing logits, ForwardMetadata ``uniform_query_len``) replays
the ``k + 1`` key, padded to its request count, and must equal eager execution of the same tokens
as a chunked-prefill batch; the canaries (pre-ready and online) prove those keys like any other.
The emulated backend re-runs the captured callable on the static buffers only, as a CUDA graph
replays (runtime/graphs/backend.py); tests/runtime/graphs/test_spec_cuda_graphs.py is the GPU run.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from graphserving.contract.graph_policy import GraphMode  # noqa: E402
from graphserving.contract.worker_config import CanaryThresholds  # noqa: E402
from graphserving.runtime.graphs.canary import canary_batch_for, canary_blocks_needed, run_canary  # noqa: E402
from graphserving.runtime.graphs.key import (  # noqa: E402
    FallbackReason,
    GraphKeyContract,
    full_key,
    piecewise_key,
)
from graphserving.runtime.graphs.online_canary import OnlineCanary  # noqa: E402
from graphserving.runtime.graphs.runner import GraphRunner  # noqa: E402
from graphserving.runtime.model.kv_layout import NULL_BLOCK  # noqa: E402
from graphserving.runtime.model.loader import load_model  # noqa: E402

CONTRACT = GraphKeyContract(model_revision="test", dtype="float32")
WIDTH = 24
K = 2  # draft tokens: verification batches have q = 3 rows per request
Q = K + 1


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir("llama3_rope"), revision=None, dtype=torch.float32, device="cpu").model


def spec_runner(model, kv_caches, full=(1, 2, 4, 8), piece=(8, 16, 32), k=K, capture=True):
    mode = GraphMode.FULL_AND_PIECEWISE if piece else GraphMode.FULL
    runner = GraphRunner(model, kv_caches, mode=mode, full_sizes=list(full), piecewise_sizes=list(piece),
                         contract=CONTRACT, max_blocks_per_seq=WIDTH, num_speculative_tokens=k)
    if capture:
        with torch.inference_mode():
            runner.capture_all()
    return runner


def pair(model, paged_runner):
    """A paged runner for graphs and one for the eager reference, with identical block tables."""
    return (paged_runner(model, num_blocks=400, table_width=WIDTH, seed=1),
            paged_runner(model, num_blocks=400, table_width=WIDTH, seed=1))


def verification(meta, q=Q):
    """``meta`` (R requests of ``q`` tokens each) as a verification batch: every row samples."""
    return dataclasses.replace(meta, logits_indices=torch.arange(meta.num_tokens), uniform_query_len=q)


def reference_logits(eager, batch):
    """The same tokens as a chunked-prefill batch (the general attention path), every row's logits."""
    meta = eager.metadata(batch)
    meta = dataclasses.replace(meta, logits_indices=torch.arange(meta.num_tokens))
    hidden = eager.model(meta, eager.kv_caches)
    return eager.model.compute_logits(hidden[meta.logits_indices])


def prefill_both(graphed, eager, runner, n, generator):
    for seq in range(n):
        tokens = torch.randint(0, 49152, (int(torch.randint(3, 14, (1,), generator=generator)),),
                               generator=generator).tolist()
        runner.execute(graphed.metadata([(seq, tokens)]))
        eager.step([(seq, tokens)])


def drafts(seqs, generator, q=Q):
    return [(s, torch.randint(0, 49152, (q,), generator=generator).tolist()) for s in seqs]


def assert_same_caches(ours, reference):
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine[:, NULL_BLOCK + 1:], theirs[:, NULL_BLOCK + 1:], rtol=1e-5, atol=1e-5)


def test_a_spec_runner_configures_both_query_lengths_and_sizes_its_buffers_for_k_plus_1_rows(tiny, paged_runner):
    graphed, _ = pair(tiny, paged_runner)
    runner = spec_runner(tiny, graphed.kv_caches, capture=False)
    full = [(k.num_tokens, k.num_reqs, k.uniform_query_len) for k in runner.keys if k.num_reqs]
    assert full == [(24, 8, 3), (12, 4, 3), (8, 8, 1), (6, 2, 3), (4, 4, 1), (3, 1, 3), (2, 2, 1), (1, 1, 1)]
    assert runner.uniform_query_lens == (1, Q)
    assert runner.logits_buf.shape == (8 * Q, tiny.config.vocab_size)
    assert runner.buffers.max_tokens == 32  # the largest piecewise size is above 8 * 3
    assert spec_runner(tiny, graphed.kv_caches, piece=(), capture=False).buffers.max_tokens == 24


def test_a_negative_speculative_length_is_refused(tiny, paged_runner):
    graphed, _ = pair(tiny, paged_runner)
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 0"):
        spec_runner(tiny, graphed.kv_caches, k=-1, capture=False)


@torch.inference_mode()
def test_verification_batches_replay_the_q3_key_padded_and_equal_eager(tiny, paged_runner):
    """3 requests pad to the key of 4 (one padded request of 3 rows), then 7 to 8 and 3 again, the
    buffers poisoned before each replay: logits of every row and the KV cache equal eager."""
    g = torch.Generator().manual_seed(7)
    graphed, eager = pair(tiny, paged_runner)
    runner = spec_runner(tiny, graphed.kv_caches)
    prefill_both(graphed, eager, runner, 8, g)
    padded_before = runner.stats.padded_rows
    for seqs, size in (([0, 3, 5], 4), (list(range(7)), 8), ([1, 2, 6], 4)):
        batch = drafts(seqs, g)
        runner.buffers.poison(torch.Generator().manual_seed(size))
        ours, decision = runner.execute(verification(graphed.metadata(batch)))
        assert decision.key == full_key(size, CONTRACT, Q)
        assert ours.shape == (len(seqs) * Q, tiny.config.vocab_size)
        torch.testing.assert_close(ours, reference_logits(eager, batch), rtol=1e-5, atol=1e-5)
        assert_same_caches(graphed.kv_caches, eager.kv_caches)
    full = {label: n for label, n in runner.stats.replays.items() if label.startswith("full")}
    assert full == {"full-t12-r4-q3": 2, "full-t24-r8-q3": 1}
    assert runner.stats.padded_rows - padded_before == 3 * Q  # one padded request of 3 rows per replay


@torch.inference_mode()
def test_the_static_buffers_of_a_q3_key_pad_whole_requests(tiny, paged_runner):
    g = torch.Generator().manual_seed(8)
    graphed, eager = pair(tiny, paged_runner)
    runner = spec_runner(tiny, graphed.kv_caches)
    prefill_both(graphed, eager, runner, 3, g)
    runner.buffers.poison(torch.Generator().manual_seed(1))
    meta = verification(graphed.metadata(drafts([0, 1, 2], g)))
    view = runner.buffers.fill_full(meta, 4, Q)
    assert (view.num_tokens, view.num_reqs, view.max_query_len, view.uniform_query_len) == (12, 4, 3, 3)
    assert view.input_ids[:9].tolist() == meta.input_ids.tolist()
    assert view.slot_mapping[:9].tolist() == meta.slot_mapping.tolist()
    assert view.slot_mapping[9:].tolist() == [-1] * 3 and view.positions[9:].tolist() == [0] * 3
    assert view.input_ids[9:].tolist() == [0] * 3
    assert view.seq_lens.tolist() == meta.seq_lens.tolist() + [0]
    assert view.query_lens.tolist() == [3] * 4 and view.query_start_loc.tolist() == [0, 3, 6, 9, 12]
    assert view.logits_indices.tolist() == list(range(12))
    assert (view.block_table[3] == NULL_BLOCK).all()


def test_fill_full_refuses_a_batch_of_another_query_length(tiny, paged_runner):
    graphed, _ = pair(tiny, paged_runner)
    runner = spec_runner(tiny, graphed.kv_caches, capture=False)
    decode = graphed.metadata([(0, [1]), (1, [2])])
    with pytest.raises(ValueError, match="exactly 3 token rows per request"):
        runner.buffers.fill_full(decode, 2, Q)
    last_rows_only = graphed.metadata([(2, [1, 2, 3]), (3, [4, 5, 6])])
    with pytest.raises(ValueError, match="samples every token row once"):
        runner.buffers.fill_full(last_rows_only, 2, Q)


@torch.inference_mode()
def test_decode_on_a_spec_runner_takes_the_q1_key(tiny, paged_runner):
    g = torch.Generator().manual_seed(9)
    graphed, eager = pair(tiny, paged_runner)
    runner = spec_runner(tiny, graphed.kv_caches)
    prefill_both(graphed, eager, runner, 3, g)
    step = [(s, [40 + s]) for s in range(3)]
    ours, decision = runner.execute(graphed.metadata(step))
    assert decision.key == full_key(4, CONTRACT)
    torch.testing.assert_close(ours, eager.step(step), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_a_verification_batch_above_the_largest_full_size_replays_piecewise_like_eager(tiny, paged_runner):
    g = torch.Generator().manual_seed(10)
    graphed, eager = pair(tiny, paged_runner)
    runner = spec_runner(tiny, graphed.kv_caches)
    prefill_both(graphed, eager, runner, 9, g)
    batch = drafts(range(9), g)  # 27 token rows: more requests than the largest full size
    ours, decision = runner.execute(verification(graphed.metadata(batch)))
    assert decision.key == piecewise_key(32, CONTRACT)
    torch.testing.assert_close(ours, reference_logits(eager, batch), rtol=1e-5, atol=1e-5)
    assert_same_caches(graphed.kv_caches, eager.kv_caches)


@torch.inference_mode()
def test_a_prefill_whose_rows_do_not_all_sample_is_not_dispatched_to_the_q3_key(tiny, paged_runner):
    graphed, _ = pair(tiny, paged_runner)
    runner = spec_runner(tiny, graphed.kv_caches, piece=())
    decision = runner.plan(graphed.metadata([(0, [1, 2, 3]), (1, [4, 5, 6])]))  # last rows sample only
    assert decision.key is None and decision.reason is FallbackReason.NOT_UNIFORM_DECODE


@torch.inference_mode()
def test_multi_step_decoding_refuses_a_verification_batch(tiny, paged_runner):
    g = torch.Generator().manual_seed(11)
    graphed, eager = pair(tiny, paged_runner)
    runner = spec_runner(tiny, graphed.kv_caches)
    prefill_both(graphed, eager, runner, 2, g)
    meta = verification(graphed.metadata(drafts([0, 1], g)))
    runner.execute(meta)
    with pytest.raises(ValueError, match="multi-step decoding advances decode batches only"):
        runner.resident_decode_view(meta)


def test_reconfigure_keeps_the_speculative_length_unless_given(tiny, paged_runner):
    graphed, _ = pair(tiny, paged_runner)
    runner = spec_runner(tiny, graphed.kv_caches, capture=False)
    runner.reconfigure(GraphMode.FULL, [2, 4], [])
    assert {k.uniform_query_len for k in runner.keys} == {1, Q}
    assert runner.logits_buf.shape[0] == 4 * Q
    runner.reconfigure(GraphMode.FULL, [2, 4], [], num_speculative_tokens=0)
    assert {k.uniform_query_len for k in runner.keys} == {1} and runner.logits_buf.shape[0] == 4
    runner.reconfigure(GraphMode.FULL, [2], [], num_speculative_tokens=4)
    assert full_key(2, CONTRACT, 5) in runner.keys and runner.logits_buf.shape[0] == 10


@torch.inference_mode()
def test_every_key_of_a_spec_runner_passes_the_canary_on_a_verification_batch(tiny, paged_runner):
    graphed, _ = pair(tiny, paged_runner)
    runner = spec_runner(tiny, graphed.kv_caches)
    g = torch.Generator().manual_seed(12)
    results = [run_canary(runner, key, graphed.free[:300], graphed.block_size, 256, CanaryThresholds(), g)
               for key in runner.captured_keys()]
    assert [r.key for r in results] == runner.keys
    assert [(r.key.label(), r.reason) for r in results if not r.passed] == []
    by_key = {r.key: r for r in results}
    assert by_key[full_key(8, CONTRACT, Q)].rows_compared == 8 * Q  # every token row of the key
    assert by_key[full_key(8, CONTRACT)].rows_compared == 8


def test_the_canary_batch_of_a_q3_key_is_a_verification_batch_filling_the_key(tiny, paged_runner):
    key = full_key(4, CONTRACT, Q)
    block_size, model_len = 2, 256  # q = 3 rows span two blocks: a request takes up to 3
    needed = canary_blocks_needed(key, block_size, model_len)
    assert needed == 4 * 3
    meta = canary_batch_for(key, list(range(1, needed + 1)), block_size, 100, model_len, torch.device("cpu"),
                            torch.Generator().manual_seed(0))
    assert (meta.num_reqs, meta.num_tokens, meta.uniform_query_len, meta.max_query_len) == (4, 12, 3, 3)
    assert meta.query_lens.tolist() == [3] * 4 and meta.logits_indices.tolist() == list(range(12))
    assert len(set(meta.slot_mapping.tolist())) == 12
    few = canary_batch_for(key, [1, 2, 3], block_size, 100, model_len, torch.device("cpu"),
                           torch.Generator().manual_seed(0))
    assert few.num_reqs == 1 and few.num_tokens == 3  # fewer free blocks: fewer requests, padded to the key
    assert canary_blocks_needed(full_key(4, CONTRACT), 4, 256) == 8  # decode keys: 2 blocks a request, as before


@torch.inference_mode()
def test_the_canary_catches_a_q3_graph_that_diverges(tiny, paged_runner):
    graphed, _ = pair(tiny, paged_runner)
    runner = spec_runner(tiny, graphed.kv_caches, full=(4,), piece=())
    key = full_key(4, CONTRACT, Q)
    original = runner.graphs[key].replay

    def replay():  # the graph's last request row gets stale logits
        original()
        runner.logits_buf[9:12] = 0

    runner.graphs[key].replay = replay
    result = run_canary(runner, key, graphed.free[:100], graphed.block_size, 256, CanaryThresholds(),
                        torch.Generator().manual_seed(0))
    assert not result.passed and "relative logit error" in result.reason


@torch.inference_mode()
def test_the_online_canary_compares_verification_replays_and_drops_a_diverging_key(tiny, paged_runner):
    g = torch.Generator().manual_seed(13)
    graphed, eager = pair(tiny, paged_runner)
    runner = spec_runner(tiny, graphed.kv_caches)
    seen = []
    runner.online_canary = OnlineCanary(CanaryThresholds(sample_rate=1.0), torch.float32, seed=0,
                                        on_divergence=lambda key, result: seen.append(key))
    prefill_both(graphed, eager, runner, 3, g)
    key = full_key(4, CONTRACT, Q)
    batch = drafts([0, 1, 2], g)
    ours, decision = runner.execute(verification(graphed.metadata(batch)))
    assert decision.key == key and runner.online_canary.tallies[key].comparisons == 1 and not seen
    torch.testing.assert_close(ours, reference_logits(eager, batch), rtol=1e-5, atol=1e-5)

    original = runner.graphs[key].replay

    def replay():
        original()
        runner.logits_buf[:, 7] += 5.0

    runner.graphs[key].replay = replay
    batch = drafts([0, 1, 2], g)
    ours, decision = runner.execute(verification(graphed.metadata(batch)))
    assert decision.key == key and seen == [key] and key in runner.diverged
    torch.testing.assert_close(ours, reference_logits(eager, batch), rtol=1e-5, atol=1e-5)  # eager served
    later = runner.plan(verification(graphed.metadata(drafts([0, 1, 2], g))))
    assert later.key == piecewise_key(16, CONTRACT)
