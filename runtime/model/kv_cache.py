"""The paged KV cache tensors: one tensor per layer, split into fixed-size blocks.

Layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` — index 0 holds keys,
1 values. A token's flat slot is ``block * block_size + offset`` (the slot mapping); a request's
block table lists its block ids in order. Block 0 is ``NULL_BLOCK``
(runtime/model/forward_metadata.py): the block allocator never hands it out, padded rows write into it
and unused block-table entries point at it, so its contents are garbage by design.
"""

from __future__ import annotations

import torch

from .kv_layout import NULL_BLOCK
from .config import ModelConfig


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers: ``2 * L * block_size * Hkv * D * itemsize``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * itemsize


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """Allocate the KV cache, one zero-filled tensor per layer.

    Zero-filled so that every slot holds a finite value from the start: attention multiplies
    masked-out slots by a probability of exactly zero, which would still turn a NaN bit pattern from
    uninitialised memory into NaN.

    Args:
        config: the model's configuration (layers, KV heads, head_dim).
        num_blocks: blocks per layer, including the reserved ``NULL_BLOCK`` (so at least 2).
        block_size: token slots per block.
        dtype: element type (normally the model dtype).
        device: where the cache lives.

    Returns:
        ``num_hidden_layers`` tensors of shape [2, num_blocks, block_size, num_kv_heads, head_dim].

    Raises:
        ValueError: ``num_blocks`` < 2 (only the null block) or ``block_size`` <= 0.
    """
    if num_blocks < NULL_BLOCK + 2:
        raise ValueError(f"num_blocks must be at least 2 (block {NULL_BLOCK} is the reserved null block), got {num_blocks}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
