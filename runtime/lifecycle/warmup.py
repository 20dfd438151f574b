"""The Warmup phase: the engine limits checked against the device, then eager passes on
representative shapes (docs/architecture.md, "Lifecycle").

Lazy initialisation (kernel compilation, cuBLAS handles, allocator growth) happens here, outside
any capture. The passes run over a scratch KV cache that is freed afterwards.
"""

from __future__ import annotations

import math

import torch

from graphserving.contract.graph_policy import GraphMode
from ..graphs.canary import canary_batch_for, make_batch
from ..graphs.key import GraphKeyContract, full_key, piecewise_key
from ..graphs.runner import GraphRunner
from ..model.kv_cache import allocate_kv_cache
from .outcome import ResolvedGraphs
from .profiling import check_forward_pass_memory, empty_cache


@torch.inference_mode()
def warm_up(loaded, config, graphs: ResolvedGraphs, contract: GraphKeyContract, max_model_len: int) -> None:
    """Check that one forward pass at the engine limits fits the device, then run two eager
    passes each of the largest decode batch, a prefill chunk, and a prefill with as many decode rows
    as the decode batch.

    Args:
        loaded: the loaded model (``model``, ``config``, ``device``, ``dtype``).
        config: the worker configuration (its engine limits).
        graphs: the resolved capture sizes (the largest FULL size is the decode batch warmed up).
        contract: the worker's graph-key contract.
        max_model_len: the engine's longest sequence, in tokens.

    Raises:
        EngineLimitsError: the engine limits' forward pass cannot fit the device's memory
            (one line naming the field; runtime/lifecycle/profiling.py).
    """
    limits, device = config.engine, loaded.device
    check_forward_pass_memory(limits, loaded.config, loaded.dtype, device)
    block_size = limits.block_size
    decode = max(graphs.full_sizes or [min(limits.max_num_seqs, 8)])
    chunk = limits.max_num_batched_tokens if device.type == "cuda" else min(limits.max_num_batched_tokens, 256)
    # one chunk with a block of cached context where the model is longer than a block
    chunk = min(chunk, max_model_len - block_size if max_model_len > block_size else max_model_len)
    blocks = decode * 2 + math.ceil(chunk / block_size) + 8
    kv = allocate_kv_cache(loaded.config, blocks + 1, block_size, loaded.dtype, device)
    runner = GraphRunner(loaded.model, kv, mode=GraphMode.NONE, full_sizes=[], piecewise_sizes=[],
                         contract=contract, max_blocks_per_seq=1)
    generator = torch.Generator().manual_seed(0)
    ids = list(range(1, blocks + 1))
    batches = [canary_batch_for(key, ids, block_size, loaded.config.vocab_size, max_model_len, device, generator)
               for key in (full_key(decode, contract), piecewise_key(chunk, contract))]
    # A mixed batch with the decode batch's rows: its decode rows attend without RoPE folded in
    # (kernels.use_fused_rope_decode may fold it into the uniform decode above), a kernel variant
    # of its own, compiled here rather than on the first such batch served.
    prompt = min(block_size, max_model_len)
    batches.append(make_batch([prompt] + [1] * decode, [0] * (decode + 1), ids, block_size, loaded.config.vocab_size,
                              device, generator))
    for meta in batches:
        for _ in range(2):
            runner.run_eager(meta)
    del runner, kv
    empty_cache(device)
