"""The paged KV cache tensors: one tensor per layer, split into fixed-size blocks.

Layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` — index 0 holds keys,
1 values. A token's flat slot is ``block * block_size + offset`` (the slot mapping); a request's
block table lists its block ids in order. Block 0 is ``NULL_BLOCK``
(runtime/model/kv_layout.py): the block allocator never hands it out, padded rows write into it
and unused block-table entries point at it, so its contents are garbage by design.

The KV-cache size in blocks is decided here and nowhere else (:func:`num_kv_blocks`): the requested
count when one is given; otherwise :data:`CPU_DEFAULT_NUM_KV_BLOCKS` on the CPU, and on CUDA what
fits in a fraction of the free device memory less a reserve (the graphs' memory).
"""

from __future__ import annotations

import torch

from .kv_layout import NULL_BLOCK
from .config import ModelConfig

CPU_DEFAULT_NUM_KV_BLOCKS = 512
"""KV blocks (the null block included) when no count is requested and the device is not CUDA."""


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers: ``2 * L * block_size * Hkv * D * itemsize``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * itemsize


def kv_blocks_for_memory(free_bytes: int, fraction: float, bytes_per_block: int, reserve_bytes: int = 0) -> int:
    """KV blocks that fit in ``fraction`` of ``free_bytes`` less ``reserve_bytes`` (floor; pure).

    ``(int(free_bytes * fraction) - reserve_bytes) // bytes_per_block``, the null block included;
    negative when the reserve exceeds the budget.
    """
    return (int(free_bytes * fraction) - reserve_bytes) // bytes_per_block


def num_kv_blocks(
    requested: int | None,
    device: torch.device | str,
    bytes_per_block: int,
    memory_fraction: float,
    reserve_bytes: int | None = None,
) -> int:
    """The KV-cache size in blocks, the null block included (see the module docstring).

    Args:
        requested: a block count to use as is (``EngineLimits.num_kv_blocks``), or None to size.
        device: where the cache will live; only CUDA is sized from its free memory.
        bytes_per_block: bytes one block takes across all layers (:func:`kv_cache_bytes_per_block`).
        memory_fraction: the share of the free device memory the cache and the reserve may take
            (``EngineLimits.kv_cache_memory_fraction``, 0..1).
        reserve_bytes: bytes of that share kept for the captured graphs (their estimate and
            margin; the lifecycle passes it, 0 included), or None when nothing is reserved (an engine
            sized on its own).

    Returns:
        ``requested`` when given; :data:`CPU_DEFAULT_NUM_KV_BLOCKS` off CUDA; on CUDA
        ``(free * memory_fraction - reserve_bytes) // bytes_per_block``.

    Raises:
        RuntimeError: on CUDA, fewer than 2 blocks fit (the message gives the free bytes, and the
            reserved bytes when a reserve was passed).
    """
    if requested is not None:
        return requested
    device = torch.device(device)
    if device.type != "cuda":
        return CPU_DEFAULT_NUM_KV_BLOCKS
    free, _total = torch.cuda.mem_get_info(device)
    blocks = kv_blocks_for_memory(free, memory_fraction, bytes_per_block, reserve_bytes or 0)
    if blocks < 2:
        if reserve_bytes is not None:
            raise RuntimeError(f"no room for the KV cache: {free} bytes free, {reserve_bytes} reserved for graphs")
        raise RuntimeError(
            f"only {free} bytes of device memory are free: not enough for 2 KV blocks of {bytes_per_block} bytes"
        )
    return blocks


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


def checked_or_allocated(config: ModelConfig, given: list[torch.Tensor] | None, *, block_size: int,
                         num_blocks: int | None, memory_fraction: float, device: torch.device,
                         dtype: torch.dtype) -> list[torch.Tensor]:
    """The given KV caches checked against the model and the engine's limits, or (``given`` None)
    newly sized (:func:`num_kv_blocks`) and allocated (:func:`allocate_kv_cache`).

    Raises:
        ValueError: ``given`` does not have one tensor per layer, blocks of ``block_size`` tokens,
            or ``num_blocks`` blocks (when set).
    """
    if given is None:
        blocks = num_kv_blocks(num_blocks, device, kv_cache_bytes_per_block(config, block_size, dtype), memory_fraction)
        return allocate_kv_cache(config, blocks, block_size, dtype, device)
    if len(given) != config.num_hidden_layers:
        raise ValueError(f"kv_caches has {len(given)} tensors; the model has {config.num_hidden_layers} layers")
    blocks, size = given[0].shape[1], given[0].shape[2]
    if size != block_size:
        raise ValueError(f"kv_caches have blocks of {size} tokens; limits.block_size is {block_size}")
    if num_blocks is not None and blocks != num_blocks:
        raise ValueError(f"kv_caches have {blocks} blocks; limits.num_kv_blocks is {num_blocks}")
    return given
