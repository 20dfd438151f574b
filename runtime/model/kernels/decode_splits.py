"""How many context splits a decode attention call makes (flash-decoding's split count).

The decode attention (``decode_attention.py``) runs one program per (request, KV head, split); more
splits fill more of the device for a small batch, and each split adds partials that a combine step
merges (the combine kernel, or the O projection at batch 1: ``o_proj.py``). The count is a function
of shapes only (batch rows, KV heads, the block table's capacity, the device's multiprocessors), so
a captured graph's split count is fixed and its replays agree with its warmup. Fewer, longer splits
(at most one per 128 or 256 tokens of the table) measured slower at batch 1 (bench/RESULTS.md, "Three
leads measured and dropped").
"""

from __future__ import annotations

import math

MAX_SPLITS = 32
"""Upper bound on context splits per (request, KV head); the combine kernel reads this many slots."""


def choose_num_splits(num_rows: int, num_kv_heads: int, max_context: int, block_n: int, target_programs: int) -> int:
    """Context splits per (request, KV head): enough programs to fill the device, no more.

    ``ceil(target_programs / (num_rows * num_kv_heads))``, at most :data:`MAX_SPLITS`, at most the
    number of ``block_n`` tiles in ``max_context`` (the block table's capacity); at least 1. A
    function of shapes only, so a captured graph's split count is fixed.
    """
    if num_rows <= 0 or num_kv_heads <= 0:
        return 1
    wanted = math.ceil(target_programs / (num_rows * num_kv_heads))
    return max(1, min(wanted, MAX_SPLITS, math.ceil(max(max_context, 1) / block_n)))
