"""One engine step on the model: prepare inputs, execute the model, sample.

The three phases are separate methods on purpose: the graph runner sits between
:meth:`ModelRunner.prepare_inputs` (which builds one :class:`ForwardMetadata` of tensors from the
scheduled batch) and the model, replacing :meth:`ModelRunner.execute_model` by a replay when a
captured graph key fits; sampling stays outside the graph and reads only per-row tensors.

The graph runner comes in through the constructor as a :class:`GraphExecutor` (the
``graphs.runner.GraphRunner`` fits it); this package never imports the graphs package.

In eager mode nothing is padded: T = scheduled tokens, R = scheduled sequences, and the block
table is as wide as the longest block table in the batch.

Multi-step decoding (:meth:`ModelRunner.run` with ``num_steps > 1``, then
:meth:`ModelRunner.continue_decode`): a uniform-decode batch runs several steps from one
``prepare_inputs``, each step's sampled tokens fed back on the device by :func:`advance_decode`
(in place in a FULL graph's static buffers, or in the run's own device metadata); nothing waits
for the device until the engine reads the tokens.

Nothing on the decode path may synchronise the host with the device, or the engine's pipelining
(launch run k+1, then process run k's tokens) collapses: a blocking host-to-device copy
(``torch.tensor(..., device=cuda)`` from pageable memory) waits for every queued kernel, and so
does ``.tolist()`` on a device tensor once the next run is queued behind it. Small host data
therefore travels through pinned memory (:func:`to_device`), and each run's sampled tokens are
copied to pinned host memory right after its last step, with an event to wait on
(:func:`stage_to_host`), before the next run is launched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .block_manager import BlockManager
from .decode_advance import advance_decode
from ..model.forward_metadata import ForwardMetadata, to_device
from ..model.kv_layout import NULL_BLOCK, PAD_SLOT_ID
from .prompt_logprobs import PromptLogprobRows, PromptLogprobs, scored_positions
from .prompt_logprobs import compute as compute_prompt_logprobs
from .sampler import SamplerOutput, SamplingTensors, sample
from .scheduler import ScheduledSequence, SchedulerOutput
from .structured import bitmask_width, fill_bitmask


class GraphExecutor(Protocol):
    """What the model runner uses of a graph runner (``graphs.runner.GraphRunner`` is one).

    Attributes:
        generation: increases with every capture, invalidation, dropped key, disable or
            reconfiguration, and never decreases; a multi-step decode run continues only on the
            generation it started on (:meth:`ModelRunner.can_continue`).
    """

    generation: int

    def execute(self, meta: ForwardMetadata) -> tuple[torch.Tensor, object]:
        """One forward pass of an unpadded batch (host or device metadata), replayed where a graph
        key fits: (float32 logits [S, vocab] of ``meta.logits_indices``, owned by the caller; the
        dispatch decision)."""
        ...

    def resident_decode_view(
        self, meta: ForwardMetadata
    ) -> tuple[ForwardMetadata, Callable[..., torch.Tensor]] | None:
        """After :meth:`execute` of the uniform-decode ``meta`` replayed a FULL graph key: (that
        key's static buffers as metadata, to advance in place; a function that replays the key on
        them as they are and returns float32 logits [num_reqs, vocab], owned by the caller, or with
        ``copy_out=False`` a view valid until the next replay). None when that pass was not a FULL
        replay."""
        ...

    def resident_view(self, meta: ForwardMetadata) -> tuple[ForwardMetadata, Callable[..., torch.Tensor]] | None:
        """As :meth:`resident_decode_view` for a uniform batch of any query length not yet run:
        ``meta`` written into its FULL key's static buffers, not replayed."""
        ...


@dataclass
class ModelInput:
    """Everything one step needs.

    Attributes:
        meta: the forward metadata (device tensors + host mirrors).
        sampling: per-row sampling tensors for the rows that sample, or None when none samples
            (every row is a prefill chunk that does not reach its prompt's end).
        sample_rows: the scheduled rows that sample, in the order of ``meta.logits_indices``.
        prompt: the prompt positions whose logits score prompt tokens (:mod:`.prompt_logprobs`),
            their indices in ``meta.logits_indices`` after those of ``sample_rows``; None when
            no row computes prompt log-probabilities.
    """

    meta: ForwardMetadata
    sampling: SamplingTensors | None
    sample_rows: list[ScheduledSequence]
    prompt: PromptLogprobRows | None = None


@dataclass
class DecodeRun:
    """The device state of a multi-step decode run, from which more steps can be run.

    Attributes:
        meta: the batch's metadata on the device (the static buffers of a FULL graph key, or the
            run's own copy), advanced in place by each step (:func:`advance_decode`).
        replay: runs the batch as ``meta`` holds it (called with ``meta``); returns float32 logits
            [R, vocab], which may be the graph runner's logits buffer: read them (in stream order)
            before the next replay.
        resident: ``meta`` is a FULL graph key's static buffers (fixed block-table width).
        seq_ids: the sequence of each real row.
        table_lens: block-table entries of each row already on the device.
        sampling: the sampling tensors of the last step run (``steps`` is its RNG counter).
        last_token_ids: int64 [R], the tokens sampled by the last step (device).
        graph_generation: the graph runner's generation when the run started (None without one); a
            recapture, a reconfiguration, an invalidation or a dropped key makes the run impossible
            to continue.
        live: int64 [R] on the device, 1 for rows still decoding, 0 for rows retired into padding
            (:meth:`ModelRunner.continue_decode`); None while every row is live.
        retired: indices of the retired rows (host).
    """

    meta: ForwardMetadata
    replay: Callable[[ForwardMetadata], torch.Tensor]
    resident: bool
    seq_ids: list[str]
    table_lens: list[int]
    sampling: SamplingTensors
    last_token_ids: torch.Tensor
    graph_generation: int | None
    live: torch.Tensor | None = None
    retired: set[int] = dataclasses.field(default_factory=set)


@dataclass
class RunOutput:
    """What :meth:`ModelRunner.run` returns.

    Attributes:
        rows: the scheduled rows that sample, in the order of each step's sampled tokens.
        sampled: one :class:`SamplerOutput` per step run (device tensors; empty when no row samples).
        decode: the continuation of a multi-step decode run, else None.
        prompt_logprobs: the prompt log-probabilities the run computed (device tensors), or None.
    """

    rows: list[ScheduledSequence]
    sampled: list[SamplerOutput]
    decode: DecodeRun | None = None
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class HostSamples:
    """A run's sampled tokens (and log-probabilities) on their way to host memory.

    Attributes:
        token_ids: int64 [steps, S].
        logprobs: float32 [steps, S], or None.
        top_token_ids / top_logprobs: int64 / float32 [steps, S, K], or None.
        ready: CUDA event recorded after the copies (None when the tensors were on the host already).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None

    def lists(self) -> tuple[list, list | None, list | None, list | None]:
        """Wait for the copies (this run only, not work queued after it) and return the four
        fields as nested lists (None for absent fields)."""
        if self.ready is not None:
            self.ready.synchronize()
        return tuple(t.tolist() if t is not None else None  # type: ignore[return-value]
                     for t in (self.token_ids, self.logprobs, self.top_token_ids, self.top_logprobs))


def stage_to_host(sampled: list[SamplerOutput]) -> HostSamples | None:
    """Start copying the tokens of ``sampled`` (one SamplerOutput per step, device tensors) to
    pinned host memory; does not wait. Call it right after the run's last step is launched and
    before anything else is queued, so that :meth:`HostSamples.lists` waits for this run only.
    Returns None for an empty list."""
    if not sampled:
        return None
    first = sampled[0]

    def stacked(name: str) -> torch.Tensor | None:
        if getattr(first, name) is None:
            return None
        t = torch.stack([getattr(s, name) for s in sampled])
        if t.device.type != "cuda":
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    staged = HostSamples(*(stacked(n) for n in ("token_ids", "logprobs", "top_token_ids", "top_logprobs")))
    if first.token_ids.device.type == "cuda":
        staged.ready = torch.cuda.Event()
        staged.ready.record()
    return staged


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
        graph_runner: replays captured graphs where a graph key fits, over the same ``model`` and
            ``kv_caches``; None runs every batch eagerly. Fixed for the runner's life: a recapture
            reconfigures the graph runner in place (its generation moves on).
        eos_token_ids: the ids that end a generation (masked, with a row's stop token ids, while the
            row has fewer than ``min_tokens`` output tokens).
    """

    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        block_manager: BlockManager,
        vocab_size: int,
        device,
        graph_runner: GraphExecutor | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ):
        self.model = model
        self.eos_token_ids = tuple(eos_token_ids)
        self._mask_host: torch.Tensor | None = None  # pinned grammar bitmask buffer (CUDA only)
        self._mask_copied: torch.cuda.Event | None = None
        self.kv_caches = kv_caches
        self.block_manager = block_manager
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._graph_runner = graph_runner

    @property
    def graph_runner(self) -> GraphExecutor | None:
        """The graph runner given to the constructor (read-only), or None (eager)."""
        return self._graph_runner

    # -- phase 1 ------------------------------------------------------------------------------
    def prepare_inputs(self, out: SchedulerOutput) -> ModelInput:
        """Build the forward metadata and the sampling tensors of a scheduled batch.

        ``logits_indices`` holds the last token row of each row that samples, then the token rows
        of the prompt positions that score prompt tokens (:func:`.prompt_logprobs.scored_positions`).

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
        prompt, prompt_indices = PromptLogprobRows(), []
        for row in out.scheduled:
            seq = row.seq
            tokens = seq.token_ids
            if scored := scored_positions(row):
                first = len(input_ids) - row.start
                prompt_indices.extend(range(first + scored.start, first + scored.stop))
                prompt.add(seq, tokens[scored.start + 1 : scored.stop + 1])
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
            logits_indices=t(logits_indices + prompt_indices, torch.int64),
            num_actual_tokens=len(input_ids),
            num_actual_reqs=len(query_lens),
            max_query_len=max(query_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        sampling = self.sampling_tensors([r.seq for r in sample_rows]) if sample_rows else None
        return ModelInput(meta=meta, sampling=sampling, sample_rows=sample_rows, prompt=prompt if prompt.seqs else None)

    def sampling_tensors(self, seqs: list) -> SamplingTensors:
        """Per-row sampling tensors for sequences that each sample one token (row order kept).

        The per-row parameters travel in two packed host tensors (float32 and int64), so a step
        costs two host-to-device copies however many parameters there are.
        """
        dev = self.device
        params = [s.params for s in seqs]
        vocab = self.vocab_size
        floats = to_device(
            [[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params],
             [p.repetition_penalty for p in params], [p.presence_penalty for p in params],
             [p.frequency_penalty for p in params]],
            torch.float32, dev,
        )
        ints = to_device(
            [[min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params],
             [s.seed for s in seqs], [s.num_output_tokens for s in seqs]],
            torch.int64, dev,
        )
        do_penalties = any(p.needs_penalties for p in params)
        if do_penalties:
            prompt = _pad_rows([s.prompt_token_ids for s in seqs], vocab)
            output = _pad_rows([s.output_token_ids for s in seqs], vocab)
            prompt_t = to_device(prompt, torch.int64, dev).reshape(len(seqs), -1)
            output_t = to_device(output, torch.int64, dev).reshape(len(seqs), -1)
        else:
            prompt_t = output_t = torch.empty(len(seqs), 0, dtype=torch.int64, device=dev)
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        temperature, top_p, min_p, repetition, presence, frequency = floats.unbind(0)
        top_k, seeds, steps = ints.unbind(0)
        return SamplingTensors(
            **self._constraint_tensors(seqs),
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

    def _constraint_tensors(self, seqs: list) -> dict:
        """The ``min_tokens`` and ``logit_bias`` fields of :class:`SamplingTensors` for ``seqs``
        (only those some row needs; see the sampler). The grammar bitmask comes later, from
        :meth:`with_grammar_mask`."""
        dev, vocab = self.device, self.vocab_size
        fields: dict = {}
        if any(s.params.min_tokens > 0 for s in seqs):
            stop_ids = [[*(() if s.params.ignore_eos else self.eos_token_ids), *s.params.stop_token_ids]
                        if s.params.min_tokens > 0 else [] for s in seqs]
            fields["min_tokens"] = to_device([s.params.min_tokens for s in seqs], torch.int64, dev)
            fields["min_tokens_stop_ids"] = to_device(_pad_rows(stop_ids, vocab), torch.int64, dev).reshape(len(seqs), -1)
        if any(s.params.logit_bias for s in seqs):
            ids = _pad_rows([[t for t, _ in s.params.logit_bias] for s in seqs], 0)
            values = _pad_rows([[b for _, b in s.params.logit_bias] for s in seqs], 0.0)
            fields["bias_token_ids"] = to_device(ids, torch.int64, dev).reshape(len(seqs), -1)
            fields["bias_values"] = to_device(values, torch.float32, dev).reshape(len(seqs), -1)
        return fields

    def with_grammar_mask(self, sampling: SamplingTensors, rows: list[ScheduledSequence]) -> SamplingTensors:
        """``sampling`` with the allowed-token bitmask of the rows' grammars
        (:func:`~.structured.fill_bitmask`), or ``sampling`` itself when no row has one.

        Called after the forward pass is launched: the host fills the masks while the device runs
        the pass (a non-blocking copy from pinned memory follows), so their cost hides behind it.
        """
        matchers = [row.seq.matcher for row in rows]
        if all(m is None for m in matchers):
            return sampling
        if self.device.type != "cuda":
            mask = fill_bitmask(matchers, self.vocab_size).to(self.device)
            return dataclasses.replace(sampling, allowed_bitmask=mask)
        # one pinned host buffer, reused (a pinned allocation per step cost 0.85 ms at 64 rows on an
        # H200 host); the previous step's copy out of it is waited for first (done by then, as that
        # step's tokens have been read).
        if self._mask_host is None or self._mask_host.shape[0] < len(matchers):
            self._mask_host = torch.empty((len(matchers), bitmask_width(self.vocab_size)), dtype=torch.int32,
                                          pin_memory=True)
        elif self._mask_copied is not None:
            self._mask_copied.synchronize()
        mask = fill_bitmask(matchers, self.vocab_size, out=self._mask_host).to(self.device, non_blocking=True)
        self._mask_copied = torch.cuda.Event()
        self._mask_copied.record()
        return dataclasses.replace(sampling, allowed_bitmask=mask)

    # -- phase 2 ------------------------------------------------------------------------------
    def execute_model(self, meta: ForwardMetadata) -> torch.Tensor:
        """One forward pass; returns float32 logits [S, V] of the rows in ``meta.logits_indices``.

        With a graph runner, the pass replays a captured graph when a key fits (the
        runner pads into its static buffers and copies the logits out), eagerly otherwise.
        """
        with torch.inference_mode():
            if self._graph_runner is not None:
                return self._graph_runner.execute(meta)[0]
            meta = meta.to(self.device)
            hidden = self.model.forward(meta, self.kv_caches)
            return self.model.compute_logits(hidden[meta.logits_indices])

    # -- phase 3 ------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, sampling: SamplingTensors) -> SamplerOutput:
        """Sample one token per logits row (see :func:`graphserving.runtime.engine.sampler.sample`)."""
        with torch.inference_mode():
            return sample(logits, sampling)

    def run(self, out: SchedulerOutput, num_steps: int = 1) -> RunOutput:
        """prepare_inputs -> execute_model -> sample, for one scheduled batch (and the prompt
        log-probabilities of its prefill rows that ask for them, :mod:`.prompt_logprobs`).

        With ``num_steps > 1`` (multi-step decoding; the batch must be uniform decode with every row
        sampling, and the scheduler must have reserved the slots: ``Scheduler.reserve_decode_steps``)
        the sampled tokens are fed back on the device (:func:`advance_decode`) and the model runs
        ``num_steps`` times without a host synchronisation; step ``j`` samples with RNG counter
        ``steps + j``, exactly what ``num_steps`` single steps would use. The returned
        :class:`DecodeRun` lets :meth:`continue_decode` run further steps of the same batch.

        Nothing here waits for the device: the sampled tokens are device tensors.

        Raises:
            ValueError: ``num_steps > 1`` for a batch that is not uniform decode.
        """
        model_input = self.prepare_inputs(out)
        meta = model_input.meta
        if num_steps > 1 and (meta.max_query_len != 1 or len(model_input.sample_rows) != meta.num_reqs):
            raise ValueError("multi-step decoding needs a uniform-decode batch in which every row samples")
        logits = self.execute_model(meta)
        prompt = None
        if model_input.prompt is not None:  # the logits rows after the sampling rows' score the prompt
            with torch.inference_mode():
                prompt = compute_prompt_logprobs(logits[len(model_input.sample_rows):], model_input.prompt)
            logits = logits[:len(model_input.sample_rows)]
        if model_input.sampling is None:
            return RunOutput([], [], prompt_logprobs=prompt)
        model_input.sampling = self.with_grammar_mask(model_input.sampling, model_input.sample_rows)
        first = self.sample(logits, model_input.sampling)
        if num_steps == 1:
            return RunOutput(model_input.sample_rows, [first], prompt_logprobs=prompt)
        seq_ids = [row.seq.seq_id for row in model_input.sample_rows]
        device_meta, replay, resident = self.resident_metadata(meta, executed=True)
        decode = DecodeRun(device_meta, replay, resident, seq_ids, [len(self.block_manager.block_table(s)) for s in seq_ids],
                           model_input.sampling, first.token_ids, self.graph_generation())
        return RunOutput(model_input.sample_rows, [first, *self.continue_decode(decode, num_steps - 1)], decode)

    def continue_decode(self, run: DecodeRun, num_steps: int, retire: list[int] | None = None) -> list[SamplerOutput]:
        """``num_steps`` more decode steps of a multi-step run, from its last sampled tokens.

        The caller must have reserved the slots of the live rows (``Scheduler.reserve_decode_steps``)
        and checked :meth:`can_continue`; blocks reserved since the run's last step are first copied
        into its device block table. Rows in ``retire`` (indices; sequences that end with the tokens
        already run) become padded rows: slot ``PAD_SLOT_ID``, no context, so they write no KV and
        cost only their padding; their sampled tokens are meaningless. Updates ``run`` so that it
        can be continued again; does not wait for the device.
        """
        outputs = []
        block_size = self.block_manager.block_size
        with torch.inference_mode():
            if retire:
                self._retire_rows(run, retire)
            self.refresh_block_tables(run)
            for _ in range(num_steps):
                # the inputs, positions, slots and RNG counters of the next step, in one kernel on CUDA
                advance_decode(run.meta, run.last_token_ids, len(run.seq_ids), block_size, run.live,
                               steps=run.sampling.steps)
                outputs.append(sample(run.replay(run.meta), run.sampling))
                run.last_token_ids = outputs[-1].token_ids
        return outputs

    def _retire_rows(self, run: DecodeRun, rows: list[int]) -> None:
        """Turn rows of a run into padded rows on the device (see :meth:`continue_decode`)."""
        index = to_device(rows, torch.int64, self.device)
        meta = run.meta
        if run.live is None:
            run.live = torch.ones(len(run.seq_ids), dtype=torch.int64, device=self.device)
        run.live.index_fill_(0, index, 0)
        meta.positions.index_fill_(0, index, 0)
        meta.seq_lens.index_fill_(0, index, 0)
        meta.slot_mapping.index_fill_(0, index, PAD_SLOT_ID)
        meta.block_table.index_fill_(0, index, NULL_BLOCK)
        run.retired.update(rows)

    def refresh_block_tables(self, run: DecodeRun) -> None:
        """Copy the block-table entries live rows gained since they were last put on the device.

        Only the rows that gained blocks and the changed columns travel (usually one column);
        retired rows are left alone (their device rows are all ``NULL_BLOCK``). An eager run's own
        table is widened when a row outgrows it.

        Raises:
            ValueError: a row outgrows the static block table of a graph key.
        """
        tables = {i: self.block_manager.block_table(s) for i, s in enumerate(run.seq_ids) if i not in run.retired}
        changed = [i for i, t in tables.items() if len(t) != run.table_lens[i]]
        if not changed:
            return
        lo = min(run.table_lens[i] for i in changed)
        hi = max(len(tables[i]) for i in changed)
        n = len(run.seq_ids)
        width = run.meta.block_table.shape[1]
        if hi > width:
            if run.resident:
                raise ValueError(f"a row needs {hi} KV blocks, more than the static block table's {width}")
            wide = torch.full((n, hi), NULL_BLOCK, dtype=run.meta.block_table.dtype, device=self.device)
            wide[:, :width].copy_(run.meta.block_table)
            run.meta = dataclasses.replace(run.meta, block_table=wide)
        cols = [tables[i][lo:hi] + [NULL_BLOCK] * (hi - lo - len(tables[i][lo:hi])) for i in changed]
        index = to_device(changed, torch.int64, self.device)
        values = to_device(cols, run.meta.block_table.dtype, self.device)
        run.meta.block_table[:, lo:hi].index_copy_(0, index, values)
        for i in changed:
            run.table_lens[i] = len(tables[i])

    def can_continue(self, run: DecodeRun) -> bool:
        """Whether ``run``'s device state is still valid: no capture, reconfiguration (a
        recapture), invalidation or dropped key since the run started (the graph runner's
        generation is the one the run started on)."""
        return run.graph_generation == self.graph_generation()

    def graph_generation(self) -> int | None:
        """The graph runner's generation now (None without one): a run continues only on the one it started on."""
        gr = self._graph_runner
        return gr.generation if gr is not None else None

    def resident_metadata(
        self, meta: ForwardMetadata, executed: bool = False
    ) -> tuple[ForwardMetadata, Callable[[ForwardMetadata], torch.Tensor], bool]:
        """The device metadata to advance for more steps of a uniform batch, the function that runs
        it, and whether the metadata is a graph key's static buffers.

        Where a FULL key fits: its static buffers, advanced in place and replayed as they are
        (``executed``: the batch just replayed, multi-step decoding; else, a speculative
        verification run, runtime/engine/spec_decode/resident.py, they are filled with ``meta``
        now). Otherwise the batch's metadata moved to the device once (the run's own copy), each
        step going through :meth:`execute_model` (eager, or a graph key chosen again).
        """
        gr = self._graph_runner
        resident = None if gr is None else gr.resident_decode_view(meta) if executed else gr.resident_view(meta)
        if resident is not None:
            view, replay = resident
            return view, lambda _meta: replay(copy_out=False), True
        state = meta.to(self.device)
        state = dataclasses.replace(state if state is not meta else meta.clone(), query_lens_cpu=None, seq_lens_cpu=None)
        return state, self.execute_model, False

