"""The lifecycle's measurements: graph-memory estimate, KV-cache sizing, decode capacity.

docs/architecture.md, section "Lifecycle" (phases Profiling and Canary):

- :func:`estimate_graph_memory` captures the two largest keys of each kind into a throwaway
  runner over a small KV cache and extrapolates ``first + (n - 1) * second`` per kind, the
  estimate vLLM uses (docs/architecture.md, section "Public facts behind the defaults");
- :func:`size_kv_cache` sizes the KV cache from the free device memory, leaving
  :func:`graph_reserve_bytes` (the estimate and its margin) for the graphs; the sizing itself is
  done in one place, :func:`~graphserving.runtime.model.kv_cache.num_kv_blocks`;
- :func:`measure_capacity` times decode steps at the configured batch on the serving runner;
- :func:`check_forward_pass_memory`, before warm-up allocates anything, refuses engine limits whose
  forward pass cannot fit the device's available memory (:func:`forward_pass_bytes`, the estimate;
  :func:`forward_pass_problem`, the decision), and :func:`size_kv_cache` says when the KV cache
  cannot give each of ``max_num_seqs`` sequences a block (:func:`kv_concurrency_problem`).

Each takes what it measures (model, runner, block manager, limits), never the lifecycle.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from graphserving.contract.graph_policy import GraphMode
from graphserving.contract.worker_config import EngineLimits
from ..engine.block_manager import BlockManager
from ..graphs.canary import canary_batch_for
from ..graphs.key import GraphKeyContract, full_key
from ..graphs.runner import GraphRunner
from ..model.config import ModelConfig
from ..model.kv_cache import allocate_kv_cache, kv_cache_bytes_per_block, num_kv_blocks
from ..model.kv_layout import NULL_BLOCK
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
    problem = kv_concurrency_problem(blocks, limits.max_num_seqs)
    if problem is not None:
        log.warning("%s", problem)
    return blocks


def kv_concurrency_problem(num_blocks: int, max_num_seqs: int) -> str | None:
    """Why a KV cache of ``num_blocks`` (the null block included) cannot run ``max_num_seqs``
    sequences at once, or None when each can hold a block (pure).

    Not fatal: the scheduler (runtime/engine/scheduler.py) admits only the sequences whose blocks
    fit and preempts the youngest running one when the cache runs out, so requests wait instead of
    failing; but a decode batch of ``max_num_seqs`` never forms, and its capacity cannot be measured.
    """
    usable = num_blocks - (NULL_BLOCK + 1)
    if usable >= max_num_seqs:
        return None
    return (
        f"maxNumSeqs={max_num_seqs} exceeds the {usable} usable KV blocks (of {num_blocks}, the null block "
        f"excluded): at most {usable} sequences hold KV blocks at once; the scheduler keeps the others "
        f"waiting and preempts the youngest running sequence when the cache runs out, and the decode capacity at "
        f"maxNumSeqs cannot be measured; set maxNumSeqs <= {usable} or numKvBlocks >= {max_num_seqs + NULL_BLOCK + 1}"
    )


# -- the forward pass's memory ---------------------------------------------------------------

#: float32: the dtype of the logits (``LlamaForCausalLM.compute_logits``) and of sampling.
LOGITS_ITEMSIZE = 4


class EngineLimitsError(ValueError):
    """Engine limits whose forward pass cannot fit the device; the message names the field, its
    value, the bytes needed and available, and the largest value that fits."""


@dataclass(frozen=True)
class ForwardPassBytes:
    """Transient bytes of one eager forward pass (:func:`forward_pass_bytes`)."""

    activations: int
    logits: int

    @property
    def total(self) -> int:
        return self.activations + self.logits


def activation_bytes_per_token(config: ModelConfig, itemsize: int) -> int:
    """Bytes one token row holds at the widest point of a decoder layer, its MLP (pure):
    ``itemsize * (3 * H + Hq * D + 4 * I)``.

    Alive there: the residual stream, the layer's hidden state and its norm (``3 * H``), the
    attention output (``Hq * D``), the gate/up projection (``2 * I``), SiLU of the gate and its
    product with up (``2 * I``); ``itemsize`` is the model dtype's (4 float32, 2 bfloat16/float16).
    ``I`` is ``ModelConfig.mlp_activation_width`` (the k experts' widths in a mixture-of-experts layer).
    """
    h, i = config.hidden_size, config.mlp_activation_width
    return itemsize * (3 * h + config.num_attention_heads * config.head_dim + 4 * i)


def logits_bytes_per_row(config: ModelConfig, itemsize: int) -> int:
    """Bytes of one logits row (pure): ``V * 4``, the float32 logits (``compute_logits``). A 16-bit
    model's LM head writes them directly on CUDA; on the CPU its output in the model dtype comes
    first (``V * itemsize`` more, not counted: the estimate stays a lower bound). ``itemsize`` is
    the model dtype's, kept for the callers' symmetry with :func:`activation_bytes_per_token`."""
    del itemsize
    return config.vocab_size * LOGITS_ITEMSIZE


def forward_pass_bytes(config: ModelConfig, num_tokens: int, num_logits_rows: int, itemsize: int) -> ForwardPassBytes:
    """Transient bytes of one eager forward pass of ``num_tokens`` token rows of which
    ``num_logits_rows`` get logits (pure):

    ``activations = num_tokens * activation_bytes_per_token``,
    ``logits = num_logits_rows * logits_bytes_per_row``.

    A lower bound: attention workspace, the sampler's copies of the logits and the allocator's
    fragmentation come on top, so limits it refuses certainly cannot run. For SmolLM2 in float32
    a pass of 100 000 rows, each with logits, takes 3.4 GB of activations and 19.7 GB of logits.
    """
    return ForwardPassBytes(
        activations=num_tokens * activation_bytes_per_token(config, itemsize),
        logits=num_logits_rows * logits_bytes_per_row(config, itemsize),
    )


def forward_pass_problem(limits: EngineLimits, config: ModelConfig, itemsize: int, available_bytes: int,
                         where: str) -> str | None:
    """Why one forward pass at ``limits`` cannot fit ``available_bytes`` on ``where`` (one line), or
    None when it fits (pure).

    The pass has ``max_num_batched_tokens`` token rows and ``max_num_seqs`` logits rows (one per
    request; :func:`forward_pass_bytes`). When ``max_num_seqs`` fits with a smaller token budget, the
    line names ``maxNumBatchedTokens`` and the largest budget that fits; otherwise ``maxNumSeqs`` and
    the largest value both may take (the budget must stay ``>= maxNumSeqs``).
    """
    tokens, seqs = limits.max_num_batched_tokens, limits.max_num_seqs
    need = forward_pass_bytes(config, tokens, seqs, itemsize)
    if need.total <= available_bytes:
        return None
    per_token = activation_bytes_per_token(config, itemsize)
    per_logits_row = logits_bytes_per_row(config, itemsize)
    fits_seqs = available_bytes >= seqs * (per_token + per_logits_row)
    field, value = ("maxNumBatchedTokens", tokens) if fits_seqs else ("maxNumSeqs", seqs)
    if fits_seqs:
        advice = f"set maxNumBatchedTokens <= {(available_bytes - seqs * per_logits_row) // per_token}"
    else:
        largest = max(available_bytes, 0) // (per_token + per_logits_row)
        advice = (f"set maxNumSeqs and maxNumBatchedTokens <= {largest}" if largest
                  else "not even one row fits: free memory or serve a smaller model or dtype")
    return (
        f"{field}={value} does not fit: one forward pass of {tokens} token rows (maxNumBatchedTokens) with "
        f"{seqs} logits rows (maxNumSeqs) needs {need.total} bytes (activations {need.activations} + logits "
        f"{need.logits}), {available_bytes} available on {where}; {advice}"
    )


def host_available_bytes(proc: Path = Path("/proc"), cgroup_fs: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes of host memory this process may still take: ``MemAvailable`` of ``/proc/meminfo``
    (``os.sysconf`` free pages where it is missing), bounded by ``memory.max - memory.current`` of
    its cgroup v2 and each ancestor that sets a limit (a container's memory limit)."""
    available = None
    meminfo = proc / "meminfo"
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # kB
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    membership = proc / "self" / "cgroup"
    lines = membership.read_text().splitlines() if membership.is_file() else []
    path = next((line[3:] for line in lines if line.startswith("0::")), None)
    if path is not None:
        group = cgroup_fs / path.strip("/")
        for folder in (group, *group.parents):
            limit, current = folder / "memory.max", folder / "memory.current"
            if limit.is_file() and current.is_file() and limit.read_text().strip() != "max":
                available = min(available, int(limit.read_text()) - int(current.read_text()))
            if folder == cgroup_fs:
                break
    return available


def available_memory_bytes(device: torch.device) -> int:
    """Bytes a new allocation on ``device`` may take: on CUDA the free device memory plus what the
    caching allocator holds unused (``mem_get_info`` + reserved - allocated); else
    :func:`host_available_bytes`."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return host_available_bytes()


def check_forward_pass_memory(limits: EngineLimits, model_config: ModelConfig, dtype: torch.dtype,
                              device: torch.device) -> ForwardPassBytes:
    """Refuse engine limits whose forward pass cannot fit ``device`` (call before warm-up).

    Returns:
        the estimate (:func:`forward_pass_bytes` at ``max_num_batched_tokens`` token rows and
        ``max_num_seqs`` logits rows, in ``dtype``).

    Raises:
        EngineLimitsError: it needs more than :func:`available_memory_bytes`; the one-line message
            (:func:`forward_pass_problem`) names the field, the bytes and the largest value that fits.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    available = available_memory_bytes(device)
    problem = forward_pass_problem(limits, model_config, itemsize, available, where=str(device))
    if problem is not None:
        raise EngineLimitsError(problem)
    need = forward_pass_bytes(model_config, limits.max_num_batched_tokens, limits.max_num_seqs, itemsize)
    log.info("a forward pass at the engine limits takes at least %.1f MiB of %.1f MiB available on %s",
             need.total / 2**20, available / 2**20, device)
    return need


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
