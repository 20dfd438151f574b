"""The per-step inputs of one forward pass, as tensors: the object the graph runner makes static.

Every forward pass of the model takes exactly one :class:`ForwardMetadata`. In eager mode it is
built fresh each step; under CUDA graphs its tensors are views of static buffers sized for the
largest graph key, rewritten in full before every replay (see runtime/graphs/runner.py).

Row conventions (T = number of token rows, R = number of request rows, both possibly padded):
- tokens are laid out request after request: request ``r`` owns token rows
  ``query_start_loc[r] : query_start_loc[r + 1]``;
- a padded request row has ``seq_lens == 0`` and ``query_lens == 0`` (an empty query range at the
  end) or, in a padded uniform batch, ``query_lens == q`` (1 for decode, ``k + 1`` for
  verification) with ``seq_lens == 0`` and ``q`` padded token rows of its own;
- a padded token row has ``slot_mapping == PAD_SLOT_ID`` and position 0, so it writes to no real
  sequence's KV cache (writes of negative slots land in the reserved null block);
- unused block-table entries hold ``NULL_BLOCK``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device`` without synchronising the host: on CUDA
    through pinned memory and a non-blocking copy (the caching host allocator keeps the pinned
    block alive until the copy has run)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass
class ForwardMetadata:
    """Tensors describing one batch for the attention layers.

    Attributes:
        input_ids: int64 [T], token ids.
        positions: int64 [T], position of each token in its sequence (0 for padded rows).
        seq_lens: int32 [R], tokens in each request's KV cache after this step (context + query);
            0 for padded rows.
        query_lens: int32 [R], tokens of each request in this step (1 for decode).
        query_start_loc: int32 [R + 1], exclusive prefix sum of ``query_lens``.
        block_table: int32 [R, max_blocks_per_seq], KV block ids of each request; ``NULL_BLOCK``
            where unused.
        slot_mapping: int64 [T], flat KV slot (``block * block_size + offset``) each token's K/V
            is written to; ``PAD_SLOT_ID`` for padded rows.
        logits_indices: int64 [S], token rows whose hidden states are turned into logits (the last
            token of each request that samples this step).
        num_actual_tokens: real (unpadded) token rows, a host int.
        num_actual_reqs: real (unpadded) request rows, a host int.
        max_query_len: largest query length in the batch, a host int (1 for uniform decode).
        query_lens_cpu / seq_lens_cpu: host copies for eager-only code paths (prefill attention may
            loop over requests with them; code that runs inside a CUDA graph must not use them).
        uniform_query_len: a host int; ``q > 1`` marks a speculative-decoding *verification batch*:
            every request row (padded ones included) owns exactly ``q`` consecutive token rows
            (``k`` draft tokens after the last accepted one: ``T == R * q``, ``query_start_loc ==
            arange(R + 1) * q``, ``max_query_len == q``), ``seq_lens`` counts each request's
            context plus its ``q`` rows, and every token row produces logits (``logits_indices``
            ``arange(T)``, or at least ``T`` rows). Its attention then runs as ``T`` decode rows
            (runtime/model/verify_attention.py: graph-safe, no host lengths read), which equals
            the general prefill path on the same batch. 0 (the default) or 1: not a verification
            batch; attention takes the decode or general path by ``max_query_len``.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    num_actual_tokens: int
    num_actual_reqs: int
    max_query_len: int
    query_lens_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    uniform_query_len: int = 0

    @property
    def num_tokens(self) -> int:
        """Token rows including padding (T)."""
        return int(self.input_ids.shape[0])

    @property
    def num_reqs(self) -> int:
        """Request rows including padding (R)."""
        return int(self.seq_lens.shape[0])

    @property
    def is_uniform_decode(self) -> bool:
        """Every real request has query length 1 (the batch a FULL graph can replay)."""
        return self.max_query_len == 1

    def to(self, device: torch.device | str) -> ForwardMetadata:
        """This batch with every tensor on ``device``: one packed copy per dtype, not one per field.

        Returns ``self`` when the tensors are already there.
        """
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        fields_by_dtype: dict[torch.dtype, list[str]] = {}
        for name, tensor in self.tensors().items():
            fields_by_dtype.setdefault(tensor.dtype, []).append(name)
        moved: dict[str, torch.Tensor] = {}
        for names in fields_by_dtype.values():
            packed = torch.cat([getattr(self, n).reshape(-1) for n in names]).to(device, non_blocking=True)
            for name, part in zip(names, packed.split([getattr(self, n).numel() for n in names])):
                moved[name] = part.view(getattr(self, name).shape)
        return replace(self, **moved)

    def clone(self) -> ForwardMetadata:
        """A copy whose tensors are new (host mirrors are shared: they are never modified)."""
        return replace(self, **{name: t.clone() for name, t in self.tensors().items()})

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name (what the graph runner's static buffers mirror)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
