"""Paged KV-cache bookkeeping: a block allocator, per-sequence block tables and slot mapping.

The KV cache is ``num_blocks`` fixed-size blocks of ``block_size`` token slots. Block
:data:`~graphserving.runtime.model.forward_metadata.NULL_BLOCK` (0) is reserved: padded rows and
unused block-table entries point at it, so the allocator never hands it out. A token at position
``p`` of a sequence lives in slot ``block_table[p // block_size] * block_size + p % block_size``.

A few blocks may be reserved for good (:meth:`BlockManager.reserve`): the graph canary's scratch
blocks, set aside when the KV cache is sized so that proving graphs never needs a block a request
holds (runtime/graphs/canary.py, "KV blocks"). No sequence ever gets them, and they are never cached.

Prefix caching (:mod:`.prefix_cache`, with ``prefix_caching=True``): a sequence's full blocks
are registered under their block hash (:meth:`BlockManager.cache_full_blocks`); a new sequence
starts its block table with the longest cached prefix of its own block hashes
(:meth:`BlockManager.cached_prefix`, then :meth:`BlockManager.allocate` with ``cached``), one more
reference each. A cached block whose last reference goes stays cached, *evictable*: it counts as
free (:attr:`BlockManager.num_free_blocks`, hence the KV-usage metrics) and is handed out again,
its hash dropped, only when no uncached block is free, least recently freed first. A block anything
else allocates (the canary's and the capacity measurement's borrowed blocks, runtime/lifecycle/)
is never registered, so scratch K/V is never served from the cache.

Everything here is host-side integer bookkeeping; the model runner turns block tables and slot
mappings into tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from ..model.kv_layout import NULL_BLOCK
from .prefix_cache import BlockHash, PrefixCache


class NoFreeBlocksError(RuntimeError):
    """The allocator is empty. The scheduler checks capacity first, so this signals a bug."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockAllocator:
    """Free list and reference counts over block ids ``1 .. num_blocks - 1``, and the prefix cache.

    A block is free when its reference count is 0. :meth:`fork` adds a reference (a block shared by
    two sequences, e.g. a common prompt prefix); :meth:`free` drops one; at 0 an uncached block
    returns to the free list, a cached one to the cache's evictor (:mod:`.prefix_cache`), still
    counted free. :meth:`allocate` takes an uncached free block first, else evicts the least
    recently freed cached one; :meth:`take` adds a reference to a cached block (a cache hit).

    Args:
        num_blocks: blocks in the KV cache, the null block included.
        cache: the prefix cache, or None (prefix caching off: no block is ever cached).
    """

    def __init__(self, num_blocks: int, cache: PrefixCache | None = None):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block {NULL_BLOCK} is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.cache = cache
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(b for b in range(num_blocks) if b != NULL_BLOCK)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a sequence can ever get (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no one references: uncached ones and evictable cached ones."""
        return len(self._free) + (self.cache.num_evictable_blocks if self.cache is not None else 0)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def allocate(self) -> int:
        """Take one free block (reference count 1): an uncached one, else the least recently freed
        cached one, whose hash is dropped. Raises :class:`NoFreeBlocksError` when none is free."""
        if self._free:
            block = self._free.popleft()
        elif self.cache is not None and (evicted := self.cache.evict()) is not None:
            block = evicted
        else:
            raise NoFreeBlocksError(f"all {self.num_usable_blocks} KV blocks are in use")
        self._ref_counts[block] = 1
        return block

    def take(self, block: int) -> int:
        """Add a reference to a cached block (a cache hit), evictable or not; return it.

        Raises:
            ValueError: the block is not cached.
        """
        if self.cache is None or not self.cache.is_cached(block):
            raise ValueError(f"block {block} is not in the prefix cache")
        if self._ref_counts[block] == 0:
            self.cache.unpark(block)
        self._ref_counts[block] += 1
        return block

    def fork(self, block: int) -> int:
        """Add a reference to an allocated block and return it."""
        self._check_allocated(block)
        self._ref_counts[block] += 1
        return block

    def free(self, block: int) -> None:
        """Drop one reference; at 0 the block returns to the free list, or to the evictor when cached."""
        self._check_allocated(block)
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            if self.cache is not None and self.cache.is_cached(block):
                self.cache.park(block)
            else:
                self._free.append(block)

    def release_evicted(self, blocks: Iterable[int]) -> None:
        """Return unreferenced blocks the cache let go of all at once (:meth:`PrefixCache.clear`)
        to the free list."""
        self._free.extend(blocks)

    def _check_allocated(self, block: int) -> None:
        if block == NULL_BLOCK or not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} is not an allocatable block id (1..{self.num_blocks - 1})")
        if self._ref_counts[block] <= 0:
            raise ValueError(f"block {block} is not allocated (double free?)")


class BlockManager:
    """Block tables of live sequences over one :class:`BlockAllocator` (and its prefix cache).

    Args:
        num_blocks: blocks in the KV cache, the null block included.
        block_size: token slots per block.
        prefix_caching: share full blocks across sequences by content (module docstring). Off
            unless asked for: the engine passes ``EngineLimits.prefix_caching`` (on by default);
            a simulation over dummy token ids (the capture-size planner's replay) must not hit.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.cache = PrefixCache() if prefix_caching else None
        self.allocator = BlockAllocator(num_blocks, self.cache)
        self.block_tables: dict[str, list[int]] = {}
        self._reserved: list[int] = []
        self._num_registered: dict[str, int] = {}  # leading blocks of each table already offered to the cache

    @property
    def prefix_caching(self) -> bool:
        return self.cache is not None

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a registered block hash, referenced or evictable (0 with caching off)."""
        return self.cache.num_cached_blocks if self.cache is not None else 0

    @property
    def num_total_blocks(self) -> int:
        """Blocks sequences can ever get: the usable ones (the null block excluded) less the reserved ones."""
        return self.allocator.num_usable_blocks - len(self._reserved)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence references, evictable cached ones included (they are handed out
        when nothing else is free)."""
        return self.allocator.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by sequences (the reserved and the evictable ones are not counted)."""
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

    def num_blocks_needed(self, seq_id: str, num_tokens: int, cached: Sequence[int] = ()) -> int:
        """New blocks ``seq_id`` needs so that its first ``num_tokens`` tokens have slots, past its
        block table and the ``cached`` blocks it would start with."""
        return max(0, cdiv(num_tokens, self.block_size) - len(self.block_table(seq_id)) - len(cached))

    def can_allocate(self, seq_id: str, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Whether :meth:`allocate` for ``num_tokens`` tokens (starting with ``cached``) would
        succeed now: a hit on an evictable block takes it out of the free ones."""
        return self.num_blocks_needed(seq_id, num_tokens, cached) <= self._free_after(cached)

    def _free_after(self, cached: Sequence[int]) -> int:
        return self.allocator.num_free_blocks - sum(1 for b in cached if self.allocator.ref_count(b) == 0)

    def cached_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (a sequence's block hashes,
        :func:`~.prefix_cache.extend_block_hashes`); nothing is taken. [] with caching off."""
        return self.cache.lookup(hashes) if self.cache is not None else []

    def allocate(self, seq_id: str, num_tokens: int, cached: Sequence[int] = ()) -> list[int]:
        """Grow the block table of ``seq_id`` to hold ``num_tokens`` tokens; return the new blocks.

        ``cached`` (from :meth:`cached_prefix`, for a sequence without blocks) starts the table:
        one more reference each, not among the returned new blocks; they count as registered.

        Raises:
            NoFreeBlocksError: not enough free blocks (nothing is allocated then).
            ValueError: ``cached`` for a sequence that already has blocks.
        """
        if cached and self.block_table(seq_id):
            raise ValueError(f"sequence {seq_id} already has KV blocks: cached blocks only start a block table")
        needed = self.num_blocks_needed(seq_id, num_tokens, cached)
        if needed > self._free_after(cached):
            raise NoFreeBlocksError(
                f"sequence {seq_id} needs {needed} more KV blocks, {self._free_after(cached)} are free"
            )
        table = self.block_tables.setdefault(seq_id, [])
        if cached:
            table.extend(self.allocator.take(b) for b in cached)
            self._num_registered[seq_id] = len(cached)
        new = [self.allocator.allocate() for _ in range(needed)]
        table.extend(new)
        return new

    def cache_full_blocks(self, seq_id: str, hashes: Sequence[BlockHash], num_blocks: int) -> None:
        """Register the first ``num_blocks`` blocks of ``seq_id``'s table under ``hashes`` (block
        ``i``'s hash is ``hashes[i]``). The caller vouches that they are full and their K/V
        written (or queued on the device stream before any later reader). Blocks offered before
        are skipped, so a call per step costs O(new blocks); a block whose content another block
        already holds stays private. A no-op with caching off.
        """
        done = self._num_registered.get(seq_id, 0)
        if self.cache is None or num_blocks <= done:
            return
        table = self.block_table(seq_id)
        end = min(num_blocks, len(table), len(hashes))
        for i in range(done, end):
            self.cache.register(table[i], hashes[i])
        self._num_registered[seq_id] = max(done, end)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """Share the parent's *full* blocks holding its first ``num_tokens`` tokens with a new child.

        Only full blocks are shared, so neither sequence ever writes into a shared block.
        """
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        shared = self.block_table(parent_id)[: num_tokens // self.block_size]
        self.block_tables[child_id] = [self.allocator.fork(b) for b in shared]

    def free(self, seq_id: str) -> None:
        """Release every block of ``seq_id`` (a no-op for an unknown sequence). Last block first:
        cached ones enter the evictor tail first, so a prefix outlives its continuations."""
        self._num_registered.pop(seq_id, None)
        for block in reversed(self.block_tables.pop(seq_id, [])):
            self.allocator.free(block)

    def drop_prefix_cache(self) -> int:
        """Forget every cached block (their K/V no longer matches their tokens: a weight reload in
        place, say); evictable ones become plain free blocks, referenced ones stay with their
        sequences, private. Returns how many blocks were cached."""
        if self.cache is None:
            return 0
        count = self.cache.num_cached_blocks
        self.allocator.release_evicted(self.cache.clear())
        self._num_registered = {seq_id: len(table) for seq_id, table in self.block_tables.items()}
        return count

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
