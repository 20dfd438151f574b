"""The engine's step loop in a background thread, for asyncio consumers (the HTTP server).

:class:`AsyncLLMEngine` runs :meth:`LLMEngine.step` on its own thread and hands each request's
outputs to the event loop that submitted it, in one batch per step; a cancelled consumer (client
disconnect) aborts its request. :meth:`AsyncLLMEngine.call_in_loop` runs work between two steps
(a graph recapture must not overlap a forward pass). At shutdown, or when the loop dies, every
request left gets an update with ``error`` set, and queued calls fail with
:class:`EngineDeadError`.

Admission bounds (request amplification): one HTTP request may create at most
:attr:`AsyncLLMEngine.max_seqs_per_request` sequences (prompts x ``n``; the API checks it and names
the field), and the engine holds at most :attr:`AsyncLLMEngine.max_queued_seqs` sequences
submitted and not finished (running or waiting); :meth:`AsyncLLMEngine.submit` refuses more with
:class:`EngineOverloadedError` (the API's 503 with ``Retry-After``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from .output import RequestOutput
from .sequence import SamplingParams

if TYPE_CHECKING:  # the annotation only: the core imports EngineDeadError from here
    from .core import LLMEngine

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine's step loop failed; the request could not complete."""


class EngineOverloadedError(RuntimeError):
    """The engine already holds :attr:`AsyncLLMEngine.max_queued_seqs` sequences; nothing was
    queued. ``retry_after_s`` (seconds) is when to try again (the HTTP ``Retry-After``)."""

    def __init__(self, num_seqs: int, outstanding: int, bound: int, retry_after_s: int):
        super().__init__(
            f"this worker is at capacity: {outstanding} sequences are running or waiting, at most {bound} may be, "
            f"and the request needs {num_seqs} more; retry after {retry_after_s} s or send it to another worker"
        )
        self.num_seqs, self.outstanding, self.bound, self.retry_after_s = num_seqs, outstanding, bound, retry_after_s


MAX_N = 128
"""Most choices (``n``) per prompt: OpenAI's own bound, which the request models enforce
(runtime/api/protocol.py)."""
QUEUED_BATCHES = 16
"""Default depth of the engine's queue, in full batches (``max_num_seqs`` sequences each)."""
RETRY_AFTER_S = 1
"""``Retry-After`` of an overloaded engine (seconds). Short: sequences finish at every step, and a
router may send the retry to another worker."""


def seqs_per_request_bound(max_num_seqs: int) -> int:
    """Default bound on the sequences one request creates (prompts x ``n``; pure).

    One full batch (``max_num_seqs``), or OpenAI's :data:`MAX_N` choices of one prompt when that is
    more. Without it a 3 KB body (500 prompts x ``n`` 128) queued 64 000 sequences, which no batch
    runs at once and whose aborts, after the client left, took tens of seconds (each removal from
    the waiting queue scans it); the requests behind them waited all that time (the scheduler is
    first come, first served).
    """
    return max(MAX_N, max_num_seqs)


def queued_seqs_bound(max_num_seqs: int, max_seqs_per_request: int) -> int:
    """Default bound on the sequences the engine holds, running or waiting (pure):
    :data:`QUEUED_BATCHES` full batches, and never fewer than one largest request, so a request
    that passes the per-request bound can always run on an idle engine. A request beyond it would
    wait behind more than that many batches anyway; a 503 lets the client or the router send it to
    another worker instead."""
    return max(max_seqs_per_request, QUEUED_BATCHES * max_num_seqs)


def admits(outstanding: int, num_seqs: int, bound: int) -> bool:
    """Whether ``num_seqs`` more sequences may join ``outstanding`` running or waiting ones under
    ``bound`` (pure). An idle engine admits any request: its size is the per-request bound's business."""
    return outstanding == 0 or outstanding + num_seqs <= bound


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

    Stream interval: a streamed request's choice is updated after its first token and then every
    ``stream_interval`` tokens (and when it finishes), so that a multi-step run of N tokens reaches
    the client as N updates with the default of 1 (:meth:`LLMEngine.add_request`).

    Args:
        engine: the engine to step.
        admission_gap_s / admission_window_s: burst coalescing (above), seconds.
        stream_interval: tokens per update of a streamed choice (>= 1; default 1, as the worker's
            ``--stream-interval``).
        max_seqs_per_request: most sequences (prompts x ``n``) one API request may create; default
            :func:`seqs_per_request_bound` of ``engine.limits.max_num_seqs``.
        max_queued_seqs: most sequences submitted and not finished (running or waiting); default
            :func:`queued_seqs_bound`.

    Raises:
        ValueError: a bound below 1, or ``max_queued_seqs < max_seqs_per_request`` (the largest
            request could never be admitted), or a ``stream_interval`` below 1.
    """

    def __init__(self, engine: LLMEngine, *, admission_gap_s: float = ADMISSION_GAP_S,
                 admission_window_s: float = ADMISSION_WINDOW_S, max_seqs_per_request: int | None = None,
                 max_queued_seqs: int | None = None, stream_interval: int = 1):
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1 token, got {stream_interval}")
        self.engine = engine
        self.stream_interval = stream_interval
        self.admission_gap_s = admission_gap_s
        self.admission_window_s = admission_window_s
        max_num_seqs = engine.limits.max_num_seqs
        self.max_seqs_per_request = max_seqs_per_request or seqs_per_request_bound(max_num_seqs)
        self.max_queued_seqs = max_queued_seqs or queued_seqs_bound(max_num_seqs, self.max_seqs_per_request)
        if min(self.max_seqs_per_request, self.max_queued_seqs) < 1 or self.max_queued_seqs < self.max_seqs_per_request:
            raise ValueError(f"max_queued_seqs ({self.max_queued_seqs}) must be >= max_seqs_per_request "
                             f"({self.max_seqs_per_request}) >= 1: the largest request could never be admitted")
        self._num_seqs = 0  # sequences submitted and not finished, under _seqs_lock
        self._seqs_lock = threading.Lock()
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
            EngineOverloadedError: its ``params.n`` sequences would pass :attr:`max_queued_seqs`
                (nothing was queued).
        """
        loop = asyncio.get_running_loop()
        outbox, lock = self._outbox, self._outbox_lock
        released = False

        def post(out: RequestOutput) -> None:  # engine thread
            nonlocal released
            if (out.finished or out.error) and not released:  # the request's last update
                released = True
                self._release(params.n)
            with lock:
                outbox.append((loop, request_id, on_output, out))

        with self._admit_lock:
            if self._stop.is_set():
                raise EngineDeadError("engine shut down: the request was not queued")
            self._reserve(params.n)
            try:
                self.engine.add_request(request_id, prompt_token_ids, params, on_output=post, final_only=final_only,
                                        stream_interval=None if final_only else self.stream_interval)
            except BaseException:
                self._release(params.n)
                raise
        self._wake.set()

    @property
    def num_outstanding_seqs(self) -> int:
        """Sequences submitted and not finished (running or waiting; safe from any thread)."""
        return self._num_seqs

    def check_capacity(self, num_seqs: int) -> None:
        """Raise :class:`EngineOverloadedError` when ``num_seqs`` more sequences would not be
        admitted now (a request's check before it submits its parts; :meth:`submit` checks again)."""
        with self._seqs_lock:
            self._check_room(num_seqs)

    def _reserve(self, num_seqs: int) -> None:
        with self._seqs_lock:
            self._check_room(num_seqs)
            self._num_seqs += num_seqs

    def _check_room(self, num_seqs: int) -> None:
        """:class:`EngineOverloadedError` unless ``num_seqs`` more are admitted (lock held)."""
        if not admits(self._num_seqs, num_seqs, self.max_queued_seqs):
            raise EngineOverloadedError(num_seqs, self._num_seqs, self.max_queued_seqs, RETRY_AFTER_S)

    def _release(self, num_seqs: int) -> None:
        with self._seqs_lock:
            self._num_seqs -= num_seqs

    def abort(self, request_id: str, reason: str = "cancelled") -> None:
        """Cancel a submitted request (no-op when finished); its KV blocks are freed at the next
        step, its unfinished choices finish with ``"abort"`` and the log says why (``reason``)."""
        self.engine.abort(request_id, reason)
        self._wake.set()

    def abort_all(self, reason: str) -> None:
        """Cancel every request submitted so far (:meth:`LLMEngine.abort_all`), e.g. at the drain
        deadline: their consumers get a last update with ``"abort"`` instead of a cut connection."""
        self.engine.abort_all(reason)
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
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, final_only: bool = False,
        abort_reason: str = "the consumer stopped reading: the client disconnected",
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its updates until it finishes (with ``final_only``, one update
        per choice, when it finishes: see :meth:`LLMEngine.add_request`). Closed before that, it
        aborts the request; ``abort_reason`` goes into the log.

        Raises:
            RequestError: the request is invalid (raised before anything is yielded).
            EngineDeadError: the engine failed while running it, or was shut down; raised after the
                update with ``error`` set (its choices finish with ``"abort"``) is yielded.
        """
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.submit(request_id, prompt_token_ids, params, queue.put_nowait, final_only=final_only)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished or out.error is not None
                yield out
                if out.error:
                    raise EngineDeadError(out.error)
        finally:
            if not finished:
                self.abort(request_id, abort_reason)


def _dispatch_outputs(batch: list[tuple[str, Callable[[RequestOutput], None], RequestOutput]]) -> None:
    """Run each update's callback, in order (on the event loop; one call per engine step)."""
    for _, callback, out in batch:
        try:
            callback(out)
        except Exception:  # noqa: BLE001 - one consumer's bug must not starve the others of updates
            log.exception("output callback of request %s failed", out.request_id)
