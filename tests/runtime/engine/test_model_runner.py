"""prepare_inputs: the ForwardMetadata and sampling tensors built from a scheduled batch."""

import pytest
import torch

from graphserving.runtime.engine.block_manager import BlockManager
from graphserving.runtime.model.kv_layout import NULL_BLOCK
from graphserving.runtime.engine.model_runner import ModelRunner
from graphserving.runtime.engine.scheduler import Scheduler
from graphserving.runtime.engine.sequence import SamplingParams, Sequence

VOCAB = 100


def seq(name: str, prompt: list[int], params: SamplingParams | None = None, seed: int = 0) -> Sequence:
    params = params or SamplingParams(max_tokens=8, temperature=0.0)
    return Sequence(seq_id=name, request_id=name, index=0, prompt_token_ids=prompt, params=params, seed=seed,
                    max_tokens=params.max_tokens)


def mixed_batch():
    """A decode row (``dec``, 5 tokens cached) and a prefill chunk (``pre``, 4 of 7 prompt tokens)."""
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=5)
    dec = seq("dec", [11, 12, 13, 14, 15], SamplingParams(max_tokens=8, temperature=0.7, top_k=5, seed=3), seed=3)
    sched.add(dec)
    sched.commit(sched.schedule())  # prefill all 5 prompt tokens: blocks 1, 2
    dec.output_token_ids.append(16)
    pre = seq("pre", [21, 22, 23, 24, 25, 26, 27])
    sched.add(pre)
    out = sched.schedule()  # dec: 1 token; pre: 4 tokens (budget 5)
    return bm, out, dec, pre


def test_metadata_lays_out_tokens_request_after_request():
    bm, out, dec, pre = mixed_batch()
    model_input = ModelRunner(None, [], bm, VOCAB, "cpu").prepare_inputs(out)
    meta = model_input.meta
    assert meta.input_ids.tolist() == [16, 21, 22, 23, 24]
    assert meta.positions.tolist() == [5, 0, 1, 2, 3]
    assert meta.query_lens.tolist() == [1, 4]
    assert meta.seq_lens.tolist() == [6, 4]
    assert meta.query_start_loc.tolist() == [0, 1, 5]
    assert (meta.num_actual_tokens, meta.num_actual_reqs, meta.max_query_len) == (5, 2, 4)
    assert meta.query_lens_cpu == [1, 4] and meta.seq_lens_cpu == [6, 4]
    assert meta.input_ids.dtype == torch.int64 and meta.seq_lens.dtype == torch.int32
    assert meta.block_table.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64


def test_slot_mapping_and_block_table_come_from_the_block_manager():
    bm, out, dec, pre = mixed_batch()
    meta = ModelRunner(None, [], bm, VOCAB, "cpu").prepare_inputs(out).meta
    dec_blocks, pre_blocks = bm.block_table("dec"), bm.block_table("pre")
    assert NULL_BLOCK not in dec_blocks + pre_blocks
    # dec position 5 -> its second block, offset 1; pre positions 0..3 -> its first block
    assert meta.slot_mapping.tolist() == [dec_blocks[1] * 4 + 1] + [pre_blocks[0] * 4 + i for i in range(4)]
    assert meta.block_table.tolist() == [dec_blocks, pre_blocks + [NULL_BLOCK] * (len(dec_blocks) - len(pre_blocks))]


def test_only_rows_that_reach_their_last_token_sample():
    bm, out, dec, pre = mixed_batch()
    model_input = ModelRunner(None, [], bm, VOCAB, "cpu").prepare_inputs(out)
    assert model_input.meta.logits_indices.tolist() == [0]  # the prefill chunk stops short of its prompt's end
    assert [r.seq for r in model_input.sample_rows] == [dec]
    s = model_input.sampling
    assert s.temperature.tolist() == pytest.approx([0.7])
    assert s.top_k.tolist() == [5]
    assert s.seeds.tolist() == [3]
    assert s.steps.tolist() == [1]  # one token generated so far: the RNG counter
    assert not s.all_greedy and s.do_top_k_top_p and not s.do_penalties


def test_disabled_top_k_becomes_the_vocabulary_size_and_penalties_pad_with_it():
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a = seq("a", [1, 2, 3], SamplingParams(max_tokens=4, temperature=1.0, repetition_penalty=1.2))
    b = seq("b", [4], SamplingParams(max_tokens=4, temperature=0.0, top_k=-1))
    sched.add(a)
    sched.add(b)
    s = ModelRunner(None, [], bm, VOCAB, "cpu").prepare_inputs(sched.schedule()).sampling
    assert s.top_k.tolist() == [VOCAB, VOCAB]
    assert s.do_penalties
    assert s.prompt_token_ids.tolist() == [[1, 2, 3], [4, VOCAB, VOCAB]]
    assert s.output_token_ids.shape == (2, 0)
    assert s.repetition_penalty.tolist() == pytest.approx([1.2, 1.0])
