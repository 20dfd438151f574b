"""How many context splits a decode attention call makes (flash-decoding's split count).

The decode attention (``decode_attention.py``) runs one program per (request, KV head, split); more
splits fill more of the device for a small batch, and each split adds partials that a combine step
merges (the combine kernel, or the O projection at batch 1: ``o_proj.py``). The count is a function
of shapes (batch rows, KV heads, the block table's capacity, the device's multiprocessors) and of
:data:`MIN_SPLIT_TOKENS`, read once at import, so a captured graph's split count is fixed and its
replays agree with its warmup.
"""

from __future__ import annotations

import math

from .backend import env_count

MAX_SPLITS = 32
"""Upper bound on context splits per (request, KV head); the combine kernel reads this many slots."""

MIN_SPLIT_TOKENS_ENV = "GRAPHSERVING_DECODE_MIN_SPLIT_TOKENS"


def min_split_tokens() -> int:
    """``GRAPHSERVING_DECODE_MIN_SPLIT_TOKENS`` as set now: the fewest context tokens (of the block
    table's capacity) a split may cover; 0 (the default, also when unset or blank) leaves the count to
    the device-filling rule alone. For A/B measurements of fewer, longer splits (at batch 1 a model of
    few KV heads then runs fewer programs but no combine step).

    Raises:
        ValueError: the variable is set to anything but a whole number >= 0.
    """
    return env_count(MIN_SPLIT_TOKENS_ENV, "a whole number of tokens >= 0", lowest=0) or 0


MIN_SPLIT_TOKENS = min_split_tokens()
""":func:`min_split_tokens` at import (a bad value fails the import with its message); what the decode
attention passes to :func:`choose_num_splits`. Reading it once keeps the environment off every
attention call's host path."""


def choose_num_splits(num_rows: int, num_kv_heads: int, max_context: int, block_n: int, target_programs: int,
                      min_tokens: int = 0) -> int:
    """Context splits per (request, KV head): enough programs to fill the device, no more.

    ``ceil(target_programs / (num_rows * num_kv_heads))``, at most :data:`MAX_SPLITS`, at most the
    number of ``block_n`` tiles in ``max_context`` (the block table's capacity) and, with
    ``min_tokens`` > 0, at most ``max_context // min_tokens``; at least 1. A function of shapes
    only, so a captured graph's split count is fixed.
    """
    if num_rows <= 0 or num_kv_heads <= 0:
        return 1
    wanted = math.ceil(target_programs / (num_rows * num_kv_heads))
    splits = min(wanted, MAX_SPLITS, math.ceil(max(max_context, 1) / block_n))
    if min_tokens > 0:
        splits = min(splits, max_context // min_tokens)
    return max(1, splits)
