"""One engine step on the model: prepare inputs, execute the model, sample.

The three phases are separate methods on purpose: the graph runner sits between
:meth:`ModelRunner.prepare_inputs` (which builds one :class:`ForwardMetadata` of tensors from the
scheduled batch) and the model, replacing :meth:`ModelRunner.execute_model` by a replay when a
captured graph key fits; sampling stays outside the graph and reads only per-row tensors.

In eager mode nothing is padded: T = scheduled tokens, R = scheduled sequences, and the block
table is as wide as the longest block table in the batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphserving.runtime.block_manager import BlockManager
from graphserving.runtime.forward_metadata import NULL_BLOCK, ForwardMetadata
from graphserving.runtime.sampler import SamplerOutput, SamplingTensors, sample
from graphserving.runtime.scheduler import ScheduledSequence, SchedulerOutput


@dataclass
class ModelInput:
    """Everything one step needs.

    Attributes:
        meta: the forward metadata (device tensors + host mirrors).
        sampling: per-row sampling tensors for the rows that sample, or None when none samples
            (every row is a prefill chunk that does not reach its prompt's end).
        sample_rows: the scheduled rows that sample, in the order of ``meta.logits_indices``.
    """

    meta: ForwardMetadata
    sampling: SamplingTensors | None
    sample_rows: list[ScheduledSequence]


def _pad_rows(rows: list[list[int]], pad: int) -> list[list[int]]:
    width = max((len(r) for r in rows), default=0)
    return [r + [pad] * (width - len(r)) for r in rows]


class ModelRunner:
    """Runs scheduled batches through a model over a paged KV cache.

    Args:
        model: has ``forward(meta, kv_caches) -> hidden [T, H]`` and ``compute_logits(hidden [S, H])
            -> float32 [S, V]``.
        kv_caches: the per-layer KV-cache tensors the model reads and writes.
        block_manager: gives block tables and slot mappings.
        vocab_size: columns of the logits (also the pad id of the penalty token tensors).
        device: where the metadata tensors go.
    """

    def __init__(self, model, kv_caches: list[torch.Tensor], block_manager: BlockManager, vocab_size: int, device):
        self.model = model
        self.kv_caches = kv_caches
        self.block_manager = block_manager
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.graph_runner = None  # a GraphRunner replays captured graphs where a key fits

    # -- phase 1 ------------------------------------------------------------------------------
    def prepare_inputs(self, out: SchedulerOutput) -> ModelInput:
        """Build the forward metadata and the sampling tensors of a scheduled batch.

        Raises:
            ValueError: the batch is empty or a row has no KV block for one of its tokens.
        """
        if out.is_empty:
            raise ValueError("cannot prepare an empty batch")
        bm = self.block_manager
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_indices: list[int] = []
        sample_rows: list[ScheduledSequence] = []
        for row in out.scheduled:
            seq = row.seq
            tokens = seq.token_ids
            input_ids.extend(tokens[row.start : row.end])
            positions.extend(range(row.start, row.end))
            slots.extend(bm.slot_mapping(seq.seq_id, row.start, row.end))
            query_lens.append(row.num_new_tokens)
            seq_lens.append(row.end)
            tables.append(bm.block_table(seq.seq_id))
            if row.samples:
                logits_indices.append(len(input_ids) - 1)
                sample_rows.append(row)
        query_start_loc = [0]
        for q in query_lens:
            query_start_loc.append(query_start_loc[-1] + q)

        def t(values, dtype):
            # Host tensors: the graph runner pads them into its static buffers with one copy per
            # dtype; the eager path moves them with ForwardMetadata.to (likewise packed).
            return torch.tensor(values, dtype=dtype)

        meta = ForwardMetadata(
            input_ids=t(input_ids, torch.int64),
            positions=t(positions, torch.int64),
            seq_lens=t(seq_lens, torch.int32),
            query_lens=t(query_lens, torch.int32),
            query_start_loc=t(query_start_loc, torch.int32),
            block_table=t(_pad_rows(tables, NULL_BLOCK), torch.int32),
            slot_mapping=t(slots, torch.int64),
            logits_indices=t(logits_indices, torch.int64),
            num_actual_tokens=len(input_ids),
            num_actual_reqs=len(query_lens),
            max_query_len=max(query_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        sampling = self.sampling_tensors([r.seq for r in sample_rows]) if sample_rows else None
        return ModelInput(meta=meta, sampling=sampling, sample_rows=sample_rows)

    def sampling_tensors(self, seqs: list) -> SamplingTensors:
        """Per-row sampling tensors for sequences that each sample one token (row order kept).

        The per-row parameters travel in two packed host tensors (float32 and int64), so a step
        costs two host-to-device copies however many parameters there are.
        """
        dev = self.device
        params = [s.params for s in seqs]
        vocab = self.vocab_size
        floats = torch.tensor(
            [[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params],
             [p.repetition_penalty for p in params], [p.presence_penalty for p in params],
             [p.frequency_penalty for p in params]],
            dtype=torch.float32,
        ).to(dev, non_blocking=True)
        ints = torch.tensor(
            [[min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params],
             [s.seed for s in seqs], [s.num_output_tokens for s in seqs]],
            dtype=torch.int64,
        ).to(dev, non_blocking=True)
        do_penalties = any(p.needs_penalties for p in params)
        if do_penalties:
            prompt = _pad_rows([s.prompt_token_ids for s in seqs], vocab)
            output = _pad_rows([s.output_token_ids for s in seqs], vocab)
            prompt_t = torch.tensor(prompt, dtype=torch.int64).reshape(len(seqs), -1).to(dev)
            output_t = torch.tensor(output, dtype=torch.int64).reshape(len(seqs), -1).to(dev)
        else:
            prompt_t = output_t = torch.empty(len(seqs), 0, dtype=torch.int64, device=dev)
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        temperature, top_p, min_p, repetition, presence, frequency = floats.unbind(0)
        top_k, seeds, steps = ints.unbind(0)
        return SamplingTensors(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition,
            presence_penalty=presence,
            frequency_penalty=frequency,
            seeds=seeds,
            steps=steps,
            prompt_token_ids=prompt_t,
            output_token_ids=output_t,
            num_logprobs=max(logprobs) if logprobs else -1,
            all_greedy=all(p.greedy for p in params),
            do_penalties=do_penalties,
            do_top_k_top_p=any(not p.greedy and (0 < p.top_k or p.top_p < 1) for p in params),
            do_min_p=any(not p.greedy and p.min_p > 0 for p in params),
        )

    # -- phase 2 ------------------------------------------------------------------------------
    def execute_model(self, meta: ForwardMetadata) -> torch.Tensor:
        """One forward pass; returns float32 logits [S, V] of the rows in ``meta.logits_indices``.

        With a graph runner attached, the pass replays a captured graph when a key fits (the
        runner pads into its static buffers and copies the logits out), eagerly otherwise.
        """
        with torch.inference_mode():
            if self.graph_runner is not None:
                return self.graph_runner.execute(meta)[0]
            meta = meta.to(self.device)
            hidden = self.model.forward(meta, self.kv_caches)
            return self.model.compute_logits(hidden[meta.logits_indices])

    # -- phase 3 ------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, sampling: SamplingTensors) -> SamplerOutput:
        """Sample one token per logits row (see :func:`graphserving.runtime.sampler.sample`)."""
        with torch.inference_mode():
            return sample(logits, sampling)

    def run(self, out: SchedulerOutput, num_steps: int = 1) -> tuple[list[ScheduledSequence], list[SamplerOutput]]:
        """prepare_inputs -> execute_model -> sample, for one scheduled batch.

        With ``num_steps > 1`` (multi-step decoding; the batch must be uniform decode with every row
        sampling, and the scheduler must have reserved the slots: ``Scheduler.reserve_decode_steps``)
        the sampled tokens are fed back on the device (:func:`advance_decode`) and the model runs
        ``num_steps`` times without a host synchronisation; step ``j`` samples with RNG counter
        ``steps + j``, exactly what ``num_steps`` single steps would use.

        Returns:
            (the rows that sample, one :class:`SamplerOutput` per step; empty when no row samples).

        Raises:
            ValueError: ``num_steps > 1`` for a batch that is not uniform decode.
        """
        model_input = self.prepare_inputs(out)
        meta = model_input.meta
        if num_steps > 1 and (meta.max_query_len != 1 or len(model_input.sample_rows) != meta.num_reqs):
            raise ValueError("multi-step decoding needs a uniform-decode batch in which every row samples")
        logits = self.execute_model(meta)
        if model_input.sampling is None:
            return [], []
        sampling = model_input.sampling
        outputs = [self.sample(logits, sampling)]
        if num_steps == 1:
            return model_input.sample_rows, outputs
        with torch.inference_mode():
            replay_next = self._next_decode_step(meta)
            for _ in range(num_steps - 1):
                logits = replay_next(outputs[-1].token_ids)
                sampling = dataclasses.replace(sampling, steps=sampling.steps + 1)
                outputs.append(sample(logits, sampling))
        return model_input.sample_rows, outputs

    def _next_decode_step(self, meta: ForwardMetadata) -> Callable[[torch.Tensor], torch.Tensor]:
        """A function that advances the decode batch just executed by one token and runs it again.

        Where the batch replayed a FULL graph, the graph's static buffers are advanced in place and
        the graph replays as is (no refill); otherwise the batch's metadata is moved to the device
        once and advanced there, and each step goes through :meth:`execute_model` (eager, or a
        graph key chosen again).
        """
        block_size = self.block_manager.block_size
        num_reqs = meta.num_reqs
        gr = self.graph_runner
        resident = gr.resident_decode_view(meta) if gr is not None else None
        if resident is not None:
            view, replay = resident

            def next_resident(token_ids: torch.Tensor) -> torch.Tensor:
                advance_decode(view, token_ids, num_reqs, block_size)
                return replay()

            return next_resident
        state = meta.to(self.device)
        state = dataclasses.replace(state if state is not meta else meta.clone(), query_lens_cpu=None, seq_lens_cpu=None)

        def next_eager(token_ids: torch.Tensor) -> torch.Tensor:
            advance_decode(state, token_ids, num_reqs, block_size)
            return self.execute_model(state)

        return next_eager


def advance_decode(meta: ForwardMetadata, token_ids: torch.Tensor, num_reqs: int, block_size: int) -> None:
    """Turn a uniform-decode batch into its next step, in place and on the device (no host sync).

    Rows ``0 .. num_reqs - 1`` (the real ones) take ``token_ids`` as their input, move one position
    on (``positions``, ``seq_lens``) and get the slot of the new position from their block table
    (``block_table[r, pos // block_size] * block_size + pos % block_size``); padded rows beyond
    ``num_reqs`` keep their sentinels. The block table must already hold the new positions.

    Args:
        meta: a uniform-decode batch (T = R), its tensors on the device; modified in place.
        token_ids: int64 [num_reqs], each row's sampled token.
        num_reqs: the real rows.
        block_size: tokens per KV block.
    """
    n = num_reqs
    meta.input_ids[:n].copy_(token_ids)
    positions = meta.positions[:n]
    positions.add_(1)
    meta.seq_lens[:n].add_(1)
    blocks = meta.block_table[:n].gather(1, torch.div(positions, block_size, rounding_mode="floor")[:, None])
    torch.add(positions % block_size, blocks[:, 0], alpha=block_size, out=meta.slot_mapping[:n])
