"""The lifecycle's measurements: graph-memory estimate, KV-cache sizing, decode capacity.

docs/architecture.md, section "Lifecycle" (phases Profiling and Canary):

- :func:`estimate_graph_memory` captures the two largest keys of each kind into a throwaway
  runner over a small KV cache and extrapolates ``first + (n - 1) * second`` per kind, the
  estimate vLLM uses (docs/architecture.md, section "Public facts behind the defaults");
- :func:`size_kv_cache` sizes the KV cache from the free device memory, leaving
  :func:`graph_reserve_bytes` (the estimate and its margin) for the graphs; the sizing itself is
  done in one place, :func:`~graphserving.runtime.model.kv_cache.num_kv_blocks`;
- :func:`measure_capacity` times decode steps at the configured batch on the serving runner.

Each takes what it measures (model, runner, block manager, limits), never the lifecycle.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from graphserving.contract.graph_policy import GraphMode
from graphserving.contract.worker_config import EngineLimits
from ..engine.block_manager import BlockManager
from ..graphs.canary import canary_batch_for
from ..graphs.key import GraphKeyContract, full_key
from ..graphs.runner import GraphRunner
from ..model.config import ModelConfig
from ..model.kv_cache import allocate_kv_cache, kv_cache_bytes_per_block, num_kv_blocks
from .outcome import ResolvedGraphs

log = logging.getLogger(__name__)

#: Blocks of the throwaway KV cache the graph-memory probe captures over.
PROBE_KV_BLOCKS = 8
#: Sequence id under which measurements borrow KV blocks (never a request's id).
BORROWER_SEQ_ID = "__canary__"


def device_bytes_in_use(device: torch.device) -> int:
    """Bytes in use on a CUDA ``device`` (total - free, after a synchronize); 0 elsewhere."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def empty_cache(device: torch.device) -> None:
    """Return the caching allocator's free blocks to the CUDA ``device`` (no-op elsewhere)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


@torch.inference_mode()
def estimate_graph_memory(
    model: torch.nn.Module,
    model_config: ModelConfig,
    graphs: ResolvedGraphs,
    contract: GraphKeyContract,
    *,
    block_size: int,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Bytes the graphs of the configured keys will take (0 without CUDA or in mode NONE).

    Captures the two largest keys of each kind into a throwaway runner over a KV cache of
    :data:`PROBE_KV_BLOCKS` blocks and extrapolates ``first + (n - 1) * second`` per kind; the
    throwaway runner's static buffers are counted in ``first``. A kind whose probe captures all
    fail adds nothing (the real capture reports the failure).

    Args:
        model / model_config: the loaded model and its configuration.
        graphs: the resolved capture sizes (FULL in requests, PIECEWISE in tokens).
        contract: the worker's graph-key contract.
        block_size: tokens per KV block; max_model_len: the model length in tokens (sets the
            block-table width of the static buffers).
        dtype / device: the KV cache's element type and device.
    """
    if device.type != "cuda" or graphs.config.mode is GraphMode.NONE:
        return 0
    width = math.ceil(max_model_len / block_size)
    kv = allocate_kv_cache(model_config, PROBE_KV_BLOCKS, block_size, dtype, device)
    total = 0
    for mode, sizes in ((GraphMode.FULL, graphs.full_sizes), (GraphMode.PIECEWISE, graphs.piecewise_sizes)):
        if not sizes:
            continue
        probe_sizes = sorted(sizes)[-2:]
        empty_cache(device)
        before = device_bytes_in_use(device)
        runner = GraphRunner(
            model, kv, mode=mode,
            full_sizes=probe_sizes if mode is GraphMode.FULL else [],
            piecewise_sizes=probe_sizes if mode is GraphMode.PIECEWISE else [],
            contract=contract, max_blocks_per_seq=width,
        )
        static = device_bytes_in_use(device) - before
        per_key = [c.memory_bytes for c in runner.capture_all() if c.ok]
        if per_key:
            first = static + per_key[0]
            second = per_key[1] if len(per_key) > 1 else per_key[0]
            total += first + (len(sizes) - 1) * second
        runner.invalidate("profiling done")
        del runner
    del kv
    empty_cache(device)
    return total


def graph_reserve_bytes(estimate_bytes: int, margin_fraction: float) -> int:
    """Device memory kept free for the graphs: ``estimate * (1 + margin)`` bytes (floor)."""
    return int(estimate_bytes * (1 + margin_fraction))


def size_kv_cache(
    limits: EngineLimits,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    *,
    graph_memory_estimate: int,
    graph_memory_margin_fraction: float,
) -> int:
    """KV blocks for the engine, the null block included, sized after the graph reserve.

    ``limits.num_kv_blocks`` when given; otherwise the CPU default, or on CUDA the blocks that
    fit in ``kv_cache_memory_fraction`` of the free memory less :func:`graph_reserve_bytes`
    (computed by :func:`~graphserving.runtime.model.kv_cache.num_kv_blocks`).

    Raises:
        RuntimeError: no room for 2 blocks once the graph reserve is set aside (the message gives
            the free and the reserved bytes).
    """
    per_block = kv_cache_bytes_per_block(model_config, limits.block_size, dtype)
    reserve = graph_reserve_bytes(graph_memory_estimate, graph_memory_margin_fraction)
    blocks = num_kv_blocks(limits.num_kv_blocks, device, per_block, limits.kv_cache_memory_fraction,
                           reserve_bytes=reserve)
    if limits.num_kv_blocks is None and device.type == "cuda":
        log.info("KV cache sized after reserving %.1f MiB for graphs (estimate %.1f MiB + margin)",
                 reserve / 2**20, graph_memory_estimate / 2**20)
    return blocks


@contextmanager
def borrowed_blocks(block_manager: BlockManager, wanted: int) -> Iterator[list[int]]:
    """Up to ``wanted`` free KV blocks, lent for a measurement and given back on exit.

    Fewer (or none) when requests hold the cache; the caller decides what a short loan means.
    """
    tokens = min(wanted, block_manager.num_free_blocks) * block_manager.block_size
    blocks = block_manager.allocate(BORROWER_SEQ_ID, tokens) if tokens else []
    try:
        yield list(blocks)
    finally:
        if blocks:
            block_manager.free(BORROWER_SEQ_ID)


@torch.inference_mode()
def measure_capacity(
    runner: GraphRunner,
    block_manager: BlockManager,
    contract: GraphKeyContract,
    *,
    batch: int,
    vocab_size: int,
    max_model_len: int,
    device: torch.device,
    previous: float,
    repeats: int = 3,
) -> float:
    """Decode tokens/s at ``batch`` requests (``max_num_seqs``), as this worker will run it.

    Runs one uniform-decode batch (random tokens over borrowed KV blocks, built on ``device``)
    through ``runner.execute`` (a replay where its key is captured, eager otherwise): one warm
    pass, then the mean of ``repeats`` timed passes.

    Returns:
        ``batch / seconds per step``; ``previous`` when fewer than ``batch`` KV blocks are free
        (requests hold the cache, as during a recapture).
    """
    generator = torch.Generator().manual_seed(1)
    with borrowed_blocks(block_manager, 2 * batch) as blocks:
        if len(blocks) < batch:  # requests hold the KV cache (a recapture): keep the last value
            return previous
        key = full_key(batch, contract)
        meta = canary_batch_for(key, blocks, block_manager.block_size, vocab_size, max_model_len,
                                device, generator)
        runner.execute(meta)  # warm
        runner.backend.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            runner.execute(meta)
        runner.backend.synchronize()
        seconds = (time.perf_counter() - start) / repeats
    return batch / seconds if seconds > 0 else 0.0
