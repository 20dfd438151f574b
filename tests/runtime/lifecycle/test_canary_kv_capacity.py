"""A transient full KV cache must not cost the graphs for good (issue 19, item 4).

The canary runs its batches over KV blocks reserved for it when the KV cache is sized, so a
recapture while requests hold every other block still proves every key; a cache too small to spare
any makes the canary a capacity shortfall (never a divergence), retried between engine steps until
requests have freed blocks, a bounded number of times. Emulated graphs on the CPU, a random-weight
preset, the real engine and its loop (runtime/graphs/canary.py, "KV blocks").
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from graphserving.contract.graph_policy import GraphMode  # noqa: E402
from graphserving.contract.report import CanaryResult, KeyReport, Phase  # noqa: E402
from graphserving.contract.worker_config import EngineLimits, GraphConfig, ReadinessPolicy, WorkerConfig  # noqa: E402
from graphserving.runtime.engine.async_engine import AsyncLLMEngine  # noqa: E402
from graphserving.runtime.engine.block_manager import BlockManager, NoFreeBlocksError  # noqa: E402
from graphserving.runtime.engine.sequence import SamplingParams  # noqa: E402
from graphserving.runtime.graphs.key import GraphRuntimeMode  # noqa: E402
from graphserving.runtime.lifecycle.outcome import decide_outcome, passing_keys  # noqa: E402
from graphserving.runtime.lifecycle.phases import CANARY_NOT_RUN, CANARY_PENDING, WorkerLifecycle  # noqa: E402
from graphserving.runtime.model.loader import LoadedModel  # noqa: E402
from tiny_preset import tiny_loaded  # noqa: E402

GRAPHS = GraphConfig(capture_sizes=[1, 2, 4], piecewise_capture_sizes=[16, 64])
RECAPTURE = GraphConfig(capture_sizes=[1, 2, 4], piecewise_capture_sizes=[32, 64])
#: Five keys: FULL 4, 2, 1 and PIECEWISE 64, 32 (16) after the recapture.
NUM_KEYS = 5
#: The canary of FULL 4 needs 4 rows x 2 blocks, of PIECEWISE 64 3 decode rows + 5 blocks (a
#: 61-token chunk over a block of context); the reserve is the larger: 8 blocks.
RESERVE = 8
#: A wait bound for the engine loop's retries (each takes well under a second here).
WAIT_S = 60


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return tiny_loaded()


def lifecycle(tiny, num_kv_blocks: int, **kwargs) -> WorkerLifecycle:
    """A lifecycle run to its outcome on emulated graphs (a few tenths of a second)."""
    limits = EngineLimits(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=num_kv_blocks, block_size=16)
    config = WorkerConfig(model_name="tiny", model_path="tiny", engine=limits, graphs=GRAPHS)
    lc = WorkerLifecycle(config, tiny, emulate_graphs=True, **kwargs)
    lc.run()
    assert lc.phase is Phase.READY, lc.readiness.reason
    return lc


def hold_every_block(lc: WorkerLifecycle) -> list[int]:
    """Step four long greedy requests until they hold every free KV block; returns those blocks."""
    engine, bm = lc.engine, lc.engine.block_manager
    for i in range(4):
        engine.add_request(f"fill-{i}", [(7 * i + j) % 300 for j in range(100)],
                           SamplingParams(max_tokens=150, temperature=0, ignore_eos=True))
    for _ in range(300):
        engine.step()
        if bm.num_free_blocks == 0:
            break
    engine.flush()  # what the loop does before a call (a pipelined run must not overlap it)
    assert bm.num_free_blocks == 0 and engine.scheduler.num_running >= 1 and engine.num_requests == 4
    return sorted(b for table in bm.block_tables.values() for b in table)


def wait_for(condition, what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


# ---------------------------------------------------------------------- the reserve

def test_the_canary_reserve_is_set_aside_at_sizing_and_never_given_to_requests(tiny):
    lc = lifecycle(tiny, 64)
    bm = lc.engine.block_manager
    assert len(bm.reserved_blocks) == RESERVE
    assert bm.num_total_blocks == 63 - RESERVE and bm.capacity_tokens == (63 - RESERVE) * 16
    assert lc.engine.max_model_len == 256  # the reserve leaves the model's context servable
    live = hold_every_block(lc)
    assert not set(live) & set(bm.reserved_blocks)
    assert len(live) == bm.num_total_blocks


def test_a_worker_without_graphs_reserves_no_kv_blocks(tiny):
    config = WorkerConfig(model_name="tiny", model_path="tiny",
                          engine=EngineLimits(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16),
                          graphs=GraphConfig(mode=GraphMode.NONE))
    cpu = WorkerLifecycle(config.model_copy(update={"graphs": GRAPHS}), tiny)  # no CUDA, no emulation
    cpu.run()
    none = WorkerLifecycle(config, tiny, emulate_graphs=True)
    none.run()
    for lc in (cpu, none):
        assert lc.engine.block_manager.reserved_blocks == [] and lc.engine.block_manager.num_total_blocks == 63


def test_a_recapture_while_requests_hold_every_kv_block_still_proves_every_key(tiny):
    lc = lifecycle(tiny, 64)
    engine = lc.engine
    live = hold_every_block(lc)
    index = torch.tensor(live)
    before = [cache[:, index].clone() for cache in engine.kv_caches]

    report = lc.recapture(RECAPTURE)

    assert report.phase is Phase.READY and lc.readiness.ready, report.failure_reason or report.degraded_reason
    assert report.coverage == 1.0 and report.canary_failures == 0
    assert [(k.kind, k.size) for k in report.keys] == [
        ("FULL", 4), ("FULL", 2), ("FULL", 1), ("PIECEWISE", 64), ("PIECEWISE", 32)]
    assert all(k.canary is not None and k.canary.passed and k.eager_reason is None for k in report.keys)
    assert len(lc.runner.captured_keys()) == NUM_KEYS
    # the canary wrote only into its reserve: the live requests' K/V are untouched
    for cache, saved in zip(engine.kv_caches, before):
        assert torch.equal(cache[:, index], saved)
    # and the requests run to their end on the new graphs, every block then free again
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    assert sum(lc.runner.stats.replays.values()) > 0


# ---------------------------------------------------------------------- no block to spare

def test_without_a_block_to_spare_a_full_cache_is_a_capacity_shortfall_retried_once_requests_finish(tiny):
    # 16 usable blocks hold exactly one sequence of the model's 256 tokens: nothing to reserve
    lc = lifecycle(tiny, 17, canary_retry_delays_s=(0.1, 0.1, 0.1, 0.1, 0.1, 0.1))
    assert lc.engine.block_manager.reserved_blocks == []
    hold_every_block(lc)

    report = lc.recapture(RECAPTURE)

    # not a divergence, not Failed: degraded (kept out of traffic by the policy) and retrying
    assert report.phase is Phase.DEGRADED and not lc.readiness.ready
    assert report.failure_reason is None and report.canary_failures == 0 and report.canary_passed()
    assert report.coverage == 0.0
    assert "canary not run for 5 keys" in report.degraded_reason
    assert "no free KV blocks" in report.degraded_reason and "not a divergence" in report.degraded_reason
    assert "retry 1/6 in 0.1 s" in report.degraded_reason and "canary failed" not in report.degraded_reason
    assert [(k.canary, k.eager_reason) for k in report.keys] == [(None, CANARY_PENDING)] * NUM_KEYS
    assert lc.runner.captured_keys() == []  # unproven graphs are never replayed

    loop = AsyncLLMEngine(lc.engine)
    loop.start()
    try:
        lc.attach_loop(loop.call_in_loop)  # the loop finishes the requests; a retry then recaptures
        wait_for(lambda: lc.phase is Phase.READY, "the retried canary")
    finally:
        loop.shutdown()
    report = lc.report()
    assert lc.readiness.ready and report.coverage == 1.0 and report.canary_failures == 0
    assert all(k.canary.passed and k.eager_reason is None for k in report.keys)
    assert [p.phase.value for p in report.phases][-6:] == [
        "Recapturing", "Canary", "Degraded", "Recapturing", "Canary", "Ready"]


def test_the_retries_are_bounded_and_the_keys_end_with_a_distinct_reason(tiny):
    lc = lifecycle(tiny, 17, canary_retry_delays_s=(0.05, 0.05))
    hold_every_block(lc)
    lc.recapture(RECAPTURE)
    # a loop that is not running runs each call at once, in the caller's thread; nothing steps,
    # so the requests keep every block through both retries
    idle = AsyncLLMEngine(lc.engine)
    lc.attach_loop(idle.call_in_loop)
    wait_for(lambda: "no retry left" in (lc.report().degraded_reason or ""), "the last retry")
    report = lc.report()
    assert report.phase is Phase.DEGRADED and not lc.readiness.ready and report.failure_reason is None
    assert "no retry left of 2; a recapture tries again" in report.degraded_reason
    assert [(k.canary, k.eager_reason) for k in report.keys] == [(None, CANARY_NOT_RUN)] * NUM_KEYS
    assert report.canary_failures == 0 and report.canary_passed()
    assert lc.engine.num_requests == 4  # nothing was preempted to make room


def test_a_new_recapture_starts_its_own_retries(tiny):
    lc = lifecycle(tiny, 17, canary_retry_delays_s=(0.05,))
    hold_every_block(lc)
    lc.recapture(RECAPTURE)
    idle = AsyncLLMEngine(lc.engine)
    lc.attach_loop(idle.call_in_loop)
    wait_for(lambda: "no retry left" in (lc.report().degraded_reason or ""), "the last retry")
    report = lc.recapture(GRAPHS)
    assert "retry 1/1 in 0.05 s" in report.degraded_reason
    assert [k.eager_reason for k in report.keys] == [CANARY_PENDING] * NUM_KEYS
    lc.start_draining()  # calls off the retry it scheduled


# ---------------------------------------------------------------------- the pure parts

def outcome(policy, passing, unproven, problems=()):
    return decide_outcome(policy, GraphMode.FULL_AND_PIECEWISE, graphs_available=True, configured=4,
                          passing=passing, captured_modes={GraphRuntimeMode.FULL} if passing else set(),
                          problems=list(problems), unproven=unproven, unproven_reason="canary not run: no blocks")


def test_keys_short_only_of_kv_blocks_degrade_the_worker_and_never_fail_it():
    pending = [GraphRuntimeMode.FULL, GraphRuntimeMode.PIECEWISE]
    out = outcome(ReadinessPolicy(), passing=2, unproven=pending)
    assert (out.phase, out.ready, out.failure_reason) == (Phase.DEGRADED, False, None)
    assert out.degraded_reason == "coverage 0.50 < minCoverage 1.00; canary not run: no blocks"
    allowed = outcome(ReadinessPolicy(allow_degraded=True), passing=2, unproven=pending)
    assert (allowed.phase, allowed.ready) == (Phase.DEGRADED, True)


def test_a_worker_that_falls_short_even_if_its_unproven_keys_passed_fails():
    # one key failed its capture: even with the unproven key passing, 3/4 < 1
    out = outcome(ReadinessPolicy(), passing=2, unproven=[GraphRuntimeMode.PIECEWISE],
                  problems=["capture of full-t1-r1 failed: boom"])
    assert out.phase is Phase.FAILED and not out.ready
    assert out.failure_reason == ("coverage 0.50 < minCoverage 1.00; canary not run: no blocks; "
                                  "capture of full-t1-r1 failed: boom (allowDegraded is false)")


def test_a_key_that_runs_eagerly_does_not_count_as_passing():
    passed = CanaryResult(passed=True, max_relative_logit_error=0.0, top1_agreement=1.0)
    keys = [KeyReport(kind="FULL", size=1, captured=True, canary=passed),
            KeyReport(kind="FULL", size=2, captured=True),
            KeyReport(kind="FULL", size=4, captured=True, eager_reason=CANARY_PENDING),
            KeyReport(kind="PIECEWISE", size=16, captured=True, canary=passed, eager_reason="canary_divergence")]
    assert passing_keys(keys) == 2


def test_reserved_blocks_leave_the_free_list_and_no_sequence_gets_them():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.reserve(2) == [1, 2]
    assert (bm.num_total_blocks, bm.num_free_blocks, bm.num_used_blocks, bm.capacity_tokens) == (3, 3, 0, 12)
    assert bm.allocate("a", 12) == [3, 4, 5]
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("b", 1)
    bm.free("a")
    assert bm.reserved_blocks == [1, 2] and bm.num_free_blocks == 3


def test_reserving_more_blocks_than_are_free_is_refused_and_reserves_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 8)
    with pytest.raises(ValueError, match="cannot reserve 2 KV blocks: 1 are free"):
        bm.reserve(2)
    assert bm.reserved_blocks == [] and bm.num_free_blocks == 1
