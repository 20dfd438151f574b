"""How many KV blocks a canary batch needs, and how many the lifecycle reserves for it
(runtime/graphs/canary.py, "KV blocks"): exactly enough for :func:`canary_batch_for` to fill a key."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from graphserving.runtime.graphs.canary import (  # noqa: E402
    CanaryCapacityError,
    canary_batch_for,
    canary_blocks_needed,
    canary_reserve,
)
from graphserving.runtime.graphs.key import GraphKeyContract, full_key, piecewise_key  # noqa: E402

CONTRACT = GraphKeyContract(model_revision="r" * 64, dtype="float32")
CPU = torch.device("cpu")
SHAPES = [(16, 256), (16, 17), (16, 8), (4, 2048), (1, 40)]  # (block_size, max_model_len)


def batch(key, blocks: int, block_size: int, max_model_len: int, seed: int = 0):
    return canary_batch_for(key, list(range(1, blocks + 1)), block_size, 300, max_model_len, CPU,
                            torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("block_size,max_model_len", SHAPES)
@pytest.mark.parametrize("tokens", [1, 2, 4, 5, 16, 61, 64, 100, 512])
def test_with_the_blocks_it_needs_a_piecewise_canary_fills_its_key(tokens, block_size, max_model_len):
    key = piecewise_key(tokens, CONTRACT)
    needed = canary_blocks_needed(key, block_size, max_model_len)
    for seed in range(3):
        meta = batch(key, needed, block_size, max_model_len, seed)
        assert meta.num_actual_tokens == tokens
        assert max(meta.seq_lens_cpu) <= max_model_len


@pytest.mark.parametrize("block_size,max_model_len", SHAPES)
@pytest.mark.parametrize("reqs", [1, 3, 8, 64])
def test_with_the_blocks_it_needs_a_full_canary_fills_its_key_with_contexts_of_two_blocks(reqs, block_size,
                                                                                           max_model_len):
    key = full_key(reqs, CONTRACT)
    needed = canary_blocks_needed(key, block_size, max_model_len)
    assert needed == reqs * min(2, math.ceil(max_model_len / block_size))
    meta = batch(key, needed, block_size, max_model_len)
    assert meta.num_actual_reqs == reqs and meta.num_actual_tokens == reqs
    assert max(meta.seq_lens_cpu) <= min(2 * block_size, max_model_len)


def test_one_block_less_gives_a_smaller_piecewise_batch():
    key = piecewise_key(64, CONTRACT)
    needed = canary_blocks_needed(key, 16, 256)
    assert needed == 8  # 3 decode rows + a 61-token chunk over one block of context (5 blocks)
    short = batch(key, needed - 1, 16, 256)
    full = batch(key, needed, 16, 256)
    assert sum(short.seq_lens_cpu) < sum(full.seq_lens_cpu)


def test_without_any_block_the_canary_is_a_capacity_error():
    with pytest.raises(CanaryCapacityError, match="no free KV blocks"):
        batch(full_key(4, CONTRACT), 0, 16, 256)


def test_the_reserve_is_what_the_largest_key_needs():
    largest = [full_key(64, CONTRACT), piecewise_key(2048, CONTRACT)]
    # FULL 64: 128 blocks; PIECEWISE 2048: 3 decode rows + a 2045-token chunk over a block of context
    assert canary_reserve(largest, block_size=16, max_model_len=8192, usable_blocks=100_000) == 3 + 129


def test_the_reserve_leaves_room_for_one_sequence_of_the_model_length():
    largest = [full_key(4, CONTRACT), piecewise_key(64, CONTRACT)]
    assert canary_reserve(largest, block_size=16, max_model_len=256, usable_blocks=63) == 8
    assert canary_reserve(largest, block_size=16, max_model_len=256, usable_blocks=20) == 4
    assert canary_reserve(largest, block_size=16, max_model_len=256, usable_blocks=16) == 0
    assert canary_reserve(largest, block_size=16, max_model_len=256, usable_blocks=3) == 0
