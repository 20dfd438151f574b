"""Static buffers: the fixed addresses a captured graph reads its per-step inputs from.

One set of buffers is sized for the largest graph key and shared by every key. Before every
replay *every row of the key's extent* is rewritten: real rows from the batch, padded rows with
the sentinel their :class:`BufferSpec` declares. Nothing is left from an earlier step, so a
smaller batch after a larger one cannot read stale metadata (DESIGN.md section 4).

Padded-row sentinels:

============== ================================================================ =================
buffer         padded value                                                     why
============== ================================================================ =================
input_ids      0                                                                any valid token
positions      0                                                                valid RoPE index
slot_mapping   ``PAD_SLOT_ID`` (-1)                                             K/V go to the null block
seq_lens       0                                                                attends to nothing
query_lens     1 (FULL) / 0 (PIECEWISE, unused)                                 uniform-decode shape
query_start_loc continues the prefix sum                                        monotone offsets
block_table    ``NULL_BLOCK`` in every unused entry                             never a real block
logits_indices the padded row itself                                            rows beyond the real ones are never read
============== ================================================================ =================
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from graphserving.runtime.forward_metadata import NULL_BLOCK, PAD_SLOT_ID, ForwardMetadata


@dataclass(frozen=True)
class BufferSpec:
    """One static buffer: its name, row extent, dtype and the value of its padded rows."""

    name: str
    rows: str  # "tokens", "reqs" or "reqs+1"
    dtype: torch.dtype
    pad_value: int


BUFFER_SPECS: tuple[BufferSpec, ...] = (
    BufferSpec("input_ids", "tokens", torch.int64, 0),
    BufferSpec("positions", "tokens", torch.int64, 0),
    BufferSpec("slot_mapping", "tokens", torch.int64, PAD_SLOT_ID),
    BufferSpec("seq_lens", "reqs", torch.int32, 0),
    BufferSpec("query_lens", "reqs", torch.int32, 1),
    BufferSpec("query_start_loc", "reqs+1", torch.int32, -1),  # -1: recomputed, see fill_full
    BufferSpec("block_table", "reqs", torch.int32, NULL_BLOCK),
    BufferSpec("logits_indices", "reqs", torch.int64, -1),  # -1: recomputed, see fill_full
)


class StaticBuffers:
    """The static metadata buffers of one worker.

    Shapes: token buffers [max_tokens]; request buffers [max_reqs]; ``query_start_loc``
    [max_reqs + 1]; ``block_table`` [max_reqs, max_blocks_per_seq] (int32).

    Args:
        max_tokens: the largest token count of any key (FULL or PIECEWISE).
        max_reqs: the largest request count of any FULL key.
        max_blocks_per_seq: block-table width (max_model_len / block_size, rounded up).
        device: where the buffers live.
    """

    def __init__(self, max_tokens: int, max_reqs: int, max_blocks_per_seq: int, device: torch.device):
        self.max_tokens = max_tokens
        self.max_reqs = max_reqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        extent = {"tokens": (max_tokens,), "reqs": (max_reqs,), "reqs+1": (max_reqs + 1,)}
        self.tensors: dict[str, torch.Tensor] = {}
        for spec in BUFFER_SPECS:
            shape = extent[spec.rows]
            if spec.name == "block_table":
                shape = (max_reqs, max_blocks_per_seq)
            self.tensors[spec.name] = torch.full(shape, spec.pad_value, dtype=spec.dtype, device=device)
        # Host-side index rows used to fill padded offsets without a device sync.
        self._arange = torch.arange(max(max_tokens, max_reqs) + 1, dtype=torch.int64, device=device)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def data_ptrs(self) -> dict[str, int]:
        """Addresses of every buffer (they must never change after capture)."""
        return {name: t.data_ptr() for name, t in self.tensors.items()}

    def poison(self, generator: torch.Generator | None = None) -> None:
        """Fill every buffer with garbage (tests: prove that each replay rewrites every row)."""
        for t in self.tensors.values():
            t.copy_(torch.randint(-(2**20), 2**20, t.shape, generator=generator).to(t.dtype))

    # -- filling ---------------------------------------------------------------------------

    def _fill_tokens(self, meta: ForwardMetadata, num_tokens: int) -> None:
        n = meta.num_tokens
        if n > num_tokens:
            raise ValueError(f"batch has {n} token rows, more than the key's {num_tokens}")
        for name, pad in (("input_ids", 0), ("positions", 0), ("slot_mapping", PAD_SLOT_ID)):
            buf = self.tensors[name]
            buf[:n].copy_(getattr(meta, name), non_blocking=True)
            buf[n:num_tokens].fill_(pad)

    def fill_full(self, meta: ForwardMetadata, num_reqs: int) -> ForwardMetadata:
        """Write a uniform-decode batch into the buffers of a FULL key of ``num_reqs`` rows.

        Returns the metadata view a FULL graph was captured on: every tensor a view of a static
        buffer with the key's extent (T = R = ``num_reqs``), host fields of the key.

        Raises:
            ValueError: the batch is not uniform decode, or does not fit the key.
        """
        n = meta.num_reqs
        if meta.max_query_len != 1 or meta.num_tokens != n:
            raise ValueError("a FULL key replays only uniform-decode batches (one token per request)")
        if n > num_reqs:
            raise ValueError(f"batch has {n} requests, more than the key's {num_reqs}")
        if meta.logits_indices.shape[0] != n:
            raise ValueError("a FULL key samples every request row once")
        self._fill_tokens(meta, num_reqs)
        t = self.tensors
        t["seq_lens"][:n].copy_(meta.seq_lens, non_blocking=True)
        t["seq_lens"][n:num_reqs].fill_(0)
        t["query_lens"][:num_reqs].fill_(1)
        t["query_start_loc"][: num_reqs + 1].copy_(self._arange[: num_reqs + 1])
        width = meta.block_table.shape[1]
        if width > self.max_blocks_per_seq:
            raise ValueError(f"block table has {width} columns, more than {self.max_blocks_per_seq}")
        bt = t["block_table"]
        bt[:n, :width].copy_(meta.block_table, non_blocking=True)
        bt[:n, width:].fill_(NULL_BLOCK)
        bt[n:num_reqs].fill_(NULL_BLOCK)
        t["logits_indices"][:n].copy_(meta.logits_indices, non_blocking=True)
        t["logits_indices"][n:num_reqs].copy_(self._arange[n:num_reqs])
        return self.full_view(num_reqs)

    def full_view(self, num_reqs: int) -> ForwardMetadata:
        """The metadata of a FULL key, as views of the static buffers (what capture records)."""
        t = self.tensors
        return ForwardMetadata(
            input_ids=t["input_ids"][:num_reqs],
            positions=t["positions"][:num_reqs],
            seq_lens=t["seq_lens"][:num_reqs],
            query_lens=t["query_lens"][:num_reqs],
            query_start_loc=t["query_start_loc"][: num_reqs + 1],
            block_table=t["block_table"][:num_reqs],
            slot_mapping=t["slot_mapping"][:num_reqs],
            logits_indices=t["logits_indices"][:num_reqs],
            num_actual_tokens=num_reqs,
            num_actual_reqs=num_reqs,
            max_query_len=1,
        )

    def fill_piecewise(self, meta: ForwardMetadata, num_tokens: int) -> ForwardMetadata:
        """Write the token rows of any batch into the buffers of a PIECEWISE key.

        Returns ``meta`` with its token tensors (input_ids, positions, slot_mapping) replaced by
        static views of ``num_tokens`` rows; request tensors stay the batch's own, so eager
        attention sees the real requests and padded token rows belong to none of them.

        Raises:
            ValueError: the batch has more token rows than the key.
        """
        self._fill_tokens(meta, num_tokens)
        t = self.tensors
        return replace(
            meta,
            input_ids=t["input_ids"][:num_tokens],
            positions=t["positions"][:num_tokens],
            slot_mapping=t["slot_mapping"][:num_tokens],
        )
