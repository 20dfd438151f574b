"""Requests that once broke a whole batch or produced garbage: each is refused alone or served sanely."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from graphserving.contract.graph_policy import GraphMode  # noqa: E402
from graphserving.runtime.graphs.canary import CanaryCapacityError, canary_batch_for, prefill_chunks  # noqa: E402
from graphserving.runtime.graphs.key import GraphKeyContract, dispatch, full_key, piecewise_key  # noqa: E402
from graphserving.runtime.engine.sequence import SamplingParams, SamplingParamsError  # noqa: E402

C = GraphKeyContract(model_revision="r", dtype="float32")


def test_a_top_k_beyond_32_bits_is_refused_naming_the_field():
    with pytest.raises(SamplingParamsError, match="top_k"):
        SamplingParams(top_k=2**63)


def test_a_repetition_penalty_that_would_overflow_the_logits_is_refused():
    with pytest.raises(SamplingParamsError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e-45)


def test_denormal_temperatures_sample_greedily():
    assert SamplingParams(temperature=1e-40).greedy
    assert not SamplingParams(temperature=0.5).greedy


def test_n_choices_from_the_largest_seed_wrap_instead_of_failing_the_step(make_engine, ids=(1, 2, 3)):
    params = SamplingParams(n=2, seed=2**63 - 1, max_tokens=2, temperature=1.0, ignore_eos=True)
    [choices] = make_engine().generate([list(ids)], params)
    assert [len(c.token_ids) for c in choices] == [2, 2]


def test_a_one_token_chunk_that_does_not_sample_is_not_uniform_decode():
    common = dict(num_tokens=4, num_reqs=4, max_query_len=1, mode=GraphMode.FULL_AND_PIECEWISE,
                  full_sizes=[4], piecewise_sizes=[8], contract=C, captured={full_key(4, C), piecewise_key(8, C)})
    assert dispatch(**common).key == full_key(4, C)
    assert dispatch(**common, samples_every_row=False).key == piecewise_key(8, C)


def test_a_canary_with_fewer_free_blocks_than_rows_runs_fewer_real_rows():
    meta = canary_batch_for(full_key(64, C), [5, 6, 7], 16, 1000, 512, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert meta.num_reqs == 3 and sorted(set(meta.block_table[:, 0].tolist())) == [5, 6, 7]
    piece = canary_batch_for(piecewise_key(256, C), [5, 6, 7], 16, 1000, 512, torch.device("cpu"),
                             torch.Generator().manual_seed(0))
    assert piece.num_tokens <= 256 and set(piece.block_table.flatten().tolist()) <= {0, 5, 6, 7}


def test_a_piecewise_canary_longer_than_the_model_splits_into_chunks_within_max_model_len():
    """A key of 2048 tokens on a 1024-token model: no position may pass the model's table."""
    meta = canary_batch_for(piecewise_key(2048, C), list(range(1, 3001)), 16, 1000, 1024, torch.device("cpu"),
                            torch.Generator().manual_seed(0))
    assert meta.num_tokens == 2048
    assert int(meta.positions.max()) < 1024 and int(meta.seq_lens.max()) <= 1024
    assert meta.query_lens.tolist()[:2] == [1024, 1021] and meta.query_lens.tolist()[2:] == [1, 1, 1]
    assert prefill_chunks(2045, 1000, 16) == [992, 992, 61]
    assert prefill_chunks(5, 8, 16) == [5] and prefill_chunks(20, 8, 16) == [8, 8, 4]


def test_a_canary_of_a_model_shorter_than_a_block_keeps_every_position_within_the_model():
    """max_model_len 8 with blocks of 16: each prefill chunk (8 tokens) takes a block of its own,
    and no decode row's context reaches past the model length."""
    meta = canary_batch_for(piecewise_key(40, C), list(range(1, 101)), 16, 1000, 8, torch.device("cpu"),
                            torch.Generator().manual_seed(0))
    assert meta.query_lens.tolist() == [8, 8, 8, 8, 5, 1, 1, 1]
    assert int(meta.positions.max()) == 7 and max(meta.seq_lens.tolist()) == 8


def test_a_canary_of_a_model_shorter_than_a_block_fits_the_few_blocks_borrowed():
    """Four borrowed blocks: three decode rows and one chunk of 8 tokens, padded to the key."""
    meta = canary_batch_for(piecewise_key(40, C), [5, 6, 7, 8], 16, 1000, 8, torch.device("cpu"),
                            torch.Generator().manual_seed(0))
    assert meta.query_lens.tolist() == [8, 1, 1, 1]
    assert meta.block_table.tolist() == [[5], [6], [7], [8]]
    assert int(meta.positions.max()) == 7


def test_a_canary_without_any_free_block_says_so():
    with pytest.raises(CanaryCapacityError):
        canary_batch_for(full_key(4, C), [], 16, 1000, 512, torch.device("cpu"), torch.Generator())
