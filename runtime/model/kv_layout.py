"""The two sentinels of the paged KV layout, in a module without torch.

The KV cache (:mod:`.kv_cache`) reserves block :data:`NULL_BLOCK`; the block manager never hands
it out, padded rows of a batch write into it and unused block-table entries point at it, so its
contents are garbage by design. :data:`PAD_SLOT_ID` marks a padded token row's slot; attention
and the KV write redirect it into the null block. The block manager, and the capture-size planner
through it, import these without importing torch (docs/architecture.md, "Layers").
"""

NULL_BLOCK = 0
"""Block id reserved by the KV cache, never given to a sequence; padding points here."""

PAD_SLOT_ID = -1
"""Slot-mapping sentinel for padded token rows: the write is redirected into the null block."""
