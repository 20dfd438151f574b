"""Tensor parallelism: how a model's weights split over ``N`` ranks, and the collective between them.

Megatron-style layout (one process per GPU, the layer's two GEMMs split so that one all-reduce per
block suffices):

- column-parallel (output rows split, no communication): the Q, K and V projections by whole heads
  (rank ``r`` holds heads ``r * H / N .. (r + 1) * H / N - 1``, and as many KV heads), gate and up by
  intermediate rows, each expert's gate and up likewise;
- row-parallel (input columns split, partial sums all-reduced): the output projection, down, each
  expert's down; a row-parallel bias is added once (rank 0's copy; the others hold zeros);
- vocabulary-parallel: the LM head by vocabulary rows (rank ``r`` holds rows ``r * V / N .. (r + 1)
  * V / N - 1``, a view of the embedding where they are tied); each rank computes its slice of the
  logits and an all-gather gives every rank all of them (``TensorParallel.all_gather_vocab``);
- replicated: embeddings, norms, q/k norms, the router.

A rank's model is the ordinary model of a *sharded configuration* (:func:`shard_config`: its heads,
KV heads and intermediate sizes divided by ``N``): its KV cache, attention and graph capture need no
other change; the model all-reduces after each row-parallel projection
(``LlamaForCausalLM.parallel``). The layout is part of every graph key (``GraphKeyContract
.parallel_layout``, :meth:`ParallelLayout.label`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from .config import ConfigError, ModelConfig

_COLUMN = re.compile(r"\.(self_attn\.[qkv]_proj\.(weight|bias)|mlp\.(gate|up)_proj\.weight"
                     r"|mlp\.experts\.\d+\.(gate|up)_proj\.weight)$")
"""Column-parallel weights in Hugging Face names: split along their output rows (dim 0)."""
_COLUMN_STACKED = re.compile(r"\.mlp\.experts\.(gate_proj|up_proj)$")
"""Stacked expert gate / up [E, I, H]: split along I (dim 1)."""
_ROW = re.compile(r"\.(self_attn\.o_proj\.weight|mlp\.down_proj\.weight|mlp\.experts\.\d+\.down_proj\.weight"
                  r"|mlp\.experts\.down_proj)$")
"""Row-parallel weights: split along their input columns (the last dim)."""
_ROW_BIAS = re.compile(r"\.self_attn\.o_proj\.bias$")
"""Row-parallel biases: added once after the all-reduce (rank 0 keeps it, the others get zeros)."""
_FUSED_GATE_UP = re.compile(r"\.mlp\.experts\.gate_up_proj$")
"""Stacked fused expert gate+up [E, 2I, H]: each half split along I."""
_VOCAB = re.compile(r"^lm_head\.weight$")
"""Vocabulary-parallel weights: split along their vocabulary rows (dim 0)."""


@dataclass(frozen=True)
class ParallelLayout:
    """Where one process sits in a tensor-parallel group.

    Attributes:
        tensor_parallel_size: ``N``, ranks sharing the model (1: no parallelism).
        rank: this process's rank, ``0 .. N - 1``.

    Raises:
        ValueError: ``N < 1`` or ``rank`` outside ``0 .. N - 1``.
    """

    tensor_parallel_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or not 0 <= self.rank < self.tensor_parallel_size:
            raise ValueError(f"need tensor_parallel_size >= 1 and 0 <= rank < it; got "
                             f"tensor_parallel_size={self.tensor_parallel_size}, rank={self.rank}")

    def label(self) -> str:
        """The graph key's parallel layout, ``tp<N>-pp1`` (runtime/graphs/key.py)."""
        return f"tp{self.tensor_parallel_size}-pp1"


def check_shardable(config: ModelConfig, tensor_parallel_size: int) -> None:
    """Raise unless ``config`` splits evenly over ``tensor_parallel_size`` ranks (pure).

    Raises:
        ConfigError: naming the first field not divisible by the size (``num_attention_heads``,
            ``num_key_value_heads``, ``intermediate_size``, ``vocab_size``, ``moe_intermediate_size``).
    """
    fields = ["num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"]
    if config.moe_layers:
        fields.append("moe_intermediate_size")
    for name in fields:
        value = getattr(config, name)
        if value % tensor_parallel_size:
            raise ConfigError(f"{name} ({value}) is not divisible by the tensor-parallel size "
                              f"({tensor_parallel_size})")


def shard_config(config: ModelConfig, layout: ParallelLayout) -> ModelConfig:
    """The configuration of one rank's share of the model (pure): heads, KV heads and intermediate
    sizes divided by ``N``; ``head_dim``, ``hidden_size`` and ``vocab_size`` unchanged (the
    logits are whole after the LM head's all-gather; the rank's rows are
    :func:`vocab_rows`).

    Raises:
        ConfigError: as :func:`check_shardable`.
    """
    n = layout.tensor_parallel_size
    if n == 1:
        return config
    check_shardable(config, n)
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // n,
        num_key_value_heads=config.num_key_value_heads // n,
        intermediate_size=config.intermediate_size // n,
        moe_intermediate_size=config.moe_intermediate_size // n if config.moe_layers else config.moe_intermediate_size,
    )


def vocab_rows(vocab_size: int, layout: ParallelLayout) -> tuple[int, int]:
    """(first row, rows) of the LM head that ``layout.rank`` holds (pure)."""
    rows = vocab_size // layout.tensor_parallel_size
    return layout.rank * rows, rows


def shard_weight(name: str, tensor: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """Rank ``layout.rank``'s share of one weight (Hugging Face name), as module docstring says
    (pure; a view where a slice suffices). Column-parallel projections split along their rows by
    whole heads because the checkpoint stores heads contiguously (``[H * D, hidden]``)."""
    n, r = layout.tensor_parallel_size, layout.rank
    if n == 1:
        return tensor
    if _COLUMN.search(name) or _VOCAB.search(name):
        return tensor.chunk(n, dim=0)[r]
    if _COLUMN_STACKED.search(name):
        return tensor.chunk(n, dim=1)[r]
    if _FUSED_GATE_UP.search(name):
        gate, up = tensor.chunk(2, dim=1)
        return torch.cat([gate.chunk(n, dim=1)[r], up.chunk(n, dim=1)[r]], dim=1)
    if _ROW.search(name):
        return tensor.chunk(n, dim=-1)[r]
    if _ROW_BIAS.search(name):
        return tensor if r == 0 else torch.zeros_like(tensor)
    return tensor


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], layout: ParallelLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`shard_weight` over a stream of ``(name, tensor)``."""
    for name, tensor in weights:
        yield name, shard_weight(name, tensor, layout)


class TensorParallel:
    """The collective a rank's model runs: a sum over the group after each row-parallel projection.

    Args:
        layout: this rank's place.
        group: the ``torch.distributed`` process group of the ``N`` ranks (NCCL on CUDA, gloo on the
            CPU), initialised by the caller; None: the default group.
    """

    def __init__(self, layout: ParallelLayout, group=None) -> None:
        self.layout = layout
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place (graph-capturable with NCCL: fixed shape and address);
        returns ``x``."""
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's vocabulary slice of the logits, side by side: [S, V / N] -> [S, V] (rank
        order; graph-capturable with NCCL). A new tensor."""
        n, (rows, cols) = self.layout.tensor_parallel_size, x.shape
        parts = torch.empty((n * rows, cols), dtype=x.dtype, device=x.device)  # rank-major, as gloo wants it
        torch.distributed.all_gather_into_tensor(parts, x.contiguous(), group=self.group)
        return parts.view(n, rows, cols).permute(1, 0, 2).reshape(rows, n * cols)
