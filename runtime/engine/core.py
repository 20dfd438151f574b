"""The serving engine: requests in, token and text deltas out, one scheduler step at a time.

:class:`LLMEngine` is synchronous and single-threaded: ``add_request``/``abort`` only queue
commands (safe from any thread), ``step`` runs one batch (schedule -> prepare inputs -> execute
model -> sample -> detokenize and check stops). :class:`AsyncLLMEngine` runs ``step`` in a
background thread and hands each request's outputs to an asyncio queue, so the HTTP server streams
them; a cancelled consumer (client disconnect) aborts its request.

KV-cache size: ``EngineLimits.num_kv_blocks`` when given; otherwise 512 blocks on CPU, and on CUDA
``free device memory x kv_cache_memory_fraction / bytes per block``. ``max_model_len`` is the
model's context (or ``EngineLimits.max_model_len``), capped at what the KV cache holds, so every
admitted request fits on its own and preemption always makes progress.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from graphserving.contract.worker_config import EngineLimits
from .block_manager import BlockManager
from .metrics import EngineMetrics
from .model_runner import HostSamples, ModelRunner, RunOutput, stage_to_host
from .scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from .sequence import (
    FinishReason,
    SamplingParams,
    Sequence,
    SequenceStatus,
    TokenLogprob,
)

log = logging.getLogger(__name__)

CPU_DEFAULT_NUM_KV_BLOCKS = 512


class RequestError(ValueError):
    """A request the engine cannot serve; ``param`` names the offending field, ``code`` classifies it."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class EngineDeadError(RuntimeError):
    """The engine's step loop failed; the request could not complete."""


@dataclass
class ChoiceDelta:
    """What one choice produced since the previous output of its request.

    Attributes:
        index: the choice index.
        text: new text (stop strings cut off; text that might still become a stop string is held
            back until it cannot).
        token_ids: new token ids.
        logprobs: one entry per new token when the request asked for log-probabilities.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` once finished, else None.
        stop_reason: the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    """An update for one request: the choices with something new, and whether all have finished."""

    request_id: str
    choices: list[ChoiceDelta]
    finished: bool
    num_prompt_tokens: int
    num_output_tokens: int = 0
    error: str | None = None


@dataclass
class CompletedChoice:
    """A finished choice, accumulated from its deltas (what :meth:`LLMEngine.generate` returns)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs:
            self.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


@dataclass
class _Run:
    """A batch launched on the device: its schedule, what the model runner returned, its steps."""

    sched: SchedulerOutput
    result: RunOutput
    num_steps: int
    host: HostSamples | None = field(init=False)

    def __post_init__(self) -> None:
        # Staged now, right after the run's last step and before the next run is queued.
        self.host = stage_to_host(self.result.sampled)


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    on_output: Callable[[RequestOutput], None] | None = None
    final_only: bool = False


def kv_blocks_for_memory(free_bytes: int, fraction: float, bytes_per_block: int) -> int:
    """KV blocks that fit in ``fraction`` of ``free_bytes`` (floor), the null block included."""
    return int(free_bytes * fraction) // bytes_per_block


def resolve_num_kv_blocks(limits: EngineLimits, device: torch.device, bytes_per_block: int) -> int:
    """The KV-cache size in blocks (see the module docstring).

    Raises:
        RuntimeError: the device memory holds fewer than 2 blocks.
    """
    if limits.num_kv_blocks is not None:
        return limits.num_kv_blocks
    if device.type != "cuda":
        return CPU_DEFAULT_NUM_KV_BLOCKS
    free, _total = torch.cuda.mem_get_info(device)
    blocks = kv_blocks_for_memory(free, limits.kv_cache_memory_fraction, bytes_per_block)
    if blocks < 2:
        raise RuntimeError(
            f"only {free} bytes of device memory are free: not enough for 2 KV blocks of {bytes_per_block} bytes"
        )
    return blocks


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
        kv_caches: pre-allocated KV caches (with ``num_kv_blocks``), or None to allocate.
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
    ):
        from ..model.kv_cache import allocate_kv_cache, kv_cache_bytes_per_block

        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.limits = limits = limits or EngineLimits()
        self.device = torch.device(device)
        self.dtype = dtype
        self.metrics = metrics
        bytes_per_block = kv_cache_bytes_per_block(config, limits.block_size, dtype)
        self.num_kv_blocks = resolve_num_kv_blocks(limits, self.device, bytes_per_block)
        self.kv_caches = allocate_kv_cache(config, self.num_kv_blocks, limits.block_size, dtype, self.device)
        self.block_manager = BlockManager(self.num_kv_blocks, limits.block_size)
        model_len = limits.max_model_len or config.max_model_len
        self.max_model_len = min(model_len, self.block_manager.capacity_tokens)
        if self.max_model_len < model_len:
            log.warning(
                "max_model_len lowered from %d to %d tokens: the KV cache holds %d blocks of %d tokens",
                model_len, self.max_model_len, self.block_manager.num_total_blocks, limits.block_size,
            )
        self.scheduler = Scheduler(self.block_manager, limits.max_num_seqs, limits.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.kv_caches, self.block_manager, config.vocab_size, self.device)
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(config.eos_token_ids)
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
    ) -> None:
        """Queue a request; it is admitted at the next :meth:`step`. Safe from any thread.

        With ``final_only`` (a non-streaming client) a choice is reported once, when it finishes,
        with all its text and tokens in one delta, instead of after every step.

        ``params.max_tokens`` is capped at what the context leaves after the prompt (the choice then
        finishes with ``"length"``).

        Raises:
            RequestError: empty prompt, token id out of range, prompt too long, duplicate id.
        """
        self.check_prompt(prompt_token_ids)
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
                )
            )
        req = _Request(request_id, list(prompt_token_ids), params, seqs, on_output, final_only)
        with self._commands_lock:
            self._requests[request_id] = req
            self._commands.append(("add", req))

    def abort(self, request_id: str) -> None:
        """Cancel a request (no-op when unknown or finished). Safe from any thread."""
        with self._commands_lock:
            self._commands.append(("abort", request_id))

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
                    seq.detokenizer = self._new_detokenizer(seq)
                    self.scheduler.add(seq)
                if self.metrics is not None:
                    self.metrics.observe_admitted(len(req.prompt_token_ids) * len(req.seqs))
            else:
                rid: str = arg  # type: ignore[assignment]
                req = self._requests.get(rid)
                if req is None:
                    continue
                for seq in req.seqs:
                    if not seq.is_finished:
                        self.scheduler.finish(seq, FinishReason.ABORT)
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
            if not sched.is_empty:
                launched = self._launch(sched)
        if launched is not None and launched.result.decode is not None:
            self._pending = launched
        elif launched is not None:
            new_tokens += self._finish_run(launched, outputs)
        if self.metrics is not None:
            sched = launched.sched if launched is not None else None
            self.metrics.observe_step(
                seconds=time.perf_counter() - t0, num_reqs=len(sched.scheduled) if sched else 0,
                num_tokens=sched.num_batched_tokens if sched else 0,
                running=self.scheduler.num_running, waiting=self.scheduler.num_waiting,
                kv_used=self.block_manager.num_used_blocks, kv_total=self.block_manager.num_total_blocks,
                new_tokens=new_tokens, preemptions=len(sched.preempted) if sched else 0,
                num_steps=launched.num_steps if launched is not None else 1,
            )
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
            self.metrics.observe_step(
                seconds=0.0, num_reqs=0, num_tokens=0, running=self.scheduler.num_running,
                waiting=self.scheduler.num_waiting, kv_used=self.block_manager.num_used_blocks,
                kv_total=self.block_manager.num_total_blocks, new_tokens=new_tokens, preemptions=0, num_steps=0,
            )
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
        """Run a scheduled batch on the device (multi-step when :func:`decode_steps` allows it)."""
        num_steps = decode_steps(
            sched.scheduled, self.limits.num_scheduler_steps,
            admission_pending=self._admission_pending(),
        )
        if num_steps > 1 and not self.scheduler.reserve_decode_steps(sched, num_steps):
            num_steps = 1
        result = self.runner.run(sched, num_steps)
        self.scheduler.commit(sched, num_steps)
        return _Run(sched, result, num_steps)

    def _continue(self, pending: _Run) -> _Run | None:
        """Launch more decode steps of ``pending``'s batch before its tokens are processed, or None.

        Only when nothing could change the batch: no queued command, no admission possible, every
        row still running with at least one token to go after ``pending``'s, the device state still
        valid, and KV slots reserved for the new steps.
        """
        decode = pending.result.decode
        if decode is None or self._commands or not self.runner.can_continue(decode):
            return None
        if self._admission_pending():
            return None
        rows = pending.result.rows
        if any(row.seq.status is not SequenceStatus.RUNNING for row in rows if not row.seq.is_finished):
            return None
        # tokens each row has left after pending's; rows with none are retired into padding
        remaining = [row.seq.max_tokens - row.seq.num_output_tokens - pending.num_steps
                     if not row.seq.is_finished else 0 for row in rows]
        live = [r > 0 for r in remaining]
        if not any(live):
            return None
        num_steps = min(self.limits.num_scheduler_steps, min(r for r in remaining if r > 0))
        sched = SchedulerOutput(scheduled=[ScheduledSequence(row.seq, row.seq.num_computed_tokens, 1, True)
                                           for row, keep in zip(rows, live) if keep])
        if not self.scheduler.reserve_decode_steps(sched, num_steps):
            return None
        retire = [i for i, keep in enumerate(live) if not keep and i not in decode.retired]
        sampled = self.runner.continue_decode(decode, num_steps, retire)
        self.scheduler.commit(sched, num_steps)
        return _Run(sched, RunOutput(rows, sampled, decode), num_steps)

    def _admission_pending(self) -> bool:
        """A request is waiting and a batch slot is free (multi-step runs would delay it)."""
        return self.scheduler.num_waiting > 0 and self.scheduler.num_running < self.limits.max_num_seqs

    def _finish_run(self, run: _Run, outputs: dict[str, RequestOutput]) -> int:
        """Wait for a run's tokens and process them; returns how many were kept."""
        return self._process_samples(run.result.rows, run.host, outputs)

    def fail_all(self, error: BaseException, what: str = "engine step failed") -> list[RequestOutput]:
        """Abort every request (after a failed step, or at shutdown); their outputs carry
        ``"{what}: {type}: {error}"`` as the error message."""
        outputs: dict[str, RequestOutput] = {}
        self._pending = None
        with self._commands_lock:
            self._commands.clear()
        for req in list(self._requests.values()):
            for seq in req.seqs:
                if not seq.is_finished:
                    if seq in self.scheduler.running or seq in self.scheduler.waiting:
                        self.scheduler.finish(seq, FinishReason.ABORT)
                    else:
                        seq.finish(FinishReason.ABORT)
                    if self.metrics is not None:
                        self.metrics.observe_failed()
                self._delta(outputs, req, seq)
            self._finish_request(req, outputs)
            outputs[req.request_id].error = f"{what}: {type(error).__name__}: {error}"
        result = list(outputs.values())
        for out in result:
            req = self._requests.pop(out.request_id, None)
            if req is not None and req.on_output is not None:
                req.on_output(out)
        return result

    def _process_samples(self, rows, host: HostSamples | None, outputs: dict[str, RequestOutput]) -> int:
        """Append each step's sampled tokens to their sequences, in step order, checking stops.

        ``host`` holds the run's tokens of every step (several under multi-step decoding), staged
        to host memory when the run was launched (waits for that run only); the tokens of a
        sequence after the step that finished it are discarded.
        """
        if host is None:
            return 0
        token_ids, logprobs, top_ids, top_lps = host.lists()
        now = time.monotonic()
        count = 0
        for i, row in enumerate(rows):
            seq = row.seq
            req = self._requests.get(seq.request_id)
            if seq.is_finished or req is None:  # stopped or aborted while the run was in flight
                continue
            if not seq.params.stop and seq.params.logprobs is None:
                count += self._append_tokens(seq, [step_ids[i] for step_ids in token_ids], now)
                if seq.is_finished or not req.final_only:
                    self._delta(outputs, req, seq)
                if seq.is_finished:
                    self._record_finished(seq)
                    self._finish_request(req, outputs)
                continue
            for step in range(len(token_ids)):
                if seq.is_finished:  # stopped at an earlier step
                    break
                token = token_ids[step][i]
                seq.output_token_ids.append(token)
                count += 1
                self._note_first_token(seq, now)
                if seq.params.logprobs is not None and logprobs is not None:
                    k = seq.params.logprobs
                    top = list(zip(top_ids[step][i][:k], top_lps[step][i][:k])) if k and top_ids is not None else []
                    seq.output_logprobs.append(TokenLogprob(token, logprobs[step][i], top))
                self._check_stop(seq, token)
            if seq.is_finished or not req.final_only:
                self._delta(outputs, req, seq)
            if seq.is_finished:
                self._record_finished(seq)
                self._finish_request(req, outputs)
        return count

    # -- detokenization and stop conditions ---------------------------------------------------
    def _append_tokens(self, seq: Sequence, tokens: list[int], now: float) -> int:
        """Append a run of sampled tokens to a sequence without stop strings or log-probabilities.

        The same result as :meth:`_check_stop` token by token (tokens after a stop token, an EOS
        or ``max_tokens`` are dropped), with one detokenizer call for the whole run instead of one
        per token. Returns the number of tokens kept.
        """
        params = seq.params
        keep, reason, stop_reason = len(tokens), None, None
        for j, token in enumerate(tokens):
            if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
                keep, reason = j + 1, FinishReason.STOP
                stop_reason = token if token in params.stop_token_ids else None
                break
            if seq.num_output_tokens + j + 1 >= seq.max_tokens:
                keep, reason = j + 1, FinishReason.LENGTH
                break
        kept = tokens[:keep]
        if not kept:
            return 0
        seq.output_token_ids.extend(kept)
        self._note_first_token(seq, now)
        text_ids = kept[:-1] if reason is FinishReason.STOP else kept  # a stop token adds no text
        if text_ids:
            seq.output_text += seq.detokenizer.feed(text_ids)
        if reason is not None:
            seq.output_text += seq.detokenizer.flush()
            self.scheduler.finish(seq, reason, stop_reason=stop_reason)
        return keep

    def _note_first_token(self, seq: Sequence, now: float) -> None:
        """Record the time of a sequence's first output token (and its TTFT metric), once."""
        if seq.first_token_time is None:
            seq.first_token_time = now
            if self.metrics is not None:
                self.metrics.observe_first_token(now - seq.arrival_time)

    def _new_detokenizer(self, seq: Sequence):
        from ..model.tokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        """Append ``token``'s text to the sequence and finish it when a stop condition holds.

        Order: EOS (unless ``ignore_eos``), stop token ids, stop strings (the text is cut before
        the stop string), then ``max_tokens``.
        """
        params = seq.params
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            seq.output_text += seq.detokenizer.flush()
            stop_reason = token if token in params.stop_token_ids else None
            self.scheduler.finish(seq, FinishReason.STOP, stop_reason=stop_reason)
            return
        before = len(seq.output_text)
        seq.output_text += seq.detokenizer.feed(token)
        if params.stop:
            hit = find_stop_string(seq.output_text, params.stop, before)
            if hit is not None:
                idx, stop = hit
                seq.output_text = seq.output_text[:idx]
                self.scheduler.finish(seq, FinishReason.STOP, stop_reason=stop)
                return
        if seq.num_output_tokens >= seq.max_tokens:
            seq.output_text += seq.detokenizer.flush()
            self.scheduler.finish(seq, FinishReason.LENGTH)

    def _delta(self, outputs: dict[str, RequestOutput], req: _Request, seq: Sequence) -> None:
        out = outputs.get(req.request_id)
        if out is None:
            out = outputs[req.request_id] = RequestOutput(
                req.request_id, [], False, len(req.prompt_token_ids)
            )
        sent_text, sent_tokens = seq.num_sent_chars, seq.num_sent_tokens
        if seq.is_finished:
            visible = len(seq.output_text)
        else:
            visible = len(seq.output_text) - holdback(seq.params.stop)
        visible = max(visible, sent_text)
        delta = ChoiceDelta(
            index=seq.index,
            text=seq.output_text[sent_text:visible],
            token_ids=seq.output_token_ids[sent_tokens:],
            logprobs=seq.output_logprobs[sent_tokens:] if seq.params.logprobs is not None else None,
            finish_reason=seq.finish_reason.value if seq.finish_reason is not None else None,
            stop_reason=seq.stop_reason,
        )
        seq.num_sent_chars = visible
        seq.num_sent_tokens = seq.num_output_tokens
        # A step may update a choice twice (a pipelined run's tokens, then the step's own batch or
        # an abort): the earlier delta is already marked sent, so it must be kept, not replaced.
        earlier = next((c for c in out.choices if c.index == seq.index), None)
        if earlier is not None:
            delta.text = earlier.text + delta.text
            delta.token_ids = earlier.token_ids + delta.token_ids
            if delta.logprobs is not None:
                delta.logprobs = (earlier.logprobs or []) + delta.logprobs
        out.choices = [c for c in out.choices if c.index != seq.index] + [delta]

    def _finish_request(self, req: _Request, outputs: dict[str, RequestOutput]) -> None:
        out = outputs[req.request_id]
        out.num_output_tokens = sum(s.num_output_tokens for s in req.seqs)
        out.finished = all(s.is_finished for s in req.seqs)

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
        return [[results[rid][j] for j in sorted(results[rid])] for rid in ids]


def decode_steps(rows: list[ScheduledSequence], max_steps: int, *, admission_pending: bool) -> int:
    """How many decode steps to run for one schedule (multi-step decoding; pure).

    More than one only when every row is a decode that samples and needs no penalties (their token
    counts would change between the steps) and no waiting request could be admitted (it would
    wait for the whole run). Never more than any row's remaining ``max_tokens``, so a length limit
    wastes no step; a stop token or string may still end a row early, and the rest of its steps
    are discarded.

    Args:
        rows: the scheduled batch.
        max_steps: ``EngineLimits.num_scheduler_steps``.
        admission_pending: a request is waiting and a batch slot is free.

    Returns:
        1 .. ``max_steps``.
    """
    if max_steps <= 1 or admission_pending or not rows:
        return 1
    if any(r.num_new_tokens != 1 or not r.samples or r.seq.params.needs_penalties for r in rows):
        return 1
    return max(1, min(max_steps, min(r.seq.max_tokens - r.seq.num_output_tokens for r in rows)))


def holdback(stops: tuple[str, ...]) -> int:
    """Characters withheld from a stream: a stop string may still complete within them."""
    return max((len(s) for s in stops), default=1) - 1


def find_stop_string(text: str, stops: tuple[str, ...], new_from: int) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends after ``new_from`` (its start index and itself)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, new_from - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


ADMISSION_GAP_S = 0.001
"""Burst coalescing: an idle engine that receives a request waits while more keep arriving less
than this far apart (seconds)..."""
ADMISSION_WINDOW_S = 0.005
"""...but never longer than this in all (seconds) before its first step."""


def burst_settled(queued_before: int, queued_now: int, now: float, deadline: float) -> bool:
    """Whether an idle engine stops waiting for more of a burst and steps (pure).

    Args:
        queued_before / queued_now: queued requests one gap ago and now.
        now / deadline: the time and the end of the coalescing window (same clock, seconds).

    Returns:
        True when nothing arrived during the last gap or the window is over.
    """
    return queued_now == queued_before or now >= deadline


class AsyncLLMEngine:
    """Runs an :class:`LLMEngine`'s step loop in a background thread for asyncio consumers.

    Outputs reach the event loop in one batch per engine step: the loop thread collects the
    step's updates and hands them over with one ``loop.call_soon_threadsafe`` (each call writes to
    the event loop's wake-up pipe, and a step updates up to ``max_num_seqs`` requests), where each
    request's callback runs in arrival order (:meth:`submit`). :meth:`generate` feeds an
    ``asyncio.Queue`` that way; if its consumer stops early (cancelled, client disconnected), the
    request is aborted and its KV blocks freed at the next step.

    Burst coalescing: requests reach the loop one by one, as the HTTP server parses them (tens to
    hundreds of microseconds apart), whereas :meth:`LLMEngine.generate` queues a whole batch before
    the first step. An idle loop woken by a request therefore waits, before its first step, while
    requests keep arriving at most ``admission_gap_s`` apart, for ``admission_window_s`` at most,
    so that a burst is admitted in one prefill instead of several small ones (each later wave
    would also finish later, leaving a tail of small decode batches). A lone request waits one gap
    (1 ms by default: above the server's CPU per request, a few hundred microseconds); a busy loop
    never waits (continuous batching admits arrivals at the next step). ``admission_gap_s=0``
    disables it.
    """

    def __init__(self, engine: LLMEngine, *, admission_gap_s: float = ADMISSION_GAP_S,
                 admission_window_s: float = ADMISSION_WINDOW_S):
        self.engine = engine
        self.admission_gap_s = admission_gap_s
        self.admission_window_s = admission_window_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dead_error: str | None = None  # why the loop died of its own error (None: it did not)
        self._calls: deque[tuple[Callable[[], object], concurrent.futures.Future]] = deque()
        self._calls_lock = threading.Lock()
        # held by submit around its check and its add, and by the loop's exit around setting _stop:
        # a request is either added before the exit fails what is left, or refused
        self._admit_lock = threading.Lock()
        # (event loop, request id, callback, output) of the current step, handed over by _flush
        self._outbox: list[tuple[asyncio.AbstractEventLoop, str, Callable[[RequestOutput], None], RequestOutput]] = []
        self._outbox_lock = threading.Lock()

    def call_in_loop(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run ``fn`` on the loop thread between two steps (e.g. a graph recapture, which must
        not overlap a forward pass); its result or exception lands in the returned future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.is_running:
            try:
                self.engine.flush()  # nothing may overlap a pipelined run in flight
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
            self._flush()
            return future
        with self._calls_lock:
            self._calls.append((fn, future))
        self._wake.set()
        return future

    def _run_calls(self) -> None:
        while True:
            with self._calls_lock:
                if not self._calls:
                    return
                fn, future = self._calls.popleft()
            # a call (e.g. a recapture) must not overlap a pipelined run in flight; flushing per
            # call, after taking it, leaves no window for a call that arrives meanwhile
            self.engine.flush()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop after its current step and wait up to ``timeout`` seconds for it. A loop
        still inside a step after that keeps counting as running (:attr:`is_running`), so that
        :meth:`call_in_loop` queues behind the step (and fails at the loop's exit) instead of
        running at the same time as it."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - the loop's own bug: logged, then the cleanup below
            self.dead_error = f"{type(exc).__name__}: {exc}"
            log.exception("the engine loop died")
        finally:  # at shutdown nobody steps the requests left: their consumers get an error update
            with self._admit_lock:  # also when _serve died: later submits are refused, not stranded
                self._stop.set()
            if self.engine.has_unfinished():
                error = RuntimeError(self.dead_error or "the engine loop stopped")
                self.engine.fail_all(error, what="engine shut down")
                self._flush()
            # calls queued during the last step would never run: their callers get the error instead
            with self._calls_lock:
                calls = list(self._calls)
                self._calls.clear()
            for _, future in calls:
                if future.set_running_or_notify_cancel():
                    future.set_exception(EngineDeadError("engine shut down: the call was not run"))

    def _serve(self) -> None:
        idle = True
        while not self._stop.is_set():
            self._run_calls()
            self._flush()
            if not self.engine.has_unfinished():
                idle = True
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            if idle:
                idle = False
                self._coalesce_burst()
            try:
                self.engine.step()
            except Exception as exc:  # noqa: BLE001 - a failed step must not kill the server
                log.exception("engine step failed; aborting the requests in flight")
                self.engine.fail_all(exc)
            self._flush()

    def _coalesce_burst(self) -> None:
        """Wait while a burst of requests is still arriving (class docstring; sleeping releases
        the GIL, so the server's event loop parses the next requests meanwhile)."""
        if self.admission_gap_s <= 0:
            return
        deadline = time.monotonic() + self.admission_window_s
        queued = self.engine.num_queued
        while not self._stop.is_set():
            time.sleep(min(self.admission_gap_s, max(deadline - time.monotonic(), 0.0)))
            now_queued = self.engine.num_queued
            if burst_settled(queued, now_queued, time.monotonic(), deadline):
                return
            queued = now_queued

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None], *, final_only: bool = False) -> None:
        """Queue a request; ``on_output`` runs on the calling event loop for each of its updates
        (with ``final_only``, once per choice, when it finishes: see :meth:`LLMEngine.add_request`),
        delivered in one batch per engine step. The last update has ``finished`` or ``error`` set.
        Call :meth:`abort` if the outputs are no longer wanted. Must run on an event loop.

        Raises:
            RequestError: the request is invalid (nothing was queued).
            EngineDeadError: the loop has been shut down (nothing was queued; no step would run it).
        """
        loop = asyncio.get_running_loop()
        outbox, lock = self._outbox, self._outbox_lock

        def post(out: RequestOutput) -> None:  # engine thread
            with lock:
                outbox.append((loop, request_id, on_output, out))

        with self._admit_lock:
            if self._stop.is_set():
                raise EngineDeadError("engine shut down: the request was not queued")
            self.engine.add_request(request_id, prompt_token_ids, params, on_output=post, final_only=final_only)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Cancel a submitted request (no-op when finished); its KV blocks are freed at the next step."""
        self.engine.abort(request_id)
        self._wake.set()

    def _flush(self) -> None:
        """Hand the updates of the last step to their event loops, one call per loop."""
        with self._outbox_lock:
            if not self._outbox:
                return
            items = self._outbox.copy()
            self._outbox.clear()  # the same list: submit's callbacks hold it
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, request_id, callback, out in items:
            by_loop.setdefault(loop, []).append((request_id, callback, out))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_dispatch_outputs, batch)
            except RuntimeError:  # the consumer's event loop is closed: nobody is listening
                for request_id, _, out in batch:
                    if not out.finished:
                        self.engine.abort(request_id)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, final_only: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its updates until it finishes (with ``final_only``, one update
        per choice, when it finishes: see :meth:`LLMEngine.add_request`).

        Raises:
            RequestError: the request is invalid (raised before anything is yielded).
            EngineDeadError: the engine failed while running it, or was shut down.
        """
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.submit(request_id, prompt_token_ids, params, queue.put_nowait, final_only=final_only)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if out.error:
                    finished = True
                    raise EngineDeadError(out.error)
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)


def _dispatch_outputs(batch: list[tuple[str, Callable[[RequestOutput], None], RequestOutput]]) -> None:
    """Run each update's callback, in order (on the event loop; one call per engine step)."""
    for _, callback, out in batch:
        try:
            callback(out)
        except Exception:  # noqa: BLE001 - one consumer's bug must not starve the others of updates
            log.exception("output callback of request %s failed", out.request_id)
