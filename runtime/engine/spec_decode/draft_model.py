"""A draft model: a second, smaller model of the target's vocabulary proposes the drafts.

The draft model (our ``LlamaForCausalLM``, e.g. a 135M model drafting for a larger one of the same
tokenizer) runs one prefill of each request's tokens and ``k - 1`` decode steps over a paged KV
cache of its own, and draws each draft from its logits: greedily (a point mass, the default), or
from ``softmax(logits / temperature)``, in which case the proposal carries those distributions for
rejection sampling (runtime/engine/spec_decode/rejection.py).

The cache is rebuilt for every call (each request's context is prefilled again): simple and
stateless, proportional to the context length per step. An engine that keeps the draft model's KV
across steps (a second cache addressed by the target's block tables: a token's slot is the same in
both) would prefill only the tokens accepted since the last step.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from ...model.forward_metadata import ForwardMetadata, to_device
from ...model.kv_cache import allocate_kv_cache
from ...model.kv_layout import NULL_BLOCK
from ...model.llama import LlamaForCausalLM
from ..sampler import counter_uniform
from .drafter import PAD_DRAFT, DraftProposal, DraftRequest, check_num_speculative_tokens

DRAFT_SEED_SALT = 0x2545F4914F6CDD1D
"""XOR-ed into a request's seed for the noise its drafts are drawn with: independent of the
target's token noise and acceptance uniforms at the same steps (rejection sampling needs the draft
independent of both)."""


class DraftModelDrafter:
    """The :class:`~.drafter.Drafter` of a draft model.

    Args:
        model: the draft model (weights loaded), on the device drafts are computed on.
        num_speculative_tokens: ``k``, 1 .. ``drafter.MAX_SPECULATIVE_TOKENS``.
        target_vocab_size: the target model's vocabulary size; the draft model's must equal it.
        temperature: 0 draws greedily (point-mass proposals); > 0 samples and returns ``q``.
        num_kv_blocks / block_size: the draft cache (the null block included); every call's
            contexts plus ``k`` tokens each must fit.

    Raises:
        ValueError: the vocabularies differ, ``k`` is out of range, or ``temperature < 0``.
    """

    def __init__(self, model: LlamaForCausalLM, num_speculative_tokens: int, target_vocab_size: int,
                 temperature: float = 0.0, num_kv_blocks: int = 256, block_size: int = 16) -> None:
        if model.config.vocab_size != target_vocab_size:
            raise ValueError(f"the draft model's vocabulary ({model.config.vocab_size} tokens) differs from the "
                             f"target's ({target_vocab_size}); a draft model must share the target's tokenizer")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.model = model
        self.num_speculative_tokens = check_num_speculative_tokens(num_speculative_tokens)
        self.temperature = temperature
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.device = model.embed_tokens.device
        self.kv_caches = allocate_kv_cache(model.config, num_kv_blocks, block_size, model.dtype, self.device)

    def _tables(self, lengths: list[int]) -> list[list[int]]:
        """Consecutive blocks for each request's ``length`` tokens, after the null block.

        Raises:
            ValueError: they do not fit in the cache.
        """
        tables, next_block = [], NULL_BLOCK + 1
        for length in lengths:
            count = -(-length // self.block_size)
            tables.append(list(range(next_block, next_block + count)))
            next_block += count
        if next_block > self.num_kv_blocks:
            raise ValueError(f"the draft cache has {self.num_kv_blocks} blocks of {self.block_size} tokens, "
                             f"{next_block} needed for contexts of {sum(lengths)} tokens; raise num_kv_blocks")
        return tables

    def _forward(self, inputs: list[list[int]], starts: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Request ``i`` runs ``inputs[i]`` at positions ``starts[i]..``; float32 [R, V], the logits
        of each request's last input token."""
        ids, positions, slots, logits_rows = [], [], [], []
        for tokens, start, table in zip(inputs, starts, tables):
            for offset, token in enumerate(tokens):
                pos = start + offset
                ids.append(int(token))
                positions.append(pos)
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            logits_rows.append(len(ids) - 1)
        query_lens = [len(t) for t in inputs]
        seq_lens = [s + n for s, n in zip(starts, query_lens)]
        width = max(len(t) for t in tables)
        dev = self.device
        meta = ForwardMetadata(
            input_ids=to_device(ids, torch.int64, dev),
            positions=to_device(positions, torch.int64, dev),
            seq_lens=to_device(seq_lens, torch.int32, dev),
            query_lens=to_device(query_lens, torch.int32, dev),
            query_start_loc=to_device([0, *itertools.accumulate(query_lens)], torch.int32, dev),
            block_table=to_device([t + [NULL_BLOCK] * (width - len(t)) for t in tables], torch.int32, dev),
            slot_mapping=to_device(slots, torch.int64, dev),
            logits_indices=to_device(logits_rows, torch.int64, dev),
            num_actual_tokens=len(ids),
            num_actual_reqs=len(inputs),
            max_query_len=max(query_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        hidden = self.model(meta, self.kv_caches)
        return self.model.compute_logits(hidden[meta.logits_indices])

    def _draw(
        self, logits: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft per row from logits [N, V]: (int64 [N], q float32 [N, V] or None when greedy)."""
        if self.temperature == 0:
            return logits.argmax(dim=-1), None
        probs = (logits / self.temperature).softmax(dim=-1)
        noise = -torch.log(counter_uniform(seeds ^ DRAFT_SEED_SALT, steps, logits.shape[1])).to(torch.float32)
        return (probs / noise).argmax(dim=-1), probs

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest], device: torch.device | str) -> DraftProposal:
        """Drafts for each request: ``min(k, max_drafts, positions left in the draft model)``."""
        k = self.num_speculative_tokens
        vocab = self.model.config.vocab_size
        wanted = [max(0, min(k, r.max_drafts, self.model.max_positions - len(r.token_ids))) if len(r.token_ids) else 0
                  for r in requests]
        active = [i for i, n in enumerate(wanted) if n > 0]
        token_ids = torch.full((len(requests), k), PAD_DRAFT, dtype=torch.int64, device=self.device)
        probs = None if self.temperature == 0 else torch.zeros(len(requests), k, vocab, device=self.device)
        if active:
            contexts = [list(requests[i].token_ids) for i in active]
            tables = self._tables([len(c) + k for c in contexts])
            seeds = to_device([requests[i].seed for i in active], torch.int64, self.device)
            steps = to_device([requests[i].step for i in active], torch.int64, self.device)
            index = to_device(active, torch.int64, self.device)
            logits = self._forward(contexts, [0] * len(contexts), tables)
            for j in range(k):
                drafts, q = self._draw(logits, seeds, steps + j)
                token_ids[index, j] = drafts
                if q is not None:
                    probs[index, j] = q
                if j + 1 < k:
                    logits = self._forward([[int(t)] for t in drafts.tolist()],
                                           [len(c) + j for c in contexts], tables)
        num_drafts = torch.tensor(wanted, dtype=torch.int64)
        real = torch.arange(k)[None, :] < num_drafts[:, None]
        token_ids = torch.where(real.to(self.device), token_ids, PAD_DRAFT)
        return DraftProposal(token_ids=token_ids.to(device), num_drafts=num_drafts.to(device),
                             probs=None if probs is None else probs.to(device))
