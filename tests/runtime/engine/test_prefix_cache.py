"""Prefix caching, pure logic: block hashes, the cache and its evictor, the block manager's and the
scheduler's use of them (runtime/engine/prefix_cache.py, block_manager.py, scheduler.py)."""

import pytest

from graphserving.runtime.engine.block_manager import BlockAllocator, BlockManager, NoFreeBlocksError
from graphserving.runtime.engine.prefix_cache import ROOT_HASH, PrefixCache, block_hash, extend_block_hashes
from graphserving.runtime.engine.scheduler import Scheduler, cacheable_blocks
from graphserving.runtime.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from test_scheduler import run_step

BS = 4


def make_seq(name: str, prompt: list[int], max_tokens: int = 4, **params) -> Sequence:
    p = SamplingParams(max_tokens=max_tokens, temperature=0, **params)
    return Sequence(seq_id=name, request_id=name, index=0, prompt_token_ids=list(prompt), params=p, seed=0,
                    max_tokens=max_tokens)


def run_to_end(sched: Scheduler, limit: int = 200) -> None:
    for _ in range(limit):
        if not sched.has_unfinished():
            return
        run_step(sched)
    raise AssertionError("the scheduler did not finish")


# -- block hashes ----------------------------------------------------------------------------------

def test_a_block_hash_depends_on_its_tokens_its_parent_and_the_extra_key():
    h = block_hash(ROOT_HASH, [1, 2, 3, 4])
    assert h == block_hash(ROOT_HASH, [1, 2, 3, 4]) and len(h) == 32
    assert h != block_hash(ROOT_HASH, [1, 2, 3, 5])
    assert h != block_hash(block_hash(ROOT_HASH, [9, 9, 9, 9]), [1, 2, 3, 4])
    assert h != block_hash(ROOT_HASH, [1, 2, 3, 4], extra=b"lora-1")


def test_block_hashes_chain_and_extend_incrementally():
    tokens = list(range(10, 22))  # 3 full blocks of 4
    hashes = extend_block_hashes([], tokens, 2, BS)
    assert hashes == [block_hash(ROOT_HASH, tokens[:4]), block_hash(hashes[0], tokens[4:8])]
    assert extend_block_hashes(hashes, tokens, 3, BS)[2] == block_hash(hashes[1], tokens[8:12])
    # the same block after a different prefix is a different block
    other = extend_block_hashes([], [0, 0, 0, 0, *tokens[4:8]], 2, BS)
    assert other[1] != hashes[1]


# -- the allocator and the evictor -----------------------------------------------------------------

def test_a_freed_cached_block_stays_cached_and_counts_as_free():
    cache = PrefixCache()
    alloc = BlockAllocator(4, cache)
    b = alloc.allocate()
    assert cache.register(b, b"h" * 32)
    alloc.free(b)
    assert alloc.ref_count(b) == 0 and alloc.num_free_blocks == 3
    assert cache.is_evictable(b) and cache.lookup([b"h" * 32]) == [b]
    assert alloc.take(b) == b and alloc.ref_count(b) == 1 and not cache.is_evictable(b)
    assert alloc.num_free_blocks == 2


def test_allocation_takes_uncached_free_blocks_before_evicting_the_least_recently_freed_cached_one():
    cache = PrefixCache()
    alloc = BlockAllocator(4, cache)  # blocks 1, 2, 3
    a, b, c = alloc.allocate(), alloc.allocate(), alloc.allocate()
    cache.register(a, b"a" * 32)
    cache.register(b, b"b" * 32)
    alloc.free(b)  # freed first: evicted first
    alloc.free(a)
    alloc.free(c)  # uncached: handed out first
    assert alloc.allocate() == c
    assert alloc.allocate() == b and cache.lookup([b"b" * 32]) == [] and not cache.is_cached(b)
    assert alloc.allocate() == a and cache.num_cached_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        alloc.allocate()
    cache.check()


def test_a_block_already_held_by_another_block_of_the_same_content_stays_private():
    cache = PrefixCache()
    assert cache.register(1, b"x" * 32)
    assert not cache.register(2, b"x" * 32)
    assert not cache.register(1, b"y" * 32)
    assert cache.lookup([b"x" * 32]) == [1] and not cache.is_cached(2)


def test_taking_an_uncached_block_is_refused():
    alloc = BlockAllocator(4, PrefixCache())
    b = alloc.allocate()
    with pytest.raises(ValueError, match="not in the prefix cache"):
        alloc.take(b)


# -- the block manager -----------------------------------------------------------------------------

def test_a_cache_hit_starts_the_block_table_with_shared_blocks():
    bm = BlockManager(10, BS, prefix_caching=True)
    hashes = extend_block_hashes([], list(range(12)), 3, BS)
    bm.allocate("a", 12)
    bm.cache_full_blocks("a", hashes, 3)
    hit = bm.cached_prefix(hashes[:2])
    assert hit == bm.block_table("a")[:2]
    new = bm.allocate("b", 10, hit)
    assert bm.block_table("b") == [*hit, *new] and len(new) == 1
    assert [bm.allocator.ref_count(x) for x in hit] == [2, 2]
    bm.free("a")
    bm.free("b")
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 3 and bm.num_free_blocks == 9


def test_a_hit_on_evictable_blocks_takes_them_out_of_the_free_ones():
    bm = BlockManager(4, BS, prefix_caching=True)  # 3 usable blocks
    hashes = extend_block_hashes([], list(range(8)), 2, BS)
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", hashes, 2)
    bm.free("a")
    hit = bm.cached_prefix(hashes)
    assert bm.num_free_blocks == 3
    assert bm.can_allocate("b", 12, hit)  # 2 hits + 1 new block
    assert not bm.can_allocate("b", 16, hit)  # 2 new blocks, only 1 free once the hits are taken
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("b", 16, hit)
    assert bm.block_table("b") == [] and bm.num_free_blocks == 3


def test_reserved_blocks_are_never_cached_and_never_evicted():
    bm = BlockManager(6, BS, prefix_caching=True)
    reserved = bm.reserve(2)
    hashes = extend_block_hashes([], list(range(12)), 3, BS)
    bm.allocate("a", 12)
    bm.cache_full_blocks("a", hashes, 3)
    bm.free("a")
    bm.allocate("b", 12)  # evicts all three cached blocks
    assert not set(reserved) & set(bm.block_table("b"))
    assert all(not bm.cache.is_cached(r) and bm.allocator.ref_count(r) == 1 for r in reserved)


def test_with_caching_off_nothing_is_registered_or_found():
    bm = BlockManager(10, BS, prefix_caching=False)
    hashes = extend_block_hashes([], list(range(8)), 2, BS)
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", hashes, 2)
    assert bm.cached_prefix(hashes) == [] and bm.num_cached_blocks == 0


def test_dropping_the_cache_frees_the_evictable_blocks_and_keeps_live_tables_private():
    bm = BlockManager(10, BS, prefix_caching=True)
    hashes = extend_block_hashes([], list(range(12)), 3, BS)
    bm.allocate("gone", 12)
    bm.cache_full_blocks("gone", hashes, 3)
    bm.free("gone")
    bm.allocate("live", 12, bm.cached_prefix(hashes[:2]))
    assert bm.drop_prefix_cache() == 3
    assert bm.num_cached_blocks == 0 and bm.cached_prefix(hashes) == [] and bm.num_free_blocks == 6
    bm.cache_full_blocks("live", hashes, 3)  # its blocks hold the old K/V: they stay private
    assert bm.num_cached_blocks == 0
    bm.free("live")
    assert bm.num_free_blocks == 9 and bm.allocator.num_used_blocks == 0
    bm.cache.check()


# -- how much of a sequence may come from the cache ------------------------------------------------

@pytest.mark.parametrize(("prompt_len", "blocks"), [(3, 0), (4, 0), (5, 1), (8, 1), (9, 2)])
def test_the_block_of_the_last_token_is_never_taken_from_the_cache(prompt_len, blocks):
    assert cacheable_blocks(make_seq("s", range(prompt_len)), BS) == blocks


def test_a_sequence_computing_prompt_logprobs_takes_no_block_it_has_not_scored():
    seq = make_seq("s", range(13), prompt_logprobs=0)
    assert cacheable_blocks(seq, BS) == 0
    seq.prompt_logprobs.extend([None] * 9)  # 10 entries: positions 0..8 scored
    assert cacheable_blocks(seq, BS) == 2
    seq.prompt_logprobs.extend([None] * 3)  # complete: no limit but the last token
    assert cacheable_blocks(seq, BS) == 3


# -- the scheduler ---------------------------------------------------------------------------------

SYSTEM = list(range(100, 112))  # 3 full blocks


def test_a_request_after_another_with_the_same_prefix_prefills_only_its_own_tokens():
    bm = BlockManager(40, BS, prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=1000)
    first = make_seq("first", [*SYSTEM, 1, 2])
    sched.add(first)
    out = run_step(sched)
    assert (out.prefix_cache_query_tokens, out.prefix_cache_hit_tokens) == (14, 0)
    second = make_seq("second", [*SYSTEM, 3, 4, 5])
    sched.add(second)
    out = run_step(sched)
    row = next(r for r in out.scheduled if r.seq is second)
    assert (row.start, row.num_new_tokens, row.samples) == (12, 3, True)
    assert bm.block_table("second")[:3] == bm.block_table("first")[:3]
    assert (out.prefix_cache_query_tokens, out.prefix_cache_hit_tokens) == (15, 12)
    assert second.num_cached_tokens == 12 and first.num_cached_tokens == 0
    stats = sched.prefix_cache_stats()
    assert (stats.enabled, stats.query_tokens, stats.hit_tokens) == (True, 29, 12)


def test_a_fully_cached_prompt_recomputes_its_last_block_into_a_block_of_its_own():
    bm = BlockManager(40, BS, prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=1000)
    sched.add(make_seq("a", SYSTEM, max_tokens=1))
    run_to_end(sched)
    again = make_seq("again", SYSTEM, max_tokens=2)
    sched.add(again)
    out = run_step(sched)
    (row,) = out.scheduled
    assert (row.start, row.num_new_tokens) == (8, 4)  # two blocks from the cache, the third recomputed
    table = bm.block_table("again")
    assert [bm.allocator.ref_count(b) for b in table] == [1, 1, 1]
    assert not bm.cache.is_cached(table[2])  # the cached copy of block 3 holds that content already


def test_requests_admitted_in_the_same_step_do_not_hit_each_other():
    sched = Scheduler(BlockManager(40, BS, prefix_caching=True), max_num_seqs=8, max_num_batched_tokens=1000)
    a, b = make_seq("a", [*SYSTEM, 1]), make_seq("b", [*SYSTEM, 2])
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert [r.start for r in out.scheduled] == [0, 0] and out.prefix_cache_hit_tokens == 0


def test_generated_blocks_are_cached_too():
    bm = BlockManager(40, BS, prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=1000)
    a = make_seq("a", SYSTEM[:6], max_tokens=7)
    sched.add(a)
    run_to_end(sched)
    assert a.token_ids == [*SYSTEM[:6], *[7] * 7] and a.num_computed_tokens == 12  # the last token has no K/V
    follow_up = make_seq("follow-up", [*a.token_ids[:12], 9])  # a chat turn after the first answer
    sched.add(follow_up)
    (row,) = run_step(sched).scheduled
    assert row.start == 12  # blocks 2 and 3 hold generated tokens


def test_a_preempted_sequence_resumes_after_its_cached_blocks_and_returns_every_reference():
    bm = BlockManager(6, 2, prefix_caching=True)  # 5 usable blocks of 2 tokens
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    old, young = make_seq("old", [1, 2, 3, 4], max_tokens=4), make_seq("young", [5, 6, 7], max_tokens=4)
    sched.add(old)
    sched.add(young)
    run_step(sched)  # old: 2 blocks, young: 2 blocks (its first full)
    run_step(sched)  # old needs a third block, young's fourth token still fits
    out = run_step(sched)
    assert out.preempted == [young] and young.num_computed_tokens == 0
    resumed = []
    for _ in range(50):
        if not sched.has_unfinished():
            break
        resumed += [r for r in run_step(sched).scheduled if r.seq is young and r.seq.num_preemptions]
    assert resumed[0].start > 0  # the prefill after the preemption skipped its cached blocks
    assert young.num_output_tokens == 4 and old.num_output_tokens == 4
    assert bm.num_used_blocks == 0
    assert all(bm.allocator.ref_count(b) == 0 for b in range(1, 6))
    bm.cache.check()


def test_abort_returns_every_reference_and_keeps_the_prompt_blocks_cached():
    bm = BlockManager(40, BS, prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=1000)
    a = make_seq("a", [*SYSTEM, 1], max_tokens=50)
    sched.add(a)
    run_step(sched)
    sched.abort("a")
    assert a.status is SequenceStatus.FINISHED and a.finish_reason is FinishReason.ABORT
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 3
    b = make_seq("b", [*SYSTEM, 2])
    sched.add(b)
    assert run_step(sched).scheduled[0].start == 12


def test_with_caching_off_nothing_is_queried_or_hit():
    sched = Scheduler(BlockManager(40, BS, prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=1000)
    sched.add(make_seq("a", [*SYSTEM, 1], max_tokens=1))
    run_to_end(sched)
    sched.add(make_seq("b", [*SYSTEM, 1]))
    out = run_step(sched)
    assert out.scheduled[0].start == 0
    assert (out.prefix_cache_query_tokens, out.prefix_cache_hit_tokens) == (0, 0)
    stats = sched.prefix_cache_stats()
    assert (stats.enabled, stats.query_tokens, stats.hit_tokens, stats.cached_blocks) == (False, 0, 0, 0)


def test_a_prompt_logprobs_request_prefills_its_whole_prompt_even_when_cached():
    sched = Scheduler(BlockManager(40, BS, prefix_caching=True), max_num_seqs=8, max_num_batched_tokens=1000)
    sched.add(make_seq("a", [*SYSTEM, 1], max_tokens=1))
    run_to_end(sched)
    scored = make_seq("scored", [*SYSTEM, 1], prompt_logprobs=1)
    sched.add(scored)
    (row,) = run_step(sched).scheduled
    assert (row.start, row.num_new_tokens) == (0, 13)
