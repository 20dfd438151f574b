"""A tensor-parallel follower's lifecycle: the same start-up passes as rank 0, then rank 0's commands.

Rank 0 runs the whole lifecycle (runtime/lifecycle/phases.py) and the engine; a follower rank
(``graphserving-worker`` started by rank 0 with ``--tensor-parallel-rank``, runtime/lifecycle/ranks.py)
has no engine, no HTTP front and no report. Every pass of its model all-reduces with rank 0's, so
it runs the passes rank 0 runs, in the same order:

1. Warmup: the same eager passes (:func:`~.warmup.warm_up`, deterministic shapes and inputs);
2. Profiling: the same graph-memory probe captures (:func:`~.profiling.estimate_graph_memory`), then
   the KV cache of the block count and block-table width rank 0 sized (its ``build`` command) and a
   graph runner over it configured as rank 0's (:func:`build_graph_runner`);
3. then capture, canary (its random context K/V included), capacity and serving passes as rank 0's
   :class:`~..graphs.parallel.LeaderRunner` sends them (:func:`~..graphs.parallel.follow`), until
   rank 0 sends ``stop``.

Warmup's memory check runs on each rank for its own device: a follower that fails it exits (rank 0
then exits too); rank 0 failing it alone kills the followers (``ranks.abandon``) and reports Failed.
"""

from __future__ import annotations

import logging
import math

from graphserving.contract.graph_policy import GraphMode
from graphserving.contract.worker_config import EngineLimits, WorkerConfig
from ..graphs.key import GraphKeyContract
from ..graphs.parallel import CommandChannel, follow
from ..graphs.runner import GraphRunner
from ..model.kv_cache import allocate_kv_cache
from .outcome import resolve_graphs
from .profiling import estimate_graph_memory
from .warmup import warm_up

log = logging.getLogger(__name__)


def graph_contract(loaded) -> GraphKeyContract:
    """The worker's graph-key contract: what every key of this model, dtype and layout shares."""
    return GraphKeyContract(model_revision=loaded.revision or "unverified",
                            dtype=str(loaded.dtype).removeprefix("torch."), moe_layout=loaded.config.moe_layout,
                            parallel_layout=loaded.model.parallel_layout)


def max_model_len(config: WorkerConfig, loaded) -> int:
    """The engine's longest sequence (tokens): the configured one, capped at the model's."""
    return min(config.engine.max_model_len or loaded.config.max_model_len, loaded.config.max_model_len)


def block_table_width(limits: EngineLimits, model_config, num_blocks: int) -> int:
    """Block-table columns the engine's max_model_len needs: its model length in blocks, capped at
    what the KV cache holds (every block but the null block)."""
    model_len = limits.max_model_len or model_config.max_model_len
    return min(math.ceil(model_len / limits.block_size), num_blocks - 1)


def build_graph_runner(loaded, limits: EngineLimits, contract: GraphKeyContract, num_blocks: int,
                       width: int) -> GraphRunner:
    """The KV cache (``num_blocks`` of ``limits.block_size`` tokens) and a graph runner over it with
    no graphs yet (mode NONE: the capture phase configures it)."""
    kv = allocate_kv_cache(loaded.config, num_blocks, limits.block_size, loaded.dtype, loaded.device)
    return GraphRunner(loaded.model, kv, mode=GraphMode.NONE, full_sizes=[], piecewise_sizes=[], contract=contract,
                       max_blocks_per_seq=width, num_speculative_tokens=limits.num_speculative_tokens)


def run_follower(config: WorkerConfig, loaded, channel: CommandChannel) -> int:
    """A follower's whole life (module docstring); returns the commands it ran.

    Raises:
        ValueError: rank 0's first command after profiling is not ``build``.
        RankDivergenceError: as :func:`~..graphs.parallel.follow`.
    """
    limits = config.engine
    graphs = resolve_graphs(config.graphs, limits.max_num_seqs, limits.max_num_batched_tokens)
    contract, model_len = graph_contract(loaded), max_model_len(config, loaded)
    warm_up(loaded, config, graphs, contract, model_len)
    estimate_graph_memory(loaded.model, loaded.config, graphs, contract, block_size=limits.block_size,
                          max_model_len=model_len, dtype=loaded.dtype, device=loaded.device)
    name, *args = channel.receive()
    if name == "stop":  # rank 0 stopped before it sized its KV cache (its lifecycle failed)
        return 0
    if name != "build":
        raise ValueError(f"rank 0 sent {name!r} where the KV cache's size was due ('build')")
    num_blocks, width = args
    log.info("KV cache: %d blocks of %d tokens (rank 0's sizing)", num_blocks, limits.block_size)
    return follow(build_graph_runner(loaded, limits, contract, num_blocks, width), channel)
