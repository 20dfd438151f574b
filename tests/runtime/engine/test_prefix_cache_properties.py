"""Prefix caching under random arrival, finish, abort and preemption orders (hypothesis stateful test).

Pure logic: the scheduler and block manager of the engine, and a shadow KV cache that records which
token each slot was last written with (each scheduled row writes its positions, as the model runner
does). After every rule:

- every position a live sequence has computed still holds its own token in the shadow cache: a
  block a live sequence references was never evicted, reallocated or written by another sequence,
  and every cache hit held exactly the tokens its hash names;
- each block's reference count is the number of live block tables naming it; a referenced block is
  never evictable; the hash maps are inverse (``PrefixCache.check``);
- free uncached blocks, evictable blocks and referenced blocks partition the usable ones.

At the end every request is finished or aborted, and every reference count is 0.
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from graphserving.runtime.engine.block_manager import BlockManager
from graphserving.runtime.engine.scheduler import Scheduler
from graphserving.runtime.engine.sequence import FinishReason, SamplingParams, Sequence

BLOCK_SIZE = 2
NUM_BLOCKS = 14  # 13 usable: a few requests fill it, so preemption and eviction happen
PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4, 6, 7], [8, 9]]


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, prefix_caching=True)
        self.sched = Scheduler(self.bm, max_num_seqs=4, max_num_batched_tokens=6)
        self.shadow: dict[int, int] = {}  # slot -> token last written there
        self.live: list[Sequence] = []
        self.count = 0
        self.hits = 0

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(1, 3), max_size=3),
          max_tokens=st.integers(1, 4), logprobs=st.booleans())
    def arrive(self, prefix, suffix, max_tokens, logprobs):
        prompt = [*prefix, *suffix] or [1]
        params = SamplingParams(max_tokens=max_tokens, temperature=0, prompt_logprobs=0 if logprobs else None)
        seq = Sequence(seq_id=f"r{self.count}", request_id=f"r{self.count}", index=0, prompt_token_ids=prompt,
                       params=params, seed=0, max_tokens=max_tokens)
        self.count += 1
        self.sched.add(seq)
        self.live.append(seq)

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(stops=st.lists(st.booleans(), min_size=4, max_size=4), token=st.integers(1, 3))
    def step(self, stops, token):
        out = self.sched.schedule()
        for row in out.scheduled:
            seq, table = row.seq, self.bm.block_table(row.seq.seq_id)
            assert all(self.bm.allocator.ref_count(b) > 0 for b in table)
            for pos in range(row.start, row.end):
                self.shadow[table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE] = seq.token_ids[pos]
            if seq.prompt_logprobs and len(seq.prompt_logprobs) < seq.num_prompt_tokens:
                assert row.start <= len(seq.prompt_logprobs) - 1  # no unscored position was skipped
                # the engine scores the prompt tokens after the row's positions (prompt_logprobs.py)
                seq.prompt_logprobs.extend([None] * (min(row.end + 1, seq.num_prompt_tokens) - len(seq.prompt_logprobs)))
        self.sched.commit(out)
        self.hits += out.prefix_cache_hit_tokens
        for i, row in enumerate(out.scheduled):
            seq = row.seq
            if not row.samples:
                continue
            seq.output_token_ids.append(token)
            if seq.num_output_tokens >= seq.max_tokens or stops[i % 4]:
                self.sched.finish(seq, FinishReason.LENGTH)
                self.live.remove(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.sched.abort(seq.request_id)
        self.live.remove(seq)

    @invariant()
    def live_sequences_read_their_own_tokens(self):
        for seq in self.sched.running:
            table = self.bm.block_table(seq.seq_id)
            for pos in range(min(seq.num_computed_tokens, seq.num_tokens)):
                slot = table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
                assert self.shadow.get(slot) == seq.token_ids[pos], (seq.seq_id, pos)

    @invariant()
    def reference_counts_match_the_block_tables(self):
        tables = self.bm.block_tables
        cache = self.bm.cache
        cache.check()
        for block in range(1, NUM_BLOCKS):
            refs = sum(table.count(block) for table in tables.values())
            assert self.bm.allocator.ref_count(block) == refs, block
            if refs:
                assert not cache.is_evictable(block), block
        assert self.bm.num_used_blocks == len({b for table in tables.values() for b in table})
        free = set(self.bm.allocator._free)
        assert not free & {b for b in range(NUM_BLOCKS) if cache.is_cached(b)}
        assert len(free) + cache.num_evictable_blocks + self.bm.num_used_blocks == NUM_BLOCKS - 1

    def teardown(self):
        for _ in range(500):
            if not self.sched.has_unfinished():
                break
            self.step([False] * 4, 1)
        assert not self.sched.has_unfinished()
        assert all(self.bm.allocator.ref_count(b) == 0 for b in range(1, NUM_BLOCKS))
        assert self.bm.num_used_blocks == 0
        self.bm.cache.check()


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
test_prefix_cache_under_random_orders = PrefixCacheMachine.TestCase


def test_the_machine_sees_hits_and_preemptions():
    """The orders above do reach the cases under test (a run that never hits proves nothing)."""
    machine = PrefixCacheMachine()
    for i in range(6):
        machine.arrive([1, 2, 3, 4, 6, 7], [i % 3 + 1] * 3, 4, False)
    for _ in range(40):
        if not machine.sched.has_unfinished():
            break
        machine.step([False] * 4, 2)
        machine.live_sequences_read_their_own_tokens()
        machine.reference_counts_match_the_block_tables()
    assert machine.hits > 0 and machine.sched.num_preemptions > 0
    machine.teardown()
