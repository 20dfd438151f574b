"""Paged KV-cache bookkeeping: a block allocator, per-sequence block tables and slot mapping.

The KV cache is ``num_blocks`` fixed-size blocks of ``block_size`` token slots. Block
:data:`~graphserving.runtime.model.forward_metadata.NULL_BLOCK` (0) is reserved: padded rows and
unused block-table entries point at it, so the allocator never hands it out. A token at position
``p`` of a sequence lives in slot ``block_table[p // block_size] * block_size + p % block_size``.

A few blocks may be reserved for good (:meth:`BlockManager.reserve`): the graph canary's scratch
blocks, set aside when the KV cache is sized so that proving graphs never needs a block a request
holds (runtime/graphs/canary.py, "KV blocks"). No sequence ever gets them.

Everything here is host-side integer bookkeeping; the model runner turns block tables and slot
mappings into tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from ..model.kv_layout import NULL_BLOCK


class NoFreeBlocksError(RuntimeError):
    """The allocator is empty. The scheduler checks capacity first, so this signals a bug."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockAllocator:
    """Free list and reference counts over block ids ``1 .. num_blocks - 1``.

    A block is free when its reference count is 0. :meth:`fork` adds a reference (a block shared by
    two sequences, e.g. a common prompt prefix); :meth:`free` drops one and returns the block to the
    free list when none is left.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block {NULL_BLOCK} is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(b for b in range(num_blocks) if b != NULL_BLOCK)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a sequence can ever get (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def allocate(self) -> int:
        """Take one free block (reference count 1). Raises :class:`NoFreeBlocksError` when none is free."""
        if not self._free:
            raise NoFreeBlocksError(f"all {self.num_usable_blocks} KV blocks are in use")
        block = self._free.popleft()
        self._ref_counts[block] = 1
        return block

    def fork(self, block: int) -> int:
        """Add a reference to an allocated block and return it."""
        self._check_allocated(block)
        self._ref_counts[block] += 1
        return block

    def free(self, block: int) -> None:
        """Drop one reference; the block returns to the free list when its count reaches 0."""
        self._check_allocated(block)
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free.append(block)

    def _check_allocated(self, block: int) -> None:
        if block == NULL_BLOCK or not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} is not an allocatable block id (1..{self.num_blocks - 1})")
        if self._ref_counts[block] <= 0:
            raise ValueError(f"block {block} is not allocated (double free?)")


class BlockManager:
    """Block tables of live sequences over one :class:`BlockAllocator`.

    Args:
        num_blocks: blocks in the KV cache, the null block included.
        block_size: token slots per block.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self._reserved: list[int] = []

    @property
    def num_total_blocks(self) -> int:
        """Blocks sequences can ever get: the usable ones (the null block excluded) less the reserved ones."""
        return self.allocator.num_usable_blocks - len(self._reserved)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by sequences (the reserved ones are not counted)."""
        return self.allocator.num_used_blocks - len(self._reserved)

    @property
    def reserved_blocks(self) -> list[int]:
        """The blocks :meth:`reserve` set aside (a copy), in the order they were reserved."""
        return list(self._reserved)

    def reserve(self, count: int) -> list[int]:
        """Set ``count`` free blocks aside for good, outside every sequence; return them.

        They never return to the free list: :attr:`num_total_blocks` and :attr:`capacity_tokens`
        shrink by ``count``, :attr:`num_free_blocks` by ``count`` too. Their owner (the lifecycle's
        graph canary) writes scratch K/V into them; no block table of a sequence ever names them.

        Raises:
            ValueError: ``count`` is negative or more than the free blocks (nothing is reserved then).
        """
        if not 0 <= count <= self.allocator.num_free_blocks:
            raise ValueError(
                f"cannot reserve {count} KV blocks: {self.allocator.num_free_blocks} are free "
                "(reserve when the KV cache is sized, before any request)"
            )
        new = [self.allocator.allocate() for _ in range(count)]
        self._reserved.extend(new)
        return new

    @property
    def capacity_tokens(self) -> int:
        """Longest sequence that fits when it has the whole cache to itself."""
        return self.num_total_blocks * self.block_size

    def block_table(self, seq_id: str) -> list[int]:
        return self.block_tables.get(seq_id, [])

    def num_blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """New blocks ``seq_id`` needs so that its first ``num_tokens`` tokens have slots."""
        return max(0, cdiv(num_tokens, self.block_size) - len(self.block_table(seq_id)))

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Whether :meth:`allocate` for ``num_tokens`` tokens would succeed now."""
        return self.num_blocks_needed(seq_id, num_tokens) <= self.allocator.num_free_blocks

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow the block table of ``seq_id`` to hold ``num_tokens`` tokens; return the new blocks.

        Raises:
            NoFreeBlocksError: not enough free blocks (nothing is allocated then).
        """
        needed = self.num_blocks_needed(seq_id, num_tokens)
        if needed > self.allocator.num_free_blocks:
            raise NoFreeBlocksError(
                f"sequence {seq_id} needs {needed} more KV blocks, {self.allocator.num_free_blocks} are free"
            )
        new = [self.allocator.allocate() for _ in range(needed)]
        self.block_tables.setdefault(seq_id, []).extend(new)
        return new

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """Share the parent's *full* blocks holding its first ``num_tokens`` tokens with a new child.

        Only full blocks are shared, so neither sequence ever writes into a shared block.
        """
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        shared = self.block_table(parent_id)[: num_tokens // self.block_size]
        self.block_tables[child_id] = [self.allocator.fork(b) for b in shared]

    def free(self, seq_id: str) -> None:
        """Release every block of ``seq_id`` (a no-op for an unknown sequence)."""
        for block in reversed(self.block_tables.pop(seq_id, [])):
            self.allocator.free(block)

    def slot_mapping(self, seq_id: str, start: int, end: int) -> list[int]:
        """Flat KV slots of token positions ``start .. end - 1`` of ``seq_id``.

        Raises:
            ValueError: a position has no block yet (allocate first).
        """
        return slots_for_positions(self.block_table(seq_id), range(start, end), self.block_size)


def slots_for_positions(block_table: list[int], positions: Iterable[int], block_size: int) -> list[int]:
    """``block_table[p // block_size] * block_size + p % block_size`` for each position ``p``."""
    slots = []
    for p in positions:
        idx = p // block_size
        if idx >= len(block_table):
            raise ValueError(f"position {p} has no KV block (block table holds {len(block_table)} blocks)")
        slots.append(block_table[idx] * block_size + p % block_size)
    return slots
