"""The serving engine: requests in, token and text deltas out, one scheduler step at a time.

:class:`LLMEngine` is synchronous and single-threaded: ``add_request``/``abort`` only queue
commands (safe from any thread), ``step`` runs one batch (schedule -> prepare inputs -> execute
model -> sample -> detokenize and check stops, :mod:`.output`), pipelining multi-step decode runs.
:class:`~graphserving.runtime.engine.async_engine.AsyncLLMEngine` runs ``step`` in a background
thread for the HTTP server.

KV-cache size: the block count of the given ``kv_caches``; otherwise
:func:`~graphserving.runtime.model.kv_cache.num_kv_blocks` (``EngineLimits.num_kv_blocks`` when
given; 512 blocks on CPU; on CUDA ``free device memory x kv_cache_memory_fraction / bytes per
block``). ``max_model_len`` is the model's context (or ``EngineLimits.max_model_len``), capped at
what the KV cache holds, so every admitted request fits on its own and preemption always makes
progress.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from graphserving.contract.worker_config import EngineLimits
from ..model.kv_cache import checked_or_allocated, kv_cache_bytes_per_block
from .async_engine import EngineDeadError
from .block_manager import BlockManager
from .metrics import EngineMetrics
from .model_runner import GraphExecutor, HostSamples, ModelRunner, RunOutput, stage_to_host
from .output import (
    CompletedChoice,
    Finish,
    RequestOutput,
    TokenTimes,
    add_delta,
    append_steps,
    append_tokens,
    new_detokenizer,
    stream_cuts,
    take_delta,
    take_prompt_logprobs,
    update_progress,
)
from .prompt_logprobs import prefilled_without_output, store as store_prompt_logprobs
from .scheduler import ScheduledSequence, Scheduler, SchedulerOutput, decode_steps
from .sequence import FinishReason, RequestError, SamplingParams, SamplingParamsError, Sequence, SequenceStatus
from .speculative import ResidentRun, SpeculativeDecoder
from .structured import GrammarCompiler, advance_grammar

log = logging.getLogger(__name__)


@dataclass
class _Run:
    """A batch launched on the device: its schedule, what the model runner returned, its steps."""

    sched: SchedulerOutput
    result: RunOutput
    num_steps: int
    num_emitted: list[int] | None = None  # a verification's tokens per row (speculative decoding)
    resident: ResidentRun | None = None  # verification steps run on the device (settled when processed)
    host: HostSamples | None = field(init=False)

    def __post_init__(self) -> None:
        # Staged now, right after the run's last step and before the next run is queued.
        self.host = self.resident.host if self.resident is not None else stage_to_host(self.result.sampled)


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    on_output: Callable[[RequestOutput], None] | None = None
    final_only: bool = False
    stream_interval: int | None = None


class LLMEngine:
    """Continuous-batching engine over one model.

    Args:
        model: the model (``forward(meta, kv_caches)``, ``compute_logits``).
        config: its :class:`~graphserving.runtime.model.config.ModelConfig`.
        tokenizer: its :class:`~graphserving.runtime.model.tokenizer.Tokenizer`.
        limits: scheduler and KV-cache limits.
        device / dtype: where and in which dtype the KV cache lives.
        seed: seeds the engine's RNG that draws seeds for requests without one.
        metrics: Prometheus metrics to update, or None.
        kv_caches: pre-allocated KV caches, one per layer, ``dtype`` [2, num_blocks, block_size,
            num_kv_heads, head_dim] on ``device`` (``num_kv_blocks`` is their ``num_blocks``), or
            None to size (:func:`~graphserving.runtime.model.kv_cache.num_kv_blocks`) and allocate.
        graph_runner: replays captured graphs where a graph key fits (built over ``kv_caches``),
            handed to the :class:`ModelRunner`; None runs every batch eagerly.
        speculative: drafts and verifies decode batches (runtime/engine/speculative.py); None: as
            ``limits.speculative`` asks (off when unset).

    Raises:
        ValueError: ``kv_caches`` do not match the model's layers, ``limits.block_size`` or a
            given ``limits.num_kv_blocks``.
        RuntimeError: sizing found no room for 2 KV blocks on the device.
    """

    def __init__(
        self,
        model,
        config,
        tokenizer,
        limits: EngineLimits | None = None,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        metrics: EngineMetrics | None = None,
        kv_caches: list[torch.Tensor] | None = None,
        graph_runner: GraphExecutor | None = None,
        speculative: SpeculativeDecoder | None = None,
    ):
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.limits = limits = limits or EngineLimits()
        self.device = torch.device(device)
        self.dtype = dtype
        self.metrics = metrics
        bytes_per_block = kv_cache_bytes_per_block(config, limits.block_size, dtype)
        self.kv_caches = checked_or_allocated(config, kv_caches, block_size=limits.block_size, num_blocks=limits.num_kv_blocks,
                                              memory_fraction=limits.kv_cache_memory_fraction, device=self.device, dtype=dtype)
        self.num_kv_blocks = self.kv_caches[0].shape[1]
        self.block_manager = BlockManager(self.num_kv_blocks, limits.block_size, limits.prefix_caching is not False)
        model_len = limits.max_model_len or config.max_model_len
        self.max_model_len = min(model_len, self.block_manager.capacity_tokens)
        if self.max_model_len < model_len:
            log.warning(
                "max_model_len lowered from %d to %d tokens: the KV cache holds %d blocks of %d tokens",
                model_len, self.max_model_len, self.block_manager.num_total_blocks, limits.block_size,
            )
        self.scheduler = Scheduler(self.block_manager, limits.max_num_seqs, limits.max_num_batched_tokens)
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(config.eos_token_ids)
        self.runner = ModelRunner(model, self.kv_caches, self.block_manager, config.vocab_size, self.device,
                                  graph_runner=graph_runner, eos_token_ids=tuple(sorted(self.eos_token_ids)))
        self.spec = speculative or SpeculativeDecoder.from_limits(limits, self.max_model_len, metrics)
        self._grammar_compiler: GrammarCompiler | None = None
        self._rng = random.Random(seed)
        self._requests: dict[str, _Request] = {}
        self._commands: deque[tuple[str, object]] = deque()
        self._commands_lock = threading.Lock()
        self._pending: _Run | None = None  # a multi-step decode run whose tokens are not processed yet
        log.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB), max_model_len %d",
            self.num_kv_blocks, limits.block_size, self.num_kv_blocks * bytes_per_block / 2**20, self.max_model_len,
        )
        if metrics is not None:
            metrics.observe_queues(running=0, waiting=0, kv_used=0, kv_total=self.block_manager.num_total_blocks)

    # -- requests -----------------------------------------------------------------------------
    def check_prompt(self, prompt_token_ids: list[int], param: str = "prompt") -> None:
        """Raise :class:`RequestError` naming ``param`` when the prompt cannot be served."""
        if not prompt_token_ids:
            raise RequestError(f"{param}: the prompt is empty", param=param, code="invalid_value")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise RequestError(
                f"{param}: token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})",
                param=param, code="invalid_value",
            )
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(
                f"{param}: the prompt has {len(prompt_token_ids)} tokens; this model's maximum context length is "
                f"{self.max_model_len} tokens, which must also leave room for at least one generated token",
                param=param, code="context_length_exceeded",
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        on_output: Callable[[RequestOutput], None] | None = None,
        arrival_time: float | None = None,
        final_only: bool = False,
        stream_interval: int | None = None,
    ) -> None:
        """Queue a request; it is admitted at the next :meth:`step`. Safe from any thread.

        With ``final_only`` (a non-streaming client) a choice is reported once, when it finishes,
        with all its text and tokens in one delta, instead of after every step. Otherwise a
        choice's update of a step holds everything that step produced for it, or, with
        ``stream_interval`` k, the step's tokens cut into deltas after the choice's first token and
        after every k-th (:func:`~.output.stream_cuts`): k = 1 turns a multi-step run of N tokens
        into N deltas, one token each.

        ``params.max_tokens`` is capped at what the context leaves after the prompt (the choice then
        finishes with ``"length"``).

        Raises:
            RequestError: empty prompt, token id out of range, prompt too long, duplicate id,
                ``stream_interval`` below 1, a ``logit_bias`` token id outside the vocabulary.
                ``params.structured`` that does not compile (:meth:`check_params`).
        """
        self.check_prompt(prompt_token_ids)
        grammar = self.check_params(params)
        if stream_interval is not None and stream_interval < 1:
            raise RequestError(f"stream_interval: must be >= 1 token, got {stream_interval}", param="stream_interval")
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use", param="request_id")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        max_tokens = min(params.max_tokens, self.max_model_len - len(prompt_token_ids))
        seqs = []
        for i in range(params.n):
            # choice i uses seed + i, wrapped into the signed 64-bit range the sampler's tensors hold
            seed = ((params.seed + i + 2**63) % 2**64) - 2**63 if params.seed is not None else self._rng.getrandbits(63)
            seqs.append(
                Sequence(
                    seq_id=f"{request_id}-{i}", request_id=request_id, index=i,
                    prompt_token_ids=list(prompt_token_ids), params=params, seed=seed,
                    max_tokens=max_tokens, arrival_time=arrival,
                    matcher=self.grammar_compiler.matcher(grammar) if grammar is not None else None,
                )
            )
        req = _Request(request_id, list(prompt_token_ids), params, seqs, on_output, final_only, stream_interval)
        with self._commands_lock:
            self._requests[request_id] = req
            self._commands.append(("add", req))

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output specs against this engine's tokenizer (built on first use)."""
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer.hf_tokenizer, self.config.vocab_size,
                                                     self.runner.eos_token_ids)
        return self._grammar_compiler

    def check_params(self, params: SamplingParams) -> str | None:
        """Check what only this engine can check of ``params`` (safe from any thread): its
        ``logit_bias`` token ids against the vocabulary, its structured-output spec by compiling it.
        Returns the compiled grammar (None without one).

        Raises:
            RequestError: naming the field (``logit_bias``, or the spec's ``param``), code
                ``invalid_value``.
        """
        bad = [t for t, _ in params.logit_bias if not 0 <= t < self.config.vocab_size]
        if bad:
            raise RequestError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})",
                               param="logit_bias", code="invalid_value")
        if params.structured is None:
            return None
        try:
            return self.grammar_compiler.compile(params.structured)
        except SamplingParamsError as exc:
            raise RequestError(str(exc), param=exc.param, code="invalid_value") from None

    def abort(self, request_id: str, reason: str = "cancelled") -> None:
        """Cancel a request (no-op when unknown or finished) at the next step: its unfinished
        choices finish with ``"abort"``, and the log says why (``reason``, e.g. "client
        disconnected"). Safe from any thread."""
        with self._commands_lock:
            self._commands.append(("abort", (request_id, reason)))

    def abort_all(self, reason: str) -> None:
        """Cancel, at the next step, every request submitted before this call, as :meth:`abort`
        does (at the drain deadline, so that streams end with ``"abort"``). Safe from any thread."""
        with self._commands_lock:
            self._commands.append(("abort_all", reason))

    @property
    def num_queued(self) -> int:
        """Requests and aborts queued for the next :meth:`step` (safe from any thread)."""
        return len(self._commands)

    def has_unfinished(self) -> bool:
        """Whether a request is queued, waiting or running (or a pipelined run is unprocessed)."""
        return bool(self._commands) or self.scheduler.has_unfinished() or self._pending is not None

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # -- stepping -----------------------------------------------------------------------------
    def _apply_commands(self, outputs: dict[str, RequestOutput]) -> None:
        with self._commands_lock:
            commands = list(self._commands)
            self._commands.clear()
        for kind, arg in commands:
            if kind == "add":
                req: _Request = arg  # type: ignore[assignment]
                if req.request_id not in self._requests:  # aborted before admission
                    continue
                for seq in req.seqs:
                    seq.detokenizer = new_detokenizer(self.tokenizer, seq)
                    self.scheduler.add(seq)
                if self.metrics is not None:
                    self.metrics.observe_admitted(len(req.prompt_token_ids) * len(req.seqs),
                                                  structured=req.params.structured is not None)
            elif kind == "abort":
                rid, reason = arg  # type: ignore[misc]
                req = self._requests.get(rid)
                if req is not None and any(not s.is_finished for s in req.seqs):
                    self._abort_request(req, reason, outputs)
            else:  # abort_all: the requests submitted before it (admitted, with a detokenizer, by now)
                for req in [r for r in self._requests.values() if r.seqs[0].detokenizer is not None]:
                    if any(not s.is_finished for s in req.seqs):
                        self._abort_request(req, arg, outputs)  # type: ignore[arg-type]

    def _abort_request(self, req: _Request, reason: str, outputs: dict[str, RequestOutput]) -> None:
        """Finish ``req``'s unfinished choices with ``"abort"`` (frees their KV blocks), log why."""
        live = [seq for seq in req.seqs if not seq.is_finished]
        self.scheduler.finish_all(live, FinishReason.ABORT)  # one pass, however many siblings
        log.info("request %s aborted (%s): %d of %d choices unfinished, %d output tokens",
                 req.request_id, reason, len(live), len(req.seqs), sum(s.num_output_tokens for s in req.seqs))
        for seq in live:
            self._record_finished(seq)
            self._delta(outputs, req, seq)
        self._finish_request(req, outputs)

    def step(self) -> list[RequestOutput]:
        """Run one batch; return an update for every request with new tokens or a new state.

        Multi-step decode runs are pipelined: their tokens are processed by the *next* call, after
        that call has launched the run's continuation on the device (when nothing else is waiting:
        no queued request or abort, no admission possible, every row still has tokens to go), so
        detokenization and stop checks on the host overlap the device's next steps. A row that
        turns out to have stopped gets its continued tokens discarded.
        """
        t0 = time.perf_counter()
        outputs: dict[str, RequestOutput] = {}
        pending, self._pending = self._pending, None
        launched = self._continue(pending) if pending is not None else None
        new_tokens = self._finish_run(pending, outputs) if pending is not None else 0
        if launched is None:
            self._apply_commands(outputs)
            sched = self.scheduler.schedule()
            self._note_admitted(sched.admitted)
            if not sched.is_empty:
                launched = self._launch(sched)
        if launched is not None and (launched.result.decode is not None or launched.resident is not None):
            self._pending = launched
        elif launched is not None:
            new_tokens += self._finish_run(launched, outputs)
        if self.metrics is not None:
            ran, steps = (launched.sched, launched.num_steps) if launched is not None else (None, 1)
            self.metrics.observe_step(seconds=time.perf_counter() - t0, sched=ran, scheduler=self.scheduler,
                                      new_tokens=new_tokens, num_steps=steps)
        return self._deliver(outputs)

    def flush(self) -> list[RequestOutput]:
        """Process a pipelined decode run still in flight, without continuing it (call before
        anything that must not overlap a forward pass, e.g. a graph recapture)."""
        if self._pending is None:
            return []
        outputs: dict[str, RequestOutput] = {}
        run, self._pending = self._pending, None
        new_tokens = self._finish_run(run, outputs)
        if self.metrics is not None:  # no forward pass here (num_steps=0): the run's was observed at launch
            self.metrics.observe_step(seconds=0.0, sched=None, scheduler=self.scheduler, new_tokens=new_tokens,
                                      num_steps=0)
        return self._deliver(outputs)

    def _deliver(self, outputs: dict[str, RequestOutput]) -> list[RequestOutput]:
        result = list(outputs.values())
        for out in result:
            req = self._requests.get(out.request_id)
            callback = req.on_output if req is not None else None
            if out.finished:
                self._requests.pop(out.request_id, None)
            if callback is not None:
                callback(out)
        return result

    def _launch(self, sched: SchedulerOutput) -> _Run:
        """Run a scheduled batch: verification steps on the device or one from the host where a row
        drafts (:class:`SpeculativeDecoder`), else multi-step as :func:`decode_steps` allows."""
        if self.metrics is not None and any(row.seq.matcher is not None for row in sched.scheduled if row.samples):
            self.metrics.observe_structured_step()
        num_steps = decode_steps(sched.scheduled, self.limits.num_scheduler_steps,
                                 admission_pending=self._admission_pending())
        if self.spec is not None:
            if num_steps > 1 and (run := self.spec.launch_resident(sched, self.runner, self.scheduler, num_steps)):
                return _Run(sched, RunOutput(run.rows, []), run.num_steps, resident=run)
            if (verified := self.spec.launch(sched, self.runner, self.scheduler)) is not None:
                return _Run(sched, verified.result, 1, verified.num_emitted)
        if num_steps > 1 and not self.scheduler.reserve_decode_steps(sched, num_steps):
            num_steps = 1
        result = self.runner.run(sched, num_steps)
        self.scheduler.commit(sched, num_steps)
        return _Run(sched, result, num_steps)

    def _continue(self, pending: _Run) -> _Run | None:
        """Launch more decode steps of ``pending``'s batch before its tokens are processed, or None.

        Only when nothing could change the batch: no queued command, no admission possible, every row
        still running with a token to go after ``pending``'s, the device state still valid, KV slots
        reserved for the new steps. A resident verification run continues as
        :meth:`SpeculativeDecoder.continue_resident` decides; a plain run under speculative decoding
        while verifying it does not pay (:meth:`SpeculativeDecoder.may_continue_plain`)."""
        if self._commands or self._admission_pending():
            return None
        rows = pending.result.rows
        if any(row.seq.status is not SequenceStatus.RUNNING for row in rows if not row.seq.is_finished):
            return None
        if pending.resident is not None:
            run = self.spec.continue_resident(pending.resident, self.runner, self.scheduler, self.limits.num_scheduler_steps)
            return _Run(pending.sched, RunOutput(run.rows, []), run.num_steps, resident=run) if run else None
        decode = pending.result.decode
        if decode is None or not self.runner.can_continue(decode):
            return None
        max_steps = self.limits.num_scheduler_steps
        if self.spec is not None and not self.spec.may_continue_plain(rows, pending.num_steps):
            return None  # verifying pays now: the next launch verifies
        # tokens each row has left after pending's; rows with none are retired into padding
        remaining = [row.seq.max_tokens - row.seq.num_output_tokens - pending.num_steps
                     if not row.seq.is_finished else 0 for row in rows]
        live = [r > 0 for r in remaining]
        if not any(live):
            return None
        num_steps = min(max_steps, min(r for r in remaining if r > 0))
        sched = SchedulerOutput(scheduled=[ScheduledSequence(row.seq, row.seq.num_computed_tokens, 1, True)
                                           for row, keep in zip(rows, live) if keep])
        if not self.scheduler.reserve_decode_steps(sched, num_steps):
            return None
        retire = [i for i, keep in enumerate(live) if not keep and i not in decode.retired]
        with self.spec.timing_decode(len(rows), num_steps, self.runner.device) if self.spec else nullcontext():
            sampled = self.runner.continue_decode(decode, num_steps, retire)  # timed: queued while the device is busy
        self.scheduler.commit(sched, num_steps)
        return _Run(sched, RunOutput(rows, sampled, decode), num_steps)

    def _admission_pending(self) -> bool:
        """A request is waiting and a batch slot is free (multi-step runs would delay it)."""
        return self.scheduler.num_waiting > 0 and self.scheduler.num_running < self.limits.max_num_seqs

    def _finish_run(self, run: _Run, outputs: dict[str, RequestOutput]) -> int:
        """Wait for a run's tokens and process them, after its prompt log-probabilities and its
        ``max_tokens`` 0 sequences, which finish once prefilled; returns how many tokens were kept."""
        if run.result.prompt_logprobs is not None:
            store_prompt_logprobs(run.result.prompt_logprobs)
        for seq in prefilled_without_output(run.sched.scheduled):
            req = self._requests[seq.request_id]
            self.scheduler.finish(seq, FinishReason.LENGTH)
            self._record_finished(seq)
            self._delta(outputs, req, seq)
            self._finish_request(req, outputs)
        if run.resident is not None:
            run.num_emitted = self.spec.settle(run.resident, self.scheduler)
        return self._process_samples(run.result.rows, run.host, outputs, run.num_emitted)

    def fail_all(self, error: BaseException, what: str = "engine step failed") -> list[RequestOutput]:
        """Abort every request (after a failed step, or at shutdown); their outputs carry
        ``"{what}: {type}: {error}"`` as the error message."""
        outputs: dict[str, RequestOutput] = {}
        self._pending = None
        with self._commands_lock:
            self._commands.clear()
        requests = list(self._requests.values())
        live = [seq for req in requests for seq in req.seqs if not seq.is_finished]
        unfinished = set(live)
        if requests:
            log.warning("%d requests aborted (%s: %s: %s)", len(requests), what, type(error).__name__, error)
        self.scheduler.finish_all(live, FinishReason.ABORT)  # one pass over the queues
        if self.metrics is not None:
            for _ in live:
                self.metrics.observe_failed()
        for req in requests:
            for seq in req.seqs:
                if seq in unfinished:  # choices finished earlier were reported with their own reason
                    self._delta(outputs, req, seq)
            outputs.setdefault(req.request_id, RequestOutput(req.request_id, [], False, len(req.prompt_token_ids)))
            self._finish_request(req, outputs)
            outputs[req.request_id].error = f"{what}: {type(error).__name__}: {error}"
        result = list(outputs.values())
        for out in result:
            req = self._requests.pop(out.request_id, None)
            if req is not None and req.on_output is not None:
                req.on_output(out)
        return result

    def _process_samples(self, rows, host: HostSamples | None, outputs: dict[str, RequestOutput],
                         num_emitted: list[int] | None = None) -> int:
        """Append each step's sampled tokens to their sequences, in step order, checking stops.

        ``host`` holds the run's tokens of every step (several under multi-step decoding), staged
        to host memory when the run was launched (waits for that run only); the tokens of a
        sequence after the step that finished it are discarded. A streamed choice with a stream
        interval gets a delta at each of the run's cuts (:func:`~.output.stream_cuts`), the others
        one delta for the run; row ``i`` of a verification has ``num_emitted[i]`` tokens. Returns
        how many tokens were kept.
        """
        if host is None:
            return 0
        samples = host.lists()
        times = TokenTimes(time.monotonic(), self.metrics)
        count = 0
        for i, row in enumerate(rows):
            seq = row.seq
            req = self._requests.get(seq.request_id)
            if seq.is_finished or req is None:  # stopped or aborted while the run was in flight
                continue
            streamed = not req.final_only and req.stream_interval is not None
            num_steps = num_emitted[i] if num_emitted is not None else len(samples[0])
            cuts = stream_cuts(seq.num_output_tokens, num_steps, req.stream_interval) if streamed else []
            ends = cuts if cuts and cuts[-1] == num_steps else [*cuts, num_steps]
            start, kept = 0, 0
            for end in ends:
                more, finish = self._append(seq, i, samples, start, end)
                kept, start = kept + more, end
                if finish is not None:
                    self.scheduler.finish(seq, finish.reason, stop_reason=finish.stop_reason)
                if seq.is_finished or (streamed and end in cuts) or not (streamed or req.final_only):
                    self._delta(outputs, req, seq)
                if seq.is_finished:
                    break
            count += kept
            if kept:
                times.note(seq, kept)
            if seq.is_finished:
                self._record_finished(seq)
                self._finish_request(req, outputs)
        times.record()
        return count

    def _append(self, seq: Sequence, row: int, samples, start: int, end: int) -> tuple[int, Finish | None]:
        """Append row ``row``'s tokens of steps ``start`` .. ``end`` (of ``samples``, the host lists
        [steps][rows] of :meth:`HostSamples.lists`) to ``seq``: one detokenizer call for them all
        without stop strings or log-probabilities, token by token otherwise."""
        token_ids, logprobs, top_ids, top_lps = samples
        if not seq.params.stop and seq.params.logprobs is None:
            kept, finish = append_tokens(seq, [step_ids[row] for step_ids in token_ids[start:end]], self.eos_token_ids)
        else:
            steps = slice(start, end)
            kept, finish = append_steps(seq, row, token_ids[steps], None if logprobs is None else logprobs[steps],
                                        None if top_ids is None else top_ids[steps],
                                        None if top_lps is None else top_lps[steps], self.eos_token_ids)
        if seq.matcher is not None and kept:
            finish = advance_grammar(seq, seq.output_token_ids[-kept:], finish)
        return kept, finish

    def _note_admitted(self, admitted: list[Sequence]) -> None:
        """Stamp the sequences admitted into the running batch for the first time (queue time)."""
        now, first = time.monotonic(), [seq for seq in admitted if seq.first_scheduled_time is None]
        for seq in first:
            seq.first_scheduled_time = now
        if self.metrics is not None and first:
            self.metrics.observe_queue_times([now - seq.arrival_time for seq in first])

    # -- request bookkeeping ------------------------------------------------------------------
    def _delta(self, outputs: dict[str, RequestOutput], req: _Request, seq: Sequence) -> None:
        """Add what ``seq`` produced since its last delta to its request's update of this step."""
        out = outputs.get(req.request_id)
        if out is None:
            out = outputs[req.request_id] = RequestOutput(req.request_id, [], False, len(req.prompt_token_ids))
        out.prompt_logprobs = out.prompt_logprobs or take_prompt_logprobs(req.seqs[0])
        add_delta(out, take_delta(seq), None if req.final_only else req.stream_interval)

    def _finish_request(self, req: _Request, outputs: dict[str, RequestOutput]) -> None:
        update_progress(outputs[req.request_id], req.seqs)

    def _record_finished(self, seq: Sequence) -> None:
        if self.metrics is not None:
            self.metrics.observe_finished(
                finish_reason=seq.finish_reason.value, arrival=seq.arrival_time, first_token=seq.first_token_time,
                finish=seq.finish_time or time.monotonic(), num_output_tokens=seq.num_output_tokens,
            )

    # -- convenience --------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[CompletedChoice]]:
        """Run ``prompts`` (token ids) to completion together; return each one's choices (tests, benchmarks)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        results: dict[str, dict[int, CompletedChoice]] = {}
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            rid = f"generate-{id(self)}-{time.monotonic_ns()}-{i}"
            ids.append(rid)
            results[rid] = {j: CompletedChoice(j) for j in range(p.n)}
            self.add_request(rid, prompt, p)
        while self.has_unfinished():
            for out in self.step():
                if out.error:
                    raise EngineDeadError(out.error)
                for delta in out.choices:
                    results[out.request_id][delta.index].add(delta)
                for choice in results[out.request_id].values() if out.prompt_logprobs else ():
                    choice.prompt_logprobs = out.prompt_logprobs
        return [[results[rid][j] for j in sorted(results[rid])] for rid in ids]
