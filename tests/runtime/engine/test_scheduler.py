"""Scheduler policy: FCFS admission, limits, chunked prefill, preemption, abort.

Pure logic: the "model" here is the scheduler's own bookkeeping; each step appends a fake token to
every sequence that samples, as the engine would.
"""

import pytest

from graphserving.runtime.engine.block_manager import BlockManager
from graphserving.runtime.engine.scheduler import Scheduler
from graphserving.runtime.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus


def make_seq(name: str, prompt_len: int, max_tokens: int = 8) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return Sequence(
        seq_id=name, request_id=name, index=0, prompt_token_ids=list(range(1, prompt_len + 1)),
        params=params, seed=0, max_tokens=max_tokens,
    )


def run_step(sched: Scheduler):
    """One step as the engine does it: schedule, commit, append a token to sampling rows, finish."""
    out = sched.schedule()
    sched.commit(out)
    for row in out.scheduled:
        if row.samples:
            row.seq.output_token_ids.append(7)
            if row.seq.num_output_tokens >= row.seq.max_tokens:
                sched.finish(row.seq, FinishReason.LENGTH)
    return out


def test_admission_is_first_come_first_served_within_max_num_seqs():
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=1000)
    a, b, c = make_seq("a", 3), make_seq("b", 3), make_seq("c", 3)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert [r.seq.seq_id for r in out.scheduled] == ["a", "b"]
    assert [r.num_new_tokens for r in out.scheduled] == [3, 3]
    assert list(sched.waiting) == [c]


def test_token_budget_chunks_a_long_prefill():
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=4, max_num_batched_tokens=8)
    long = make_seq("long", 20)
    sched.add(long)
    out = run_step(sched)
    assert [(r.start, r.num_new_tokens, r.samples) for r in out.scheduled] == [(0, 8, False)]
    out = run_step(sched)
    assert [(r.start, r.num_new_tokens, r.samples) for r in out.scheduled] == [(8, 8, False)]
    out = run_step(sched)
    assert [(r.start, r.num_new_tokens, r.samples) for r in out.scheduled] == [(16, 4, True)]
    assert long.num_output_tokens == 1


def test_decodes_and_a_prefill_chunk_share_a_step():
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=4, max_num_batched_tokens=6)
    a = make_seq("a", 2)
    sched.add(a)
    run_step(sched)  # a prefilled, now decoding
    b = make_seq("b", 10)
    sched.add(b)
    out = run_step(sched)
    assert [(r.seq.seq_id, r.num_new_tokens) for r in out.scheduled] == [("a", 1), ("b", 5)]
    assert out.num_batched_tokens == 6


def test_a_waiting_request_does_not_overtake_one_that_does_not_fit():
    # 4 usable blocks of 2 tokens; "big" needs 3 blocks after "a" took 2.
    sched = Scheduler(BlockManager(5, 2), max_num_seqs=8, max_num_batched_tokens=100)
    a, big, small = make_seq("a", 4, max_tokens=1), make_seq("big", 6, max_tokens=1), make_seq("small", 1, max_tokens=1)
    for s in (a, big, small):
        sched.add(s)
    out = sched.schedule()
    assert [r.seq.seq_id for r in out.scheduled] == ["a"]
    assert list(sched.waiting) == [big, small]


def test_kv_pressure_preempts_the_youngest_running_sequence():
    # 3 usable blocks of 2 tokens: two 2-token prompts fill 2 blocks; decoding needs more.
    bm = BlockManager(4, 2)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    old, young = make_seq("old", 2, max_tokens=4), make_seq("young", 2, max_tokens=4)
    sched.add(old)
    sched.add(young)
    run_step(sched)  # both prefilled: 2 blocks used, each has 3 tokens now
    out = run_step(sched)  # both need a second block; only one is free
    assert [r.seq.seq_id for r in out.scheduled] == ["old"]
    assert out.preempted == [young]
    assert young.status is SequenceStatus.WAITING
    assert young.num_computed_tokens == 0
    assert young.num_preemptions == 1
    assert list(sched.waiting) == [young]
    assert bm.block_table("young") == []


def test_preempted_sequence_is_recomputed_with_its_outputs_and_everything_completes():
    bm = BlockManager(4, 2)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    seqs = [make_seq(f"s{i}", 2, max_tokens=3) for i in range(3)]
    for s in seqs:
        sched.add(s)
    recompute_rows = []
    for _ in range(50):
        if not sched.has_unfinished():
            break
        out = run_step(sched)
        recompute_rows += [r for r in out.scheduled if r.seq.num_preemptions and r.start == 0]
    assert not sched.has_unfinished()
    assert all(s.finish_reason is FinishReason.LENGTH and s.num_output_tokens == 3 for s in seqs)
    assert sched.num_preemptions > 0
    # a recompute prefills prompt and earlier outputs together
    assert any(r.num_new_tokens > r.seq.num_prompt_tokens for r in recompute_rows)
    assert bm.num_used_blocks == 0


def test_the_only_running_sequence_is_never_preempted_forever():
    bm = BlockManager(3, 2)  # 4 token slots
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    s = make_seq("solo", 1, max_tokens=3)
    sched.add(s)
    for _ in range(10):
        if not sched.has_unfinished():
            break
        out = run_step(sched)
        assert out.preempted == []
    assert s.finish_reason is FinishReason.LENGTH


def test_a_sequence_that_can_never_fit_is_refused_at_admission():
    sched = Scheduler(BlockManager(3, 2), max_num_seqs=8, max_num_batched_tokens=100)
    with pytest.raises(ValueError, match="more than the KV cache holds"):
        sched.add(make_seq("huge", 3, max_tokens=2))


def test_abort_frees_blocks_and_removes_the_sequence():
    bm = BlockManager(10, 2)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq("a", 3), make_seq("b", 3)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    aborted = sched.abort("a")
    assert aborted == [a]
    assert a.finish_reason is FinishReason.ABORT
    assert bm.block_table("a") == []
    assert sched.running == [b]
    out = sched.schedule()
    assert [r.seq.seq_id for r in out.scheduled] == ["b"]


def test_invalid_limits_are_refused():
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(BlockManager(4, 2), max_num_seqs=0, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(BlockManager(4, 2), max_num_seqs=1, max_num_batched_tokens=0)


def test_finish_all_removes_many_siblings_in_one_pass_and_keeps_the_others_in_order():
    bm = BlockManager(400, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    seqs = [make_seq(f"s{i}", 3) for i in range(300)]
    for seq in seqs:
        sched.add(seq)
    run_step(sched)  # the first four run and hold blocks
    running = list(sched.running)
    assert bm.num_used_blocks > 0
    doomed = seqs[::2]  # two of the running ones and 148 waiting ones
    sched.finish_all(doomed, FinishReason.ABORT)
    assert all(s.is_finished and s.finish_reason is FinishReason.ABORT for s in doomed)
    assert list(sched.waiting) == [s for s in seqs[4:] if s not in doomed]
    assert sched.running == [s for s in running if s not in doomed]
    assert all(not bm.block_table(s.seq_id) for s in doomed)
