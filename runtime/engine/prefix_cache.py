"""Prefix caching: full KV blocks addressed by their content, shared across requests, kept until evicted.

A *full* block (all ``block_size`` slots hold K/V of known tokens) is named by its block hash::

    hash_i = sha256(hash_{i-1} | extra | token ids of block i)      (hash_{-1} = ROOT_HASH)

so equal hashes mean equal tokens in the block *and* in every block before it: the same K/V, since
a token's K/V depends on it and on the tokens before it only (as in vLLM's and SGLang's paged
caches). ``extra`` holds anything else that changes the K/V of the same tokens — empty for the
base model; a LoRA adapter's id, say, when adapters arrive — and is hashed into every block. A
cryptographic hash, not Python's ``hash``: that one is deterministic for ints, so a client could
craft a prompt whose block collides with another client's and read its K/V (vLLM moved to sha256
for the same reason). Hashes never leave the process: the token ids are hashed in native byte order.

:class:`PrefixCache` maps block hash -> block id and back, and keeps the *evictor*: cached blocks
no sequence references, least recently freed first. The block allocator
(:class:`~graphserving.runtime.engine.block_manager.BlockAllocator`) parks a cached block there
when its last reference goes and takes it out when a request hits it; it evicts (drops the hash of)
the least recently freed one only when no uncached block is free. A block referenced by a live
sequence is never in the evictor, so it is never evicted or handed to another sequence.

Everything here is host-side bookkeeping; the K/V itself stays where it was written.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes
"""A sha256 digest (32 bytes)."""

ROOT_HASH: BlockHash = hashlib.sha256(b"graphserving prefix cache v1").digest()
"""The parent hash of a sequence's first block."""


def block_hash(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """The hash of one full block (module docstring): its parent's hash, ``extra``, its tokens.

    Args:
        parent: the previous block's hash, :data:`ROOT_HASH` for the first block.
        token_ids: the block's ``block_size`` token ids (each in [0, 2**32)).
        extra: what else changes the block's K/V (module docstring); b"" for the base model.
    """
    h = hashlib.sha256(parent)
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    h.update(array("I", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], num_blocks: int, block_size: int, extra: bytes = b""
) -> list[BlockHash]:
    """Append to ``hashes`` the hashes of blocks ``len(hashes) .. num_blocks - 1`` of ``token_ids``
    (each must be full: ``num_blocks * block_size <= len(token_ids)``); returns ``hashes``.

    Incremental: a sequence keeps its list and each call hashes only the blocks it has not yet.
    """
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), num_blocks):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class PrefixCacheStats:
    """Totals since the engine started (the worker report's ``prefixCache``, the metrics' counters).

    Attributes:
        enabled: whether prefix caching is on (``EngineLimits.prefix_caching``).
        query_tokens: tokens of the sequences admitted with a lookup (prompt, and outputs of a
            preempted sequence), counted at each admission.
        hit_tokens: of those, tokens found cached (their prefill was skipped).
        cached_blocks: blocks holding a registered hash now, referenced or evictable.
    """

    enabled: bool
    query_tokens: int
    hit_tokens: int
    cached_blocks: int


class PrefixCache:
    """Block hash <-> block id, and the LRU evictor of cached blocks no sequence references.

    Invariants (checked by :meth:`check`): the two maps are inverse; every evictable block is
    cached. Reference counts live in the allocator, which decides when a block enters or leaves
    the evictor.
    """

    def __init__(self) -> None:
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._evictor: OrderedDict[int, None] = OrderedDict()

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a registered hash (referenced or evictable)."""
        return len(self._hash_of)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictor)

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def is_evictable(self, block: int) -> bool:
        return block in self._evictor

    def hash_of(self, block: int) -> BlockHash | None:
        return self._hash_of.get(block)

    def lookup(self, hashes: Iterable[BlockHash]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (pure: nothing is taken)."""
        blocks = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def register(self, block: int, h: BlockHash) -> bool:
        """Name a full, referenced block by its hash. False (nothing changes) when the block is
        already named or another block holds the same content (the block stays private then)."""
        if block in self._hash_of or h in self._block_of:
            return False
        self._block_of[h] = block
        self._hash_of[block] = h
        return True

    def park(self, block: int) -> None:
        """A cached block lost its last reference: it becomes the most recently freed evictable one."""
        self._evictor[block] = None

    def unpark(self, block: int) -> None:
        """An evictable block is referenced again (a cache hit)."""
        del self._evictor[block]

    def evict(self) -> int | None:
        """Take the least recently freed evictable block out of the cache (its hash is dropped);
        None when none is evictable."""
        if not self._evictor:
            return None
        block, _ = self._evictor.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        return block

    def clear(self) -> list[int]:
        """Forget every hash; return the evictable blocks (unreferenced: the allocator frees them)."""
        evictable = list(self._evictor)
        self._block_of.clear()
        self._hash_of.clear()
        self._evictor.clear()
        return evictable

    def check(self) -> None:
        """Raise AssertionError when an invariant (class docstring) does not hold (tests)."""
        assert {b: h for h, b in self._block_of.items()} == self._hash_of, "hash maps are not inverse"
        assert all(b in self._hash_of for b in self._evictor), "an evictable block has no hash"
