"""When the engine drafts (runtime/engine/speculative.py): ``max_drafts`` per row, the layout of a
verification batch; on a tiny random Llama, an engine whose drafts are never accepted decodes
(greedy and seeded) as without speculation and stops verifying after one window, a paused request
verifies again once a shadow window sees its text repeat, and verification batches replay the FULL
graphs of query length k + 1 (emulated). The decision itself: test_spec_decision.py."""

import pytest
import torch

from graphserving.contract.graph_policy import GraphMode
from graphserving.contract.worker_config import EngineLimits
from graphserving.runtime.engine.block_manager import BlockManager
from graphserving.runtime.engine.core import LLMEngine
from graphserving.runtime.engine.scheduler import ScheduledSequence
from graphserving.runtime.engine.sequence import SamplingParams, Sequence, SequenceStatus
from graphserving.runtime.engine.spec_decode.draft_model import DraftModelDrafter
from graphserving.runtime.engine.spec_decode.drafter import pad_drafts
from graphserving.runtime.engine.spec_decode.ngram import NgramDrafter, propose_ngram
from graphserving.runtime.engine.spec_decode.policy import ACCEPTANCE_WINDOW
from graphserving.runtime.engine.speculative import SpeculativeDecoder, max_drafts, verification_metadata
from graphserving.runtime.graphs.key import GraphKeyContract
from graphserving.runtime.graphs.runner import GraphRunner
from graphserving.runtime.model.kv_cache import allocate_kv_cache
from graphserving.runtime.model.kv_layout import NULL_BLOCK, PAD_SLOT_ID
from graphserving.runtime.model.loader import load_model


def decode_row(num_prompt: int = 5, num_output: int = 3, max_tokens: int = 16, **seq) -> ScheduledSequence:
    s = Sequence(seq_id="s", request_id="r", index=0, prompt_token_ids=list(range(10, 10 + num_prompt)),
                 params=SamplingParams(max_tokens=max_tokens), seed=0, max_tokens=max_tokens, **seq)
    s.output_token_ids = list(range(50, 50 + num_output))
    s.num_computed_tokens = s.num_tokens - 1
    return ScheduledSequence.of(s, 1)


def test_a_row_drafts_k_but_never_its_last_token_before_max_tokens():
    assert max_drafts(decode_row(num_output=3, max_tokens=16), 4) == 4
    assert [max_drafts(decode_row(num_output=n, max_tokens=16), 4) for n in (11, 12, 13, 14, 15)] == [4, 3, 2, 1, 0]


def test_a_row_with_a_grammar_or_finished_drafts_nothing():
    assert max_drafts(decode_row(matcher=object()), 4) == 0
    row = decode_row()
    row.seq.status = SequenceStatus.FINISHED
    assert max_drafts(row, 4) == 0


def test_a_verification_batch_puts_each_request_in_k_plus_1_rows_and_pads_what_it_did_not_draft():
    bm = BlockManager(32, block_size=4)
    rows = []
    for i, (prompt, output) in enumerate([(5, 2), (9, 1)]):
        row = decode_row(prompt, output)
        row.seq.seq_id = f"s{i}"
        bm.allocate(row.seq.seq_id, row.start + 1)
        rows.append(row)
    bm.allocate("s0", rows[0].start + 3)  # two drafts for s0; none for s1
    meta = verification_metadata(rows, [[7, 8], []], 3, bm)
    s0, s1 = rows[0].start, rows[1].start
    assert meta.uniform_query_len == 4 and meta.max_query_len == 4 and meta.num_tokens == 8
    assert meta.input_ids.tolist() == [rows[0].seq.token_ids[-1], 7, 8, 0, rows[1].seq.token_ids[-1], 0, 0, 0]
    assert meta.positions.tolist() == [s0, s0 + 1, s0 + 2, s0 + 2, s1, s1, s1, s1]
    assert meta.slot_mapping.tolist() == [*bm.slot_mapping("s0", s0, s0 + 3), PAD_SLOT_ID,
                                          *bm.slot_mapping("s1", s1, s1 + 1), *[PAD_SLOT_ID] * 3]
    assert meta.seq_lens.tolist() == [s0 + 4, s1 + 4]
    assert meta.query_start_loc.tolist() == [0, 4, 8] and meta.logits_indices.tolist() == list(range(8))
    width = -(-(s1 + 4) // 4)  # the block table covers start + k + 1 positions
    assert meta.block_table.shape[1] == width and meta.block_table[1, len(bm.block_table("s1")):].eq(NULL_BLOCK).all()


BANNED = 4242
"""The token the never-accepted drafter proposes, which a -100 logit bias keeps the target from choosing."""


class BannedTokenDrafter:
    """Drafts :data:`BANNED` at every position it may: acceptance is zero by construction."""

    num_speculative_tokens = 4

    def propose(self, requests, device):
        return pad_drafts([[BANNED] * min(4, r.max_drafts) for r in requests], 4, device)


class LateDrafter(BannedTokenDrafter):
    """Drafts only from a request's 5th output token on (``DraftRequest.step``)."""

    def propose(self, requests, device):
        return pad_drafts([[BANNED] * min(4, r.max_drafts) if r.step >= 5 else [] for r in requests], 4, device)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir("llama3_rope"), revision=None, dtype=torch.float32, device="cpu")


def engine(tiny, speculative=None, graphs=False, k=4, num_scheduler_steps=1):
    limits = EngineLimits(max_num_seqs=4, num_kv_blocks=128, block_size=4, num_scheduler_steps=num_scheduler_steps)
    kv = allocate_kv_cache(tiny.config, 128, 4, torch.float32, "cpu")
    runner = None
    if graphs:
        runner = GraphRunner(tiny.model, kv, mode=GraphMode.FULL, full_sizes=[1, 2, 4], piecewise_sizes=[],
                             contract=GraphKeyContract(model_revision="test", dtype="float32"),
                             max_blocks_per_seq=127, num_speculative_tokens=k)
        with torch.inference_mode():
            runner.capture_all()
    return LLMEngine(tiny.model, tiny.config, tiny.tokenizer, limits, device="cpu", kv_caches=kv,
                     graph_runner=runner, speculative=speculative)


PROMPTS = [[5, 17, 300, 42, 5, 17], [9, 8, 7, 6, 5, 4, 3], [1000, 2000, 1000]]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_with_acceptance_forced_to_zero_the_tokens_are_those_without_speculation_and_drafting_pauses(tiny, temperature):
    params = [SamplingParams(max_tokens=120, temperature=temperature, seed=11 + i, ignore_eos=True,
                             logit_bias=((BANNED, -100.0),)) for i in range(3)]
    plain = [c[0].token_ids for c in engine(tiny).generate(PROMPTS, params)]
    spec = engine(tiny, SpeculativeDecoder(BannedTokenDrafter(), max_model_len=500))
    assert [c[0].token_ids for c in spec.generate(PROMPTS, params)] == plain
    stats = spec.spec.stats
    # every request: a window of 4 verifications from its first output token (outputs 1 -> 5), then
    # plain decoding: its shadow windows (the same drafter over the decoded tokens) accept nothing
    assert (stats.accepted_tokens, stats.proposed_tokens) == (0, 3 * ACCEPTANCE_WINDOW * 4)


class LateNgramDrafter(BannedTokenDrafter):
    """Drafts :data:`BANNED` for contexts shorter than 40 tokens, prompt lookup's drafts after; a
    host function of the context, so shadow windows replay it."""

    host_replayable = True

    def propose(self, requests, device):
        return pad_drafts([propose_ngram(r.token_ids, min(4, r.max_drafts)) if len(r.token_ids) >= 40
                           else [BANNED] * min(4, r.max_drafts) for r in requests], 4, device)


@pytest.mark.parametrize("num_scheduler_steps", [1, 8])
def test_a_paused_request_drafts_again_once_its_shadow_window_passes(tiny, num_scheduler_steps):
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True, logit_bias=((BANNED, -100.0),))
    prompt = [[9, 8, 7, 6, 5, 4, 3]]  # its greedy output falls into a loop after about 25 tokens
    plain = engine(tiny, num_scheduler_steps=num_scheduler_steps).generate(prompt, params)[0][0].token_ids
    spec = engine(tiny, SpeculativeDecoder(LateNgramDrafter(), max_model_len=500), num_scheduler_steps=num_scheduler_steps)
    assert spec.generate(prompt, params)[0][0].token_ids == plain
    stats = spec.spec.stats
    # the first window (BANNED) stopped verification; a shadow window over its looping output resumed it
    assert stats.proposed_tokens > ACCEPTANCE_WINDOW * 4 and stats.accepted_tokens > 0


def test_verification_batches_replay_the_full_graphs_of_query_length_k_plus_1(tiny):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [[11, 12, 13, 14, 11, 12, 13, 14, 11, 12, 13], [7, 8, 9, 7, 8, 9, 7, 8]]
    plain = [c[0].token_ids for c in engine(tiny).generate(prompts, params)]
    spec = engine(tiny, graphs=True, k=3, speculative=SpeculativeDecoder(NgramDrafter(3), max_model_len=500))
    assert [c[0].token_ids for c in spec.generate(prompts, params)] == plain
    replays = spec.runner.graph_runner.stats.replays
    # two requests verify together (8 token rows), then the longer one alone (4 rows)
    assert {label for label in replays if label.endswith("-q4")} == {"full-t8-r2-q4", "full-t4-r1-q4"}
    assert spec.spec.stats.verifications > 0


def test_a_multi_step_run_is_not_continued_so_that_a_later_step_can_draft(tiny):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logit_bias=((BANNED, -100.0),))
    plain = [c[0].token_ids for c in engine(tiny, num_scheduler_steps=8).generate(PROMPTS[:1], params)]
    spec = engine(tiny, SpeculativeDecoder(LateDrafter(), max_model_len=500), num_scheduler_steps=8)
    assert [c[0].token_ids for c in spec.generate(PROMPTS[:1], params)] == plain
    assert spec.spec.stats.proposed_tokens == ACCEPTANCE_WINDOW * 4  # one window from output token 9 on, then paused


def test_a_draft_model_drafter_plugs_into_the_engine_and_the_target_itself_as_draft_is_always_accepted(tiny):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = [c[0].token_ids for c in engine(tiny).generate(PROMPTS[:2], params)]
    drafter = DraftModelDrafter(tiny.model, 3, tiny.config.vocab_size, num_kv_blocks=64, block_size=16)
    spec = engine(tiny, SpeculativeDecoder(drafter, max_model_len=500))
    assert [c[0].token_ids for c in spec.generate(PROMPTS[:2], params)] == plain
    stats = spec.spec.stats
    assert stats.proposed_tokens > 0 and stats.accepted_tokens == stats.proposed_tokens

