"""Static buffers: the fixed addresses a captured graph reads its per-step inputs from.

One set of buffers is sized for the largest graph key and shared by every key. Before every
replay *every row of the key's extent* is rewritten: real rows from the batch, padded rows with
the sentinel their :class:`BufferSpec` declares. Nothing is left from an earlier step, so a
smaller batch after a larger one cannot read stale metadata (docs/architecture.md, "Graphs").

Padded-row sentinels:

============== ================================================================ =================
buffer         padded value                                                     why
============== ================================================================ =================
input_ids      0                                                                any valid token
positions      0                                                                valid RoPE index
slot_mapping   ``PAD_SLOT_ID`` (-1)                                             K/V go to the null block
seq_lens       0                                                                attends to nothing
query_lens     q (FULL: 1, or ``k + 1``) / 0 (PIECEWISE, unused)                uniform shape
query_start_loc continues the prefix sum (``r * q``)                            monotone offsets
block_table    ``NULL_BLOCK`` in every unused entry                             never a real block
logits_indices the padded row itself                                            rows beyond the real ones are never read
============== ================================================================ =================

A FULL key of query length ``q > 1`` (speculative verification, runtime/graphs/key.py) has
``T = R * q`` token rows: each padded request owns ``q`` padded token rows, and every token row
has logits (``logits_indices`` over all ``T`` rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..model.forward_metadata import ForwardMetadata

from ..model.kv_layout import NULL_BLOCK, PAD_SLOT_ID


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
    BufferSpec("logits_indices", "tokens", torch.int64, -1),  # -1: recomputed, see fill_full
)


class StaticBuffers:
    """The static metadata buffers of one worker.

    Shapes: token buffers (and ``logits_indices``) [max_tokens]; request buffers [max_reqs];
    ``query_start_loc`` [max_reqs + 1]; ``block_table`` [max_reqs, max_blocks_per_seq] (int32).

    Storage: the buffers are typed views of one device byte pack (int64: token ids, positions,
    slot mapping, logits indices; then int32: sequence and query lengths, query starts, block
    table). A batch whose metadata is still on the host (as the model runner builds it) is padded
    in a pinned host staging copy of the same layout, written through numpy (no torch dispatch
    per field), and moved with one host-to-device copy, instead of one small copy or fill per
    field and padded range: each CUDA call costs host time before the replay can start. The
    staging copy's padded rows are written only when the extent of the fill changes (a step of the
    same key and batch size as the last finds them in place), and every upload carries them to the
    device: the device buffers are still rewritten whole before each replay.

    Args:
        max_tokens: the largest token count of any key (FULL, ``R * q`` rows, or PIECEWISE).
        max_reqs: the largest request count of any FULL key.
        max_blocks_per_seq: block-table width (max_model_len / block_size, rounded up).
        device: where the buffers live.
    """

    def __init__(self, max_tokens: int, max_reqs: int, max_blocks_per_seq: int, device: torch.device):
        self.max_tokens = max_tokens
        self.max_reqs = max_reqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        shapes = {"tokens": (max_tokens,), "reqs": (max_reqs,), "reqs+1": (max_reqs + 1,)}
        # int64 buffers first, then int32 ones, in one byte pack: every offset stays aligned
        self._layout: dict[str, tuple[torch.dtype, int, tuple[int, ...]]] = {}
        nbytes = 0
        for dtype in (torch.int64, torch.int32):
            for spec in (s for s in BUFFER_SPECS if s.dtype == dtype):
                shape = (max_reqs, max_blocks_per_seq) if spec.name == "block_table" else shapes[spec.rows]
                self._layout[spec.name] = (dtype, nbytes, shape)
                nbytes += math.prod(shape) * dtype.itemsize
        self._pack = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.tensors = self._views(self._pack)
        self.reset()
        pinned = device.type == "cuda"
        self._staging = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self._staged = {name: t.numpy() for name, t in self._views(self._staging).items()}
        # one event, re-recorded by every upload (creating one per step costs host time); waiting
        # on it before its first record returns at once
        self._copied = torch.cuda.Event() if pinned else None
        self._device_index = -1  # the CUDA device whose current stream an upload's event is recorded on
        if pinned:
            self._device_index = torch.cuda.current_device() if device.index is None else device.index
        self._stream: tuple[int, torch.cuda.Stream | None] = (0, None)  # the last current stream: (raw handle, stream)
        self._upload_slices: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._full_views: dict[tuple[int, int], ForwardMetadata] = {}
        self._staged_extent: tuple[int, ...] | None = None  # what the staging's padded rows are for
        self._arange = torch.arange(max(max_tokens, max_reqs) + 1, dtype=torch.int64, device=device)
        self._host_arange = np.arange(max(max_tokens, max_reqs) + 1, dtype=np.int64)

    def _views(self, pack: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: pack[offset: offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                for name, (dtype, offset, shape) in self._layout.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def data_ptrs(self) -> dict[str, int]:
        """Addresses of every buffer (they must never change after capture)."""
        return {name: t.data_ptr() for name, t in self.tensors.items()}

    def reset(self) -> None:
        """Fill every buffer with its declared pad value (:data:`BUFFER_SPECS`): no row then names
        a real token, slot or block. Before any capture run the buffers must hold nothing of the
        last replayed batch, whose slot mapping points into KV blocks that may by now belong to
        other requests."""
        for spec in BUFFER_SPECS:
            self.tensors[spec.name].fill_(spec.pad_value)

    def poison(self, generator: torch.Generator | None = None) -> None:
        """Fill every buffer with garbage (tests: prove that each replay rewrites every row)."""
        for t in (*self.tensors.values(), *self._views(self._staging).values()):
            t.copy_(torch.randint(-(2**20), 2**20, t.shape, generator=generator).to(t.dtype))
        self._staged_extent = None

    # -- filling ---------------------------------------------------------------------------

    def _targets(self, meta: ForwardMetadata) -> tuple[dict, bool]:
        """Where to write: the host staging (numpy views of pinned memory; then one copy) for host
        metadata bound for a GPU, else the device buffers themselves."""
        staged = meta.input_ids.device.type == "cpu" and self.device.type != "cpu"
        if staged and self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the staging buffer
        return (self._staged if staged else self.tensors), staged

    def _upload(self, num_reqs: int) -> None:
        """Copy the staging pack to the device, up to the end of block-table row ``num_reqs``.

        The block table is the pack's last buffer (:meth:`__init__`), so this prefix holds every
        other buffer whole and the block-table rows of a key of ``num_reqs`` requests: a batch-1
        step moves a few KiB instead of ``max_reqs x max_blocks_per_seq`` int32 entries. Rows past
        ``num_reqs`` keep what they held; no key of ``num_reqs`` requests reads them.
        """
        pair = self._upload_slices.get(num_reqs)
        if pair is None:
            _, offset, (_, width) = self._layout["block_table"]
            end = offset + num_reqs * width * torch.int32.itemsize
            pair = self._upload_slices[num_reqs] = (self._pack[:end], self._staging[:end])
        pair[0].copy_(pair[1], non_blocking=True)
        self._copied.record(self._current_stream())

    def _current_stream(self) -> torch.cuda.Stream:
        """``torch.cuda.current_stream()`` of the buffers' device, cached by its raw handle: the handle
        costs about 0.2 us of host time (the lookup Triton's launcher makes), the public call and an
        ``Event.record()`` without a stream about 8-9 us (``bench/host_copy_bench.py``)."""
        handle = torch._C._cuda_getCurrentRawStream(self._device_index)
        cached, stream = self._stream
        if handle != cached or stream is None:
            stream = torch.cuda.current_stream(self._device_index)
            self._stream = (handle, stream)
        return stream

    @staticmethod
    def _source(staged: bool):
        """How a batch tensor is read: as a numpy view (host staging) or as itself (device)."""
        return (lambda t: t.numpy()) if staged else (lambda t: t)

    @classmethod
    def _fill_tokens(cls, t: dict, meta: ForwardMetadata, num_tokens: int, staged: bool, pads: bool = True) -> None:
        n = meta.num_tokens
        if n > num_tokens:
            raise ValueError(f"batch has {n} token rows, more than the key's {num_tokens}")
        src = cls._source(staged)
        for name, pad in (("input_ids", 0), ("positions", 0), ("slot_mapping", PAD_SLOT_ID)):
            t[name][:n] = src(getattr(meta, name))
            if pads:
                t[name][n:num_tokens] = pad

    def fill_full(self, meta: ForwardMetadata, num_reqs: int, query_len: int = 1) -> ForwardMetadata:
        """Write a uniform batch into the buffers of a FULL key of ``num_reqs`` request rows of
        ``query_len`` token rows each (1: decode; ``k + 1``: a verification batch).

        ``meta`` may live on the host (padded in the staging copy, then two copies) or on the
        buffers' device (written in place). Real token rows (and their logits indices) are copied;
        padded requests get ``seq_lens`` 0, ``query_len`` padded token rows each (slot
        ``PAD_SLOT_ID``, position 0) and a ``NULL_BLOCK`` block-table row; ``query_start_loc`` is
        ``arange(num_reqs + 1) * query_len``. Returns :meth:`full_view` of the key.

        Raises:
            ValueError: the batch is not uniform of ``query_len`` rows per request with every row
                producing logits once, or does not fit the key.
        """
        n, rows = meta.num_reqs, meta.num_reqs * query_len
        if query_len < 1 or meta.max_query_len != query_len or meta.num_tokens != rows:
            raise ValueError(f"a FULL key of query length {query_len} replays only batches of exactly {query_len} "
                             f"token rows per request; got {meta.num_tokens} rows for {n} requests "
                             f"(max_query_len {meta.max_query_len})")
        if n > num_reqs or num_reqs * query_len > self.max_tokens:
            raise ValueError(f"batch has {n} requests, more than the key's {num_reqs}, or the key's "
                             f"{num_reqs * query_len} token rows exceed the buffers' {self.max_tokens}")
        if meta.logits_indices.shape[0] != rows:
            raise ValueError(f"a FULL key samples every token row once: {rows} rows, "
                             f"{meta.logits_indices.shape[0]} logits indices")
        width = meta.block_table.shape[1]
        if width > self.max_blocks_per_seq:
            raise ValueError(f"block table has {width} columns, more than {self.max_blocks_per_seq}")
        t, staged = self._targets(meta)
        arange = self._host_arange if staged else self._arange
        src = self._source(staged)
        total = num_reqs * query_len
        # The padded rows: always on the device buffers; in the host staging only when its last
        # completed fill had another extent (what it holds for this one is in place, and every
        # upload carries it). Forgotten until this fill completes: one that raises halfway leaves
        # the next one writing every padded row.
        extent = (num_reqs, query_len, n, width)
        pads = not staged or extent != self._staged_extent
        if staged:
            self._staged_extent = None
        self._fill_tokens(t, meta, total, staged, pads)
        t["seq_lens"][:n] = src(meta.seq_lens)
        bt = t["block_table"]
        bt[:n, :width] = src(meta.block_table)
        t["logits_indices"][:rows] = src(meta.logits_indices)
        if pads:
            t["seq_lens"][n:num_reqs] = 0
            t["query_lens"][:num_reqs] = query_len
            t["query_start_loc"][: num_reqs + 1] = arange[: total + 1 : query_len]
            bt[:n, width:] = NULL_BLOCK
            bt[n:num_reqs] = NULL_BLOCK
            t["logits_indices"][rows:total] = arange[rows:total]
        if staged:
            self._staged_extent = extent
            self._upload(num_reqs)
        return self.full_view(num_reqs, query_len)

    def full_view(self, num_reqs: int, query_len: int = 1) -> ForwardMetadata:
        """The metadata of a FULL key (``num_reqs`` requests of ``query_len`` rows), as views of the
        static buffers (what capture records); ``uniform_query_len`` is ``query_len``.

        Built once per key and returned again on every later call (each replay asks for it): the
        same object, whose tensors are the static buffers themselves. Write its tensors in place
        (multi-step decoding does); never rebind its fields."""
        cached = self._full_views.get((num_reqs, query_len))
        if cached is None:
            cached = self._full_views[(num_reqs, query_len)] = self._build_full_view(num_reqs, query_len)
        return cached

    def _build_full_view(self, num_reqs: int, query_len: int) -> ForwardMetadata:
        t = self.tensors
        total = num_reqs * query_len
        return ForwardMetadata(
            input_ids=t["input_ids"][:total],
            positions=t["positions"][:total],
            seq_lens=t["seq_lens"][:num_reqs],
            query_lens=t["query_lens"][:num_reqs],
            query_start_loc=t["query_start_loc"][: num_reqs + 1],
            block_table=t["block_table"][:num_reqs],
            slot_mapping=t["slot_mapping"][:total],
            logits_indices=t["logits_indices"][:total],
            num_actual_tokens=total,
            num_actual_reqs=num_reqs,
            max_query_len=query_len,
            uniform_query_len=query_len,
        )

    def fill_piecewise(self, meta: ForwardMetadata, num_tokens: int) -> ForwardMetadata:
        """Write the token rows of any batch into the buffers of a PIECEWISE key.

        Returns ``meta`` (moved to the buffers' device) with its token tensors (input_ids,
        positions, slot_mapping) replaced by static views of ``num_tokens`` rows; request tensors
        stay the batch's own, so eager attention sees the real requests and padded token rows
        belong to none of them.

        Raises:
            ValueError: the batch has more token rows than the key.
        """
        t, staged = self._targets(meta)
        if staged:
            self._staged_extent = None  # its padded token rows are another extent's
        self._fill_tokens(t, meta, num_tokens, staged)
        if staged:
            self._upload(0)  # token rows only: a PIECEWISE key reads the batch's own request tensors
        s = self.tensors
        return replace(
            meta.to(self.device),
            input_ids=s["input_ids"][:num_tokens],
            positions=s["positions"][:num_tokens],
            slot_mapping=s["slot_mapping"][:num_tokens],
        )
