"""The online canary: sampled replays re-run eagerly while serving (issue 19, "Canary in production").

On the CPU capture/replay backend (the same runner contract as CUDA graphs); a graph that goes
wrong after its capture is simulated by wrapping its replay.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from prometheus_client import CollectorRegistry  # noqa: E402

from graphserving.contract.graph_policy import GraphMode  # noqa: E402
from graphserving.contract.worker_config import CanaryThresholds  # noqa: E402
from graphserving.runtime.graphs.key import FallbackReason, GraphKeyContract, full_key, piecewise_key  # noqa: E402
from graphserving.runtime.graphs.metrics import GraphMetrics  # noqa: E402
from graphserving.runtime.graphs.online_canary import OnlineCanary, restore_slots, save_slots  # noqa: E402
from graphserving.runtime.graphs.runner import GraphRunner  # noqa: E402
from graphserving.runtime.model.loader import load_model  # noqa: E402

CONTRACT = GraphKeyContract(model_revision="test", dtype="float32")
WIDTH = 24


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir("llama3_rope"), revision=None, dtype=torch.float32, device="cpu")


def runner_for(model, paged, full=(1, 2, 4, 8), piece=(8, 16, 32), rate=1.0, metrics=None, diverged=None):
    mode = GraphMode.FULL_AND_PIECEWISE if piece else GraphMode.FULL
    runner = GraphRunner(model, paged.kv_caches, mode=mode, full_sizes=list(full), piecewise_sizes=list(piece),
                         contract=CONTRACT, max_blocks_per_seq=WIDTH, metrics=metrics)
    with torch.inference_mode():
        runner.capture_all()
    seen = diverged if diverged is not None else []
    runner.online_canary = OnlineCanary(CanaryThresholds(sample_rate=rate), torch.float32, seed=0, metrics=metrics,
                                        on_divergence=lambda key, result: seen.append((key, result)))
    return runner


def corrupt_logits(runner, key, amount=5.0):
    """Make ``key``'s graph add ``amount`` to one logit of every row after each replay."""
    graph = runner.graphs[key]
    original = graph.replay

    def replay():
        original()
        runner.logits_buf[:, 7] += amount

    graph.replay = replay


def prefill(paged, runner, n, length=5):
    for seq in range(n):
        runner.execute(paged.metadata([(seq, list(range(3, 3 + length)))]))


@torch.inference_mode()
def test_a_diverging_full_graph_is_caught_served_eagerly_and_taken_out_of_dispatch(tiny, paged_runner):
    paged, reference = paged_runner(tiny.model, num_blocks=300, table_width=WIDTH), paged_runner(
        tiny.model, num_blocks=300, table_width=WIDTH)
    registry = CollectorRegistry()
    seen = []
    runner = runner_for(tiny.model, paged, metrics=GraphMetrics(registry, "m"), diverged=seen)
    for seq in range(3):
        reference.step([(seq, [3, 4, 5, 6, 7])])
    prefill(paged, runner, 3)
    key = full_key(4, CONTRACT)
    corrupt_logits(runner, key)

    step = [(s, [11]) for s in range(3)]
    logits, decision = runner.execute(paged.metadata(step))
    assert decision.key == key  # it replayed, the canary sampled it and caught the corruption
    torch.testing.assert_close(logits, reference.step(step), rtol=1e-5, atol=1e-5)  # the eager result is served
    assert [k for k, _ in seen] == [key] and "relative logit error" in seen[0][1].reason
    assert key in runner.diverged and key not in runner.graphs
    tally = runner.online_canary.tallies[key]
    assert (tally.comparisons, tally.divergences) == (1, 1)

    later = [(s, [12]) for s in range(3)]
    plan = runner.plan(paged.metadata(later))
    assert plan.key == piecewise_key(8, CONTRACT)  # FULL/4 is out; the piecewise graph of the batch runs it
    full_only = runner_for(tiny.model, paged_runner(tiny.model, num_blocks=300, table_width=WIDTH), piece=())
    full_only.diverged[key] = "canary_divergence: test"
    full_only.graphs.pop(key)
    assert full_only.plan(paged.metadata([(s, [13]) for s in range(3)])).reason is FallbackReason.CANARY_DIVERGENCE

    label = {"model_name": "m", "key": key.label()}
    assert registry.get_sample_value("graphserving_graph_online_canary_comparisons_total", label) == 1
    assert registry.get_sample_value("graphserving_graph_online_canary_divergences_total", label) == 1


@torch.inference_mode()
def test_a_passing_comparison_leaves_the_replays_kv_and_logits(tiny, paged_runner):
    """The eager re-run rewrites the batch's KV slots; they are put back, so what a request sees
    does not depend on whether its step was sampled."""
    paged = paged_runner(tiny.model, num_blocks=300, table_width=WIDTH)
    runner = runner_for(tiny.model, paged)
    prefill(paged, runner, 2)
    key = full_key(2, CONTRACT)
    graph = runner.graphs[key]
    original = graph.replay
    written = {}

    def replay():  # a graph whose K/V differ from eager's in the last bits (as real kernels may)
        original()
        slots = runner.buffers.full_view(2).slot_mapping.clone()
        for i, kv in enumerate(runner.kv_caches):
            flat = kv.view(2, -1, *kv.shape[3:])
            flat[:, slots] *= 1 + 1e-6
            written[i] = flat[:, slots].clone()

    graph.replay = replay
    logits, decision = runner.execute(paged.metadata([(0, [9]), (1, [10])]))
    assert decision.key == key and key in runner.graphs and key not in runner.diverged
    assert runner.online_canary.tallies[key].comparisons == 1
    slots = runner.buffers.full_view(2).slot_mapping
    for i, kv in enumerate(runner.kv_caches):
        torch.testing.assert_close(kv.view(2, -1, *kv.shape[3:])[:, slots], written[i], rtol=0, atol=0)


@torch.inference_mode()
def test_a_piecewise_replay_is_compared_too(tiny, paged_runner):
    paged = paged_runner(tiny.model, num_blocks=300, table_width=WIDTH)
    runner = runner_for(tiny.model, paged)
    logits, decision = runner.execute(paged.metadata([(0, list(range(3, 14)))]))
    assert decision.key == piecewise_key(16, CONTRACT)
    tally = runner.online_canary.tallies[decision.key]
    assert (tally.comparisons, tally.divergences) == (1, 0)


@torch.inference_mode()
def test_a_multi_step_run_goes_eager_from_the_step_that_diverged(tiny, paged_runner):
    paged, reference = paged_runner(tiny.model, num_blocks=300, table_width=WIDTH), paged_runner(
        tiny.model, num_blocks=300, table_width=WIDTH)
    runner = runner_for(tiny.model, paged, piece=())
    for seq in range(2):
        reference.step([(seq, [3, 4, 5, 6, 7])])
    prefill(paged, runner, 2)
    step = [(0, [21]), (1, [22])]
    meta = paged.metadata(step)
    runner.execute(meta)  # replays FULL/2 (sampled, passes)
    reference.step(step)
    view, replay = runner.resident_decode_view(meta)
    key = full_key(2, CONTRACT)
    corrupt_logits(runner, key)
    view.input_ids.copy_(torch.tensor([23, 24]))  # the next step, advanced in place as advance_decode does
    view.positions.add_(1)
    view.seq_lens.add_(1)
    view.slot_mapping.copy_(paged.metadata([(0, [23]), (1, [24])]).slot_mapping)
    expected = reference.step([(0, [23]), (1, [24])])
    torch.testing.assert_close(replay(), expected, rtol=1e-5, atol=1e-5)  # diverged: eager served
    assert key in runner.diverged
    before = runner.stats.eager[FallbackReason.CANARY_DIVERGENCE]
    replay()  # the run's next step no longer replays the key
    assert runner.stats.eager[FallbackReason.CANARY_DIVERGENCE] == before + 1


@torch.inference_mode()
def test_a_capture_brings_a_diverged_key_back_and_clears_the_tallies(tiny, paged_runner):
    paged = paged_runner(tiny.model, num_blocks=300, table_width=WIDTH)
    runner = runner_for(tiny.model, paged, piece=())
    prefill(paged, runner, 1)
    key = full_key(1, CONTRACT)
    corrupt_logits(runner, key)
    runner.execute(paged.metadata([(0, [9])]))
    assert key in runner.diverged
    runner.capture_all()
    assert key in runner.graphs and not runner.diverged and runner.online_canary.tallies == {}


def test_sampling_follows_the_rate_and_is_reproducible_for_a_seed():
    def draws(rate, seed, n=20000):
        canary = OnlineCanary(CanaryThresholds(sample_rate=rate), torch.float32, seed=seed)
        return [canary.sampled() for _ in range(n)]

    assert not any(draws(0.0, 1))
    assert all(draws(1.0, 1, 100))
    hits = sum(draws(0.01, 2))
    assert 140 <= hits <= 260  # 200 expected; 5 standard deviations is about 70
    assert draws(0.01, 3) == draws(0.01, 3)


def test_default_sample_rate_is_on_and_small():
    rate = CanaryThresholds().sample_rate
    assert 0 < rate <= 0.01


@torch.inference_mode()
def test_save_and_restore_slots_round_trip_and_tolerate_padded_rows(tiny, paged_runner):
    paged = paged_runner(tiny.model, num_blocks=40, table_width=WIDTH)
    caches = paged.kv_caches
    for kv in caches:
        kv.normal_()
    before = [kv.clone() for kv in caches]
    slots = torch.tensor([17, 5, -1, 33])
    saved = save_slots(caches, slots)
    for kv in caches:
        kv.view(2, -1, *kv.shape[3:])[:, [17, 5, 33]] = 0.0
    restore_slots(caches, saved)
    for kv, old in zip(caches, before):
        torch.testing.assert_close(kv, old, rtol=0, atol=0)


def test_a_flipped_top1_token_is_a_divergence_named_by_its_rows():
    from graphserving.runtime.graphs.canary import compare_logits

    eager = torch.zeros(61, 50)
    eager[:, 5] = 10.0  # margin 10 on every row
    graph = eager.clone()
    graph[17, 9] = 20.0  # one row's top-1 token flips; the error stays under no bound either
    result = compare_logits(full_key(64, CONTRACT), eager, graph, CanaryThresholds(max_relative_logit_error=10),
                            torch.float32)
    assert not result.passed and "differs on 1 of 61 rows" in result.reason
    assert result.top1_agreement == pytest.approx(60 / 61)
    same = compare_logits(full_key(64, CONTRACT), eager, eager.clone(), CanaryThresholds(), torch.float32)
    assert same.passed and same.top1_agreement == 1.0
