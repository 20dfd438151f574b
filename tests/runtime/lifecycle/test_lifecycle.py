"""The worker lifecycle on the CPU: phases, readiness outcome, report, injected failures, recapture.

Without CUDA a graph worker can only serve eagerly: it reports Degraded ("no CUDA"), ready when the
policy allows degraded serving and kept out of traffic otherwise (nothing failed, so not Failed). With ``emulate_graphs=True`` the same lifecycle captures
and canaries on the emulated backend (runtime/graphs/backend.py), which keeps the CUDA-graph
contract, so capture, canary, fallback and recapture are exercised here without a GPU.
A tiny random Llama (2 layers) keeps each lifecycle run to a few seconds.
"""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from graphserving.contract.graph_policy import CaptureSizeError, GraphMode  # noqa: E402
from graphserving.contract.report import Phase, Progress, WorkerReport, config_hash  # noqa: E402
from graphserving.contract.worker_config import (  # noqa: E402
    EngineLimits,
    GraphConfig,
    ReadinessPolicy,
    WorkerConfig,
)
from graphserving.runtime.graphs.canary import canary_batch_for  # noqa: E402
from graphserving.runtime.graphs.key import FallbackReason, GraphRuntimeMode, full_key  # noqa: E402
from graphserving.runtime.lifecycle.outcome import NO_CUDA_REASON, decide_outcome  # noqa: E402
from graphserving.runtime.lifecycle.phases import WorkerLifecycle  # noqa: E402
from graphserving.runtime.model.loader import load_model  # noqa: E402
from graphserving.runtime.engine.sequence import SamplingParams  # noqa: E402

#: A lifecycle run of the tiny model takes seconds; this bound only keeps a hang from stalling CI.
HANG_BOUND_S = 300
LIMITS = EngineLimits(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir("llama3_rope"), revision=None, dtype=torch.float32, device="cpu")


def worker_config(model, *, allow_degraded=False, min_coverage=1.0, required_modes=(), **graphs) -> WorkerConfig:
    graphs.setdefault("capture_sizes", [1, 2, 4])
    graphs.setdefault("piecewise_capture_sizes", [16, 64])
    readiness = ReadinessPolicy(allow_degraded=allow_degraded, min_coverage=min_coverage,
                                required_modes=list(required_modes))
    return WorkerConfig(model_name="tiny", model_path="tiny", engine=LIMITS,
                        graphs=GraphConfig(readiness=readiness, **graphs))


def run_bounded(lifecycle: WorkerLifecycle) -> WorkerLifecycle:
    """Run the lifecycle in a thread and fail (instead of hanging) if it does not finish."""
    thread = threading.Thread(target=lifecycle.run, daemon=True)
    thread.start()
    thread.join(HANG_BOUND_S)
    assert not thread.is_alive(), f"the lifecycle did not finish (phase {lifecycle.phase.value})"
    return lifecycle


def key_fault(*labels: str):
    def fault(key) -> None:
        if key.label() in labels:
            raise RuntimeError(f"injected failure for {key.label()}")

    return fault


def phases(report: WorkerReport) -> list[str]:
    return [p.phase.value for p in report.phases]


# ---------------------------------------------------------------------- without CUDA

def test_without_cuda_a_graph_worker_skips_capture_and_serves_degraded_when_allowed(tiny):
    lc = run_bounded(WorkerLifecycle(worker_config(tiny, allow_degraded=True), tiny, loading_seconds=0.25))
    report = lc.report()
    assert phases(report) == ["Loading", "Warmup", "Profiling", "Canary", "Degraded"]
    assert report.phase is Phase.DEGRADED
    assert "no CUDA" in report.degraded_reason
    assert report.failure_reason is None
    assert lc.readiness.ready is True
    assert [(m.kind, m.configured, m.captured) for m in report.modes] == [
        ("FULL", [1, 2, 4], []), ("PIECEWISE", [16, 64], [])]
    assert report.keys == []
    # it still serves: every pass runs eagerly with the degraded reason
    lc.engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert dict(lc.runner.stats.eager) == {FallbackReason.DEGRADED: 3}
    assert not lc.runner.stats.replays


def test_without_cuda_a_graph_worker_is_degraded_and_not_ready_when_degraded_is_not_allowed(tiny):
    lc = run_bounded(WorkerLifecycle(worker_config(tiny, allow_degraded=False), tiny))
    report = lc.report()
    assert phases(report) == ["Loading", "Warmup", "Profiling", "Canary", "Degraded"]
    assert report.phase is Phase.DEGRADED
    assert report.degraded_reason == NO_CUDA_REASON
    assert report.failure_reason is None
    assert lc.readiness.ready is False
    assert "no CUDA" in lc.readiness.reason and "allowDegraded is false" in lc.readiness.reason


def test_mode_none_is_ready_on_the_cpu_with_full_coverage(tiny):
    lc = run_bounded(WorkerLifecycle(worker_config(tiny, mode=GraphMode.NONE), tiny))
    report = lc.report()
    assert phases(report) == ["Loading", "Warmup", "Profiling", "Canary", "Ready"]
    assert report.phase is Phase.READY and lc.readiness.ready
    assert report.coverage == 1.0
    assert report.modes == [] and report.keys == []
    lc.engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert dict(lc.runner.stats.eager) == {FallbackReason.MODE_NONE: 2}


def test_a_model_length_below_the_block_size_warms_up_and_serves(tiny):
    """max_model_len 8 with blocks of 16: the warmup's prefill chunk stays within the model."""
    config = worker_config(tiny, mode=GraphMode.NONE)
    config = config.model_copy(update={"engine": LIMITS.model_copy(update={"max_model_len": 8})})
    lc = run_bounded(WorkerLifecycle(config, tiny))
    assert lc.report().phase is Phase.READY, lc.report().failure_reason
    assert lc.engine.max_model_len == 8 and lc.runner.max_blocks_per_seq == 1
    [[choice]] = lc.engine.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(choice.token_ids) == 5


# ---------------------------------------------------------------------- emulated graphs

@pytest.fixture(scope="module")
def ready_run(tiny):
    """A lifecycle run on emulated graphs, with every report its listener saw, and its wall time."""
    seen: list[WorkerReport] = []
    lc = WorkerLifecycle(worker_config(tiny), tiny, loading_seconds=0.5, emulate_graphs=True)
    lc.listeners.append(seen.append)
    start = time.perf_counter()
    run_bounded(lc)
    return lc, seen, time.perf_counter() - start


def test_emulated_graphs_capture_every_key_pass_canary_and_make_the_worker_ready(ready_run):
    lc, _, _ = ready_run
    report = lc.report()
    assert phases(report) == ["Loading", "Warmup", "Profiling", "Capturing", "Canary", "Ready"]
    assert report.phase is Phase.READY and lc.readiness.ready
    assert report.coverage == 1.0
    assert [(m.kind, m.configured, m.captured) for m in report.modes] == [
        ("FULL", [1, 2, 4], [1, 2, 4]), ("PIECEWISE", [16, 64], [16, 64])]
    # one key report per configured key, in capture order (largest first, FULL before PIECEWISE)
    assert [(k.kind, k.size) for k in report.keys] == [
        ("FULL", 4), ("FULL", 2), ("FULL", 1), ("PIECEWISE", 64), ("PIECEWISE", 16)]
    for key in report.keys:
        assert key.captured and key.capture_seconds >= 0
        assert key.canary is not None and key.canary.passed
        assert key.canary.top1_agreement == 1.0
        assert key.canary.max_relative_logit_error <= lc.config.graphs.canary.max_relative_logit_error
        # decode step latency is measured for FULL (decode) keys only
        assert (key.decode_step_seconds is not None) == (key.kind == "FULL")
    assert report.canary_failures == 0 and report.canary_passed()
    assert report.degraded_reason is None and report.failure_reason is None
    assert report.kv_cache.num_blocks == 64 and report.kv_cache.tokens == 64 * 16
    assert report.effective_capacity_tokens_per_second > 0
    assert report.capture_seconds_max == max(k.capture_seconds for k in report.keys)


def test_capture_progress_is_reported_key_by_key(ready_run):
    lc, seen, _ = ready_run
    during = [r.progress for r in seen if r.phase is Phase.CAPTURING and r.progress is not None]
    assert during == [Progress(done=i, total=5) for i in range(1, 6)]
    assert lc.report().progress is None  # cleared once the phase is over


def test_every_phase_has_a_duration_and_together_they_fit_in_the_run(ready_run):
    lc, seen, wall = ready_run
    report = lc.report()
    assert all(p.duration_seconds is not None and p.duration_seconds >= 0 for p in report.phases)
    assert report.phase_seconds(Phase.LOADING) == 0.5
    starts = [p.started_at for p in report.phases]
    assert starts == sorted(starts)
    measured = sum(report.phase_seconds(p) for p in (Phase.WARMUP, Phase.PROFILING, Phase.CAPTURING, Phase.CANARY))
    assert 0 < measured <= wall
    # the listener saw each phase begin, in order, before the final report
    first_seen = []
    for r in seen:
        if not first_seen or first_seen[-1] != r.phase.value:
            first_seen.append(r.phase.value)
    assert first_seen == ["Warmup", "Profiling", "Capturing", "Canary", "Ready"]


def test_the_engine_is_built_over_the_graph_runner_and_its_kv_cache(ready_run):
    # the lifecycle allocates the KV cache, builds the graph runner over it and hands both to the
    # engine's constructor; the runner's block tables are as wide as the engine's max_model_len
    lc, _, _ = ready_run
    assert lc.engine.runner.graph_runner is lc.runner
    assert lc.runner.kv_caches is lc.engine.kv_caches and lc.engine.runner.kv_caches is lc.engine.kv_caches
    assert lc.engine.num_kv_blocks == LIMITS.num_kv_blocks
    assert lc.runner.max_blocks_per_seq == -(-lc.engine.max_model_len // LIMITS.block_size)


def test_the_emulated_worker_replays_graphs_when_serving(ready_run):
    lc, _, _ = ready_run
    lc.runner.stats.replays.clear()
    lc.runner.stats.eager.clear()
    # one prefill of 10 tokens (piecewise, padded to 16), then two single-request decodes (full, r1)
    lc.engine.generate([list(range(100, 110))], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert dict(lc.runner.stats.replays) == {"piecewise-t16": 1, "full-t1-r1": 2}
    assert not lc.runner.stats.eager


# ---------------------------------------------------------------------- the report contract

def test_the_report_round_trips_through_the_annotation_and_carries_the_config_hash(ready_run):
    lc, _, _ = ready_run
    report = lc.report()
    assert WorkerReport.from_annotation(report.to_annotation()) == report
    assert report.graph_config_hash == config_hash(lc.config.graphs)
    assert report.model_revision == lc.loaded.revision
    assert report.worker.pod_name is None  # outside Kubernetes


def test_every_report_has_a_higher_generation(ready_run):
    lc, seen, _ = ready_run
    generations = [r.generation for r in seen] + [lc.report().generation, lc.report().generation]
    assert generations == sorted(set(generations))
    assert len({r.worker.instance for r in seen}) == 1


# ---------------------------------------------------------------------- the outcome decision

FULL, PIECE = GraphRuntimeMode.FULL, GraphRuntimeMode.PIECEWISE


def outcome(policy=None, mode=GraphMode.FULL_AND_PIECEWISE, graphs=True, configured=10, passing=10,
            modes=(FULL, PIECE), problems=()):
    return decide_outcome(policy or ReadinessPolicy(), mode, graphs_available=graphs, configured=configured,
                          passing=passing, captured_modes=set(modes), problems=list(problems))


def test_full_coverage_is_ready():
    o = outcome()
    assert (o.phase, o.ready, o.degraded_reason, o.failure_reason) == (Phase.READY, True, None, None)


def test_coverage_below_the_minimum_fails_with_both_numbers():
    o = outcome(passing=7, problems=["capture of full-t8-r8 failed: boom"])
    assert (o.phase, o.ready) == (Phase.FAILED, False)
    assert "coverage 0.70 < minCoverage 1.00" in o.failure_reason
    assert "full-t8-r8" in o.failure_reason


def test_coverage_at_the_minimum_is_ready():
    assert outcome(ReadinessPolicy(min_coverage=0.7), passing=7).phase is Phase.READY


def test_coverage_below_the_minimum_is_degraded_when_allowed():
    o = outcome(ReadinessPolicy(min_coverage=0.9, allow_degraded=True), passing=7)
    assert (o.phase, o.ready) == (Phase.DEGRADED, True)
    assert "coverage 0.70 < minCoverage 0.90" in o.degraded_reason


def test_a_required_mode_without_a_passing_graph_is_not_ready_even_at_full_coverage_threshold():
    policy = ReadinessPolicy(min_coverage=0.0, required_modes=[GraphMode.FULL])
    o = outcome(policy, passing=5, modes=(PIECE,))
    assert o.phase is Phase.FAILED
    assert "required modes without a passing graph: FULL" in o.failure_reason
    assert outcome(policy, passing=5, modes=(FULL,)).phase is Phase.READY


def test_full_and_piecewise_as_a_required_mode_needs_both_kinds():
    policy = ReadinessPolicy(min_coverage=0.0, required_modes=[GraphMode.FULL_AND_PIECEWISE])
    assert outcome(policy, modes=(FULL,)).phase is Phase.FAILED
    assert outcome(policy, modes=(FULL, PIECE)).phase is Phase.READY


def test_no_cuda_is_degraded_and_ready_only_when_degraded_serving_is_allowed():
    allowed = outcome(ReadinessPolicy(allow_degraded=True), graphs=False, passing=0, modes=())
    assert (allowed.phase, allowed.ready, allowed.degraded_reason) == (Phase.DEGRADED, True, NO_CUDA_REASON)
    refused = outcome(graphs=False, passing=0, modes=())
    assert (refused.phase, refused.ready, refused.degraded_reason) == (Phase.DEGRADED, False, NO_CUDA_REASON)
    assert refused.failure_reason is None and "allowDegraded is false" in refused.reason


def test_mode_none_needs_no_graphs_and_is_ready_without_cuda():
    o = outcome(mode=GraphMode.NONE, graphs=False, configured=0, passing=0, modes=())
    assert (o.phase, o.ready) == (Phase.READY, True)
    assert "coverage 1.00" in o.reason


def test_only_the_first_three_problems_are_quoted():
    o = outcome(passing=5, problems=[f"p{i}" for i in range(6)])
    assert "p2" in o.failure_reason and "p3" not in o.failure_reason


# ---------------------------------------------------------------------- injected failures

def test_a_failed_capture_degrades_the_worker_naming_the_key(tiny):
    lc = run_bounded(WorkerLifecycle(worker_config(tiny, allow_degraded=True), tiny, emulate_graphs=True,
                                     capture_fault=key_fault("full-t2-r2")))
    report = lc.report()
    assert report.phase is Phase.DEGRADED and lc.readiness.ready
    assert "capture of full-t2-r2 failed" in report.degraded_reason
    assert "injected failure" in report.degraded_reason
    assert report.coverage == pytest.approx(4 / 5)
    failed = [k for k in report.keys if not k.captured]
    assert [(k.kind, k.size, k.canary) for k in failed] == [("FULL", 2, None)]
    assert report.modes[0].captured == [1, 4]
    # the other keys still replay; a 2-request decode pads to the next captured key (piecewise)
    meta = canary_batch_for(full_key(2, lc.contract), list(range(1, 9)), 16, tiny.config.vocab_size, 256,
                            lc.device, torch.Generator().manual_seed(0))
    decision = lc.runner.plan(meta)
    assert decision.key is not None and decision.key.label() == "piecewise-t16"


def test_a_failed_capture_fails_the_worker_when_degraded_is_not_allowed(tiny):
    lc = run_bounded(WorkerLifecycle(worker_config(tiny), tiny, emulate_graphs=True,
                                     capture_fault=key_fault("piecewise-t64")))
    report = lc.report()
    assert report.phase is Phase.FAILED and not lc.readiness.ready
    assert "capture of piecewise-t64 failed" in report.failure_reason
    # a failed worker does not replay the graphs it did capture
    assert not lc.runner.enabled
    assert lc.runner.plan(canary_batch_for(full_key(1, lc.contract), [1, 2], 16, tiny.config.vocab_size, 256,
                                           lc.device, torch.Generator())).key is None


def test_a_capture_failure_of_every_key_never_hangs_and_reports_each_key(tiny):
    def always(key):
        raise RuntimeError("out of memory (injected)")

    lc = run_bounded(WorkerLifecycle(worker_config(tiny, allow_degraded=True), tiny, emulate_graphs=True,
                                     capture_fault=always))
    report = lc.report()
    assert report.phase is Phase.DEGRADED
    assert report.coverage == 0.0
    assert [k.captured for k in report.keys] == [False] * 5
    assert "required" not in report.degraded_reason  # no required modes configured
    assert report.degraded_reason.count("capture of") == 3  # the first three problems are quoted


def test_a_failed_canary_drops_the_key_and_its_batches_run_eagerly(tiny):
    config = worker_config(tiny, allow_degraded=True, mode=GraphMode.FULL, piecewise_capture_sizes=None)
    lc = run_bounded(WorkerLifecycle(config, tiny, emulate_graphs=True, canary_fault=key_fault("full-t2-r2")))
    report = lc.report()
    by_size = {k.size: k for k in report.keys}
    assert by_size[2].canary.passed is False
    assert "injected failure for full-t2-r2" in by_size[2].canary.reason
    assert by_size[1].canary.passed and by_size[4].canary.passed
    assert report.canary_failures == 1 and not report.canary_passed()
    assert report.coverage == pytest.approx(2 / 3)
    assert report.phase is Phase.DEGRADED and "canary failed for full-t2-r2" in report.degraded_reason
    assert [k.label() for k in lc.runner.captured_keys()] == ["full-t4-r4", "full-t1-r1"]
    # two requests: one prefill (eager: not a uniform decode), then two 2-request decodes whose
    # key was dropped (eager: not captured), never a replay of the dropped graph
    lc.engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert dict(lc.runner.stats.eager) == {FallbackReason.NOT_UNIFORM_DECODE: 1, FallbackReason.NOT_CAPTURED: 2}
    assert not lc.runner.stats.replays


# ---------------------------------------------------------------------- recapture in place

def test_recapture_changes_the_captured_keys_in_place_and_returns_to_ready(tiny):
    lc = run_bounded(WorkerLifecycle(worker_config(tiny), tiny, emulate_graphs=True))
    before = lc.report()
    engine, runner, model_weights = lc.engine, lc.runner, tiny.model.embed_tokens.data_ptr()
    new = GraphConfig(capture_sizes=[1, 3], piecewise_capture_sizes=[32])
    after = lc.recapture(new)
    assert after.generation > before.generation
    assert after.phase is Phase.READY and lc.readiness.ready
    assert [(m.kind, m.configured, m.captured) for m in after.modes] == [
        ("FULL", [1, 3, 4], [1, 3, 4]), ("PIECEWISE", [32, 64], [32, 64])]
    assert after.graph_config_hash == config_hash(new) != before.graph_config_hash
    assert phases(after) == ["Loading", "Warmup", "Profiling", "Capturing", "Canary", "Ready",
                             "Recapturing", "Canary", "Ready"]
    assert after.phase_seconds(Phase.RECAPTURING) >= 0
    # same engine and weights: nothing was reloaded; the engine now dispatches through the new graphs,
    # on the graph runner its model runner was built with (reconfigured in place, not replaced)
    assert lc.engine is engine and tiny.model.embed_tokens.data_ptr() == model_weights
    assert lc.runner is runner and lc.engine.runner.graph_runner is lc.runner
    assert lc.runner.kv_caches is lc.engine.kv_caches
    lc.engine.generate([[5, 6, 7], [8, 9], [10]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert dict(lc.runner.stats.replays) == {"piecewise-t32": 1, "full-t3-r3": 1}


def test_recapture_with_sizes_that_contradict_the_limits_changes_nothing(tiny):
    lc = run_bounded(WorkerLifecycle(worker_config(tiny), tiny, emulate_graphs=True))
    runner, hash_before = lc.runner, lc.report().graph_config_hash
    with pytest.raises(CaptureSizeError, match="max_num_seqs=4"):
        lc.recapture(GraphConfig(capture_sizes=[1, 8]))
    assert lc.runner is runner and lc.readiness.ready
    assert lc.report().graph_config_hash == hash_before


def test_draining_leaves_readiness_and_is_recorded(tiny):
    lc = run_bounded(WorkerLifecycle(worker_config(tiny, mode=GraphMode.NONE), tiny))
    assert lc.readiness.ready
    lc.start_draining()
    report = lc.report()
    assert report.phase is Phase.DRAINING and phases(report)[-1] == "Draining"
    assert (lc.readiness.ready, lc.readiness.reason) == (False, "draining")


def test_a_drain_during_capture_stays_draining_and_out_of_traffic(tiny):
    # SIGTERM while the graphs are being captured: the later Canary phase must not overwrite
    # Draining, or the outcome would bring a terminating worker back into traffic.
    lc = None
    published: list[WorkerReport] = []

    def drain_on_first_key(key) -> None:
        if lc.phase is Phase.CAPTURING:
            lc.start_draining()

    lc = WorkerLifecycle(worker_config(tiny), tiny, emulate_graphs=True, capture_fault=drain_on_first_key)
    lc.listeners.append(published.append)
    run_bounded(lc)
    report = lc.report()
    assert report.phase is Phase.DRAINING
    assert (lc.readiness.ready, lc.readiness.reason) == (False, "draining")
    drained_at = next(i for i, r in enumerate(published) if r.phase is Phase.DRAINING)
    assert {r.phase for r in published[drained_at:]} == {Phase.DRAINING}


def test_long_failure_messages_are_cut_to_fit_the_report(tiny):
    # Exception texts (a CUDA out-of-memory message is about 600 characters) are quoted for three
    # keys; the report's reason fields hold at most 1024 characters.
    def oom(key):
        raise RuntimeError(f"CUDA out of memory capturing {key.label()}. " + "x" * 600)

    degraded = run_bounded(WorkerLifecycle(worker_config(tiny, allow_degraded=True), tiny, emulate_graphs=True,
                                           capture_fault=oom)).report()
    assert degraded.phase is Phase.DEGRADED and degraded.failure_reason is None
    assert len(degraded.degraded_reason) == 1024 and degraded.degraded_reason.endswith("x...")
    assert degraded.degraded_reason.startswith("coverage 0.00 < minCoverage 1.00; capture of full-t4-r4 failed: "
                                               "RuntimeError: CUDA out of memory capturing full-t4-r4. xxx")
    failed = run_bounded(WorkerLifecycle(worker_config(tiny), tiny, emulate_graphs=True, capture_fault=oom)).report()
    assert failed.phase is Phase.FAILED and failed.degraded_reason is None
    assert len(failed.failure_reason) == 1024 and failed.failure_reason.endswith("x...")
    assert failed.failure_reason.startswith("coverage 0.00 < minCoverage 1.00; capture of full-t4-r4 failed: ")


def test_an_out_of_memory_error_in_warmup_fails_the_worker_and_times_the_phase(tiny):
    lc = WorkerLifecycle(worker_config(tiny, allow_degraded=True), tiny, emulate_graphs=True)

    def oom() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    lc._warmup = oom
    report = run_bounded(lc).report()
    assert report.phase is Phase.FAILED and not lc.readiness.ready
    assert report.failure_reason == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert phases(report) == ["Loading", "Warmup", "Failed"]
    # the phase that raised still has its duration (it was left None: "still running" forever)
    assert report.phases[1].duration_seconds is not None and report.phases[1].duration_seconds >= 0


def test_many_recaptures_keep_the_report_within_its_phase_bound(tiny):
    # Each recapture adds Recapturing, Canary and an outcome record; the report holds at most
    # MAX_PHASES records, and report() raised a ValidationError past it (/v1/graphs answered 500
    # and no report was published any more).
    from graphserving.contract.report import MAX_PHASES

    config = worker_config(tiny, mode=GraphMode.FULL, capture_sizes=[4], piecewise_capture_sizes=None)
    lc = run_bounded(WorkerLifecycle(config, tiny, emulate_graphs=True))
    for i in range(MAX_PHASES // 3 + 1):
        report = lc.recapture(GraphConfig(mode=GraphMode.FULL, capture_sizes=[1 + i % 4]))
    assert report.phase is Phase.READY and len(report.phases) == MAX_PHASES
    # start-up stays (probe timings come from it), the latest records stay
    assert phases(report)[:5] == ["Loading", "Warmup", "Profiling", "Capturing", "Canary"]
    assert phases(report)[-3:] == ["Recapturing", "Canary", "Ready"]
    assert WorkerReport.from_annotation(report.to_annotation()).phases == report.phases
