"""Block allocator and block tables: the null block is never handed out, counts are exact."""

import pytest

from graphserving.runtime.engine.block_manager import BlockAllocator, BlockManager, NoFreeBlocksError, slots_for_positions
from graphserving.runtime.model.kv_layout import NULL_BLOCK


def test_allocator_never_hands_out_the_null_block():
    alloc = BlockAllocator(5)
    blocks = [alloc.allocate() for _ in range(4)]
    assert sorted(blocks) == [1, 2, 3, 4]
    assert NULL_BLOCK not in blocks
    with pytest.raises(NoFreeBlocksError):
        alloc.allocate()


def test_allocator_needs_a_block_besides_the_null_block():
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockAllocator(1)


def test_a_forked_block_returns_to_the_free_list_only_after_its_last_reference():
    alloc = BlockAllocator(3)
    b = alloc.allocate()
    alloc.fork(b)
    assert alloc.ref_count(b) == 2
    alloc.free(b)
    assert alloc.num_free_blocks == 1
    alloc.free(b)
    assert alloc.num_free_blocks == 2
    assert alloc.ref_count(b) == 0


def test_double_free_and_freeing_the_null_block_are_refused():
    alloc = BlockAllocator(3)
    b = alloc.allocate()
    alloc.free(b)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(b)
    with pytest.raises(ValueError, match="not an allocatable block"):
        alloc.free(NULL_BLOCK)


def test_block_table_grows_by_whole_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    assert bm.allocate("a", 5) == [1, 2]
    assert bm.allocate("a", 8) == []  # 8 tokens still fit in 2 blocks
    assert bm.allocate("a", 9) == [3]
    assert bm.block_table("a") == [1, 2, 3]
    assert bm.num_used_blocks == 3
    assert bm.num_free_blocks == 6


def test_slot_mapping_follows_the_block_table():
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.allocate("x", 2)  # block 1
    bm.allocate("y", 4)  # block 2
    bm.allocate("x", 6)  # block 3
    assert bm.block_table("x") == [1, 3]
    # positions 2..5 of x: block 1 offsets 2, 3, then block 3 offsets 0, 1
    assert bm.slot_mapping("x", 2, 6) == [6, 7, 12, 13]


def test_slot_mapping_of_a_position_without_a_block_is_an_error():
    with pytest.raises(ValueError, match="position 4 has no KV block"):
        slots_for_positions([1], [4], 4)


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate("a", 2)
    assert not bm.can_allocate("b", 5)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("b", 5)
    assert bm.num_free_blocks == 1
    assert bm.block_table("b") == []


def test_free_returns_every_block():
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.allocate("a", 7)
    bm.free("a")
    assert bm.num_free_blocks == 5
    assert bm.block_table("a") == []
    bm.free("unknown")  # no-op


def test_fork_shares_only_full_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("parent", 10)  # blocks 1, 2 full, 3 partial
    bm.fork("parent", "child", 10)
    assert bm.block_table("child") == [1, 2]
    assert bm.allocator.ref_count(1) == 2
    assert bm.allocator.ref_count(3) == 1
    bm.free("parent")
    assert bm.num_used_blocks == 2
    bm.free("child")
    assert bm.num_used_blocks == 0


def test_capacity_excludes_the_null_block():
    bm = BlockManager(num_blocks=5, block_size=16)
    assert bm.num_total_blocks == 4
    assert bm.capacity_tokens == 64
