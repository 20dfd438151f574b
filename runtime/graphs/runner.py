"""The graph runner: executes one forward pass eagerly or by replaying a captured graph.

What is captured (docs/architecture.md, section "Graphs"):

- FULL keys (uniform batches of R requests of q token rows each: q = 1 for decode, ``k + 1``
  for speculative verification of ``k`` draft tokens): the whole forward pass *and* the logits of
  every token row, written into a static logits buffer [max_reqs * q_max, vocab] (float32). A
  runner built with ``num_speculative_tokens = k`` captures both query lengths at every full
  capture size (runtime/graphs/key.py); its static buffers hold ``max_reqs * (k + 1)`` token rows.
- PIECEWISE keys (T token rows, any batch): each of the model's ``num_hidden_layers + 1``
  segments between attention calls (see ``LlamaForCausalLM.run_segment``). Each segment reads
  static activation buffers (attention output, residual) and writes its results (q, k, v,
  residual, or the final hidden state) into static buffers; attention runs eagerly between the
  replays, and the logits of the sampled rows are computed eagerly afterwards.

All graphs share one memory pool and are captured largest first. Static *outputs* are fixed
buffers, so intermediate memory is reused by every graph and graph memory stays small.

Replays never hand out static memory: :meth:`GraphRunner.execute` returns a fresh tensor
(copied out) so the next replay cannot overwrite what a caller holds.

Weight reloads keep addresses (``LlamaForCausalLM.load_weights`` copies in place), so graphs
stay valid; anything that reallocates (a rebuilt KV cache, new static buffers, a changed key
contract) must call :meth:`GraphRunner.invalidate` and recapture. :meth:`check_addresses`
detects a moved tensor and invalidates with a reason instead of replaying into freed memory.

An :class:`~.online_canary.OnlineCanary` in :attr:`GraphRunner.online_canary` compares a sampled
fraction of replays with eager execution while serving; a key that diverges leaves dispatch
(:attr:`GraphRunner.diverged`) until the next capture.

A recapture with new capture sizes keeps the runner (the model runner holds it from its
construction): :meth:`GraphRunner.reconfigure` drops the graphs and sets up the new graph keys and
static buffers in place, then :meth:`GraphRunner.capture_all` captures them. ``generation`` only
ever increases, so a multi-step decode run started before is never continued on the new graphs.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from graphserving.contract.graph_policy import GraphMode
from ..model.forward_metadata import ForwardMetadata
from .backend import CapturedGraph, GraphBackend, make_backend
from .canary import randomize_blocks
from .online_canary import OnlineCanary, restore_slots, save_slots
from .key import (
    Dispatch,
    FallbackReason,
    GraphKey,
    GraphKeyContract,
    GraphRuntimeMode,
    configured_keys,
    decode_query_lens,
    dispatch,
)
from .static_buffers import StaticBuffers

log = logging.getLogger(__name__)

_MAX_REMEMBERED_PLANS = 4096
"""Batch shapes whose dispatch decision :meth:`GraphRunner.plan` keeps at most (then it starts over)."""

_OPTIONAL_BUFFERS = ("q_buf", "k_buf", "v_buf", "residual_buf", "attn_buf", "hidden_buf", "logits_buf")
"""Static buffers of one kind of key: the PIECEWISE activations and the FULL logits (None when unused)."""


class CaptureWindowError(RuntimeError):
    """A capture was attempted outside the runner's capture window."""


@dataclass
class KeyCapture:
    """The outcome of capturing one key."""

    key: GraphKey
    ok: bool
    memory_bytes: int = 0
    capture_seconds: float = 0.0
    error: str | None = None


@dataclass
class StepStats:
    """Counters the runner keeps for metrics (bounded label sets)."""

    replays: Counter = field(default_factory=Counter)  # key label -> replays
    eager: Counter = field(default_factory=Counter)  # FallbackReason -> eager passes
    real_rows: int = 0
    padded_rows: int = 0


class GraphRunner:
    """Runs forward passes through captured graphs where a key fits, eagerly otherwise.

    Args:
        model: a ``LlamaForCausalLM`` (``forward``, ``compute_logits``, ``run_segment``,
            ``run_attention``, ``verification_rows``, ``config``).
        kv_caches: per-layer KV cache tensors [2, num_blocks, block_size, Hkv, D].
        mode: the worker's graph mode.
        full_sizes: FULL capture sizes in requests (sorted, resolved).
        piecewise_sizes: PIECEWISE capture sizes in tokens (sorted, resolved).
        contract: the per-worker key contract.
        max_blocks_per_seq: block-table width of the static buffers.
        backend: capture backend; default: CUDA graphs on a CUDA device, emulation elsewhere.
        capture_fault: test hook, called with each key before its capture; raising from it
            simulates a capture failure.
        metrics: a :class:`~graphserving.runtime.graphs.metrics.GraphMetrics` to count passes in.
        num_speculative_tokens: ``k`` draft tokens verified per request (0: no speculative
            decoding): FULL keys are configured for query lengths ``(1, k + 1)``.

    Attributes:
        online_canary: compares sampled replays with eager execution (None: off). Set it after
            the pre-ready canary, whose replays must not be sampled.
        diverged: keys the online canary took out of dispatch, with the reason (cleared by a capture).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        *,
        mode: GraphMode,
        full_sizes: Sequence[int],
        piecewise_sizes: Sequence[int],
        contract: GraphKeyContract,
        max_blocks_per_seq: int,
        backend: GraphBackend | None = None,
        capture_fault: Callable[[GraphKey], None] | None = None,
        metrics=None,
        num_speculative_tokens: int = 0,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.contract = contract
        self.max_blocks_per_seq = max_blocks_per_seq
        self.metrics = metrics  # GraphMetrics, or None
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.backend = backend or make_backend(self.device)
        self.graphs: dict[GraphKey, CapturedGraph | list[CapturedGraph]] = {}
        self.captures: dict[GraphKey, KeyCapture] = {}
        self.generation = 0
        self.online_canary: OnlineCanary | None = None
        self.diverged: dict[GraphKey, str] = {}
        self._in_capture_window = False
        self._watched_ptrs: list[int] = []
        self._configure(mode, full_sizes, piecewise_sizes, capture_fault, num_speculative_tokens)

    def reconfigure(
        self,
        mode: GraphMode,
        full_sizes: Sequence[int],
        piecewise_sizes: Sequence[int],
        *,
        capture_fault: Callable[[GraphKey], None] | None = None,
        num_speculative_tokens: int | None = None,
    ) -> None:
        """Switch to a new graph mode and capture sizes, on this runner (a recapture).

        Drops every graph (:meth:`invalidate`; ``generation`` increases), then sets up what the
        constructor does for these arguments: the configured graph keys, new static buffers, the
        enabled state (a :meth:`disable` is undone), fresh :attr:`stats` and ``capture_fault``.
        The model, KV cache, key contract, block-table width, backend and metrics are kept.
        Batches run eagerly until :meth:`capture_all`. When setting up fails (allocating the new
        static buffers, say), the graphs are still dropped and the runner keeps its previous
        configuration; the error is raised.

        Args:
            mode / full_sizes / piecewise_sizes / capture_fault / num_speculative_tokens: as for
                the constructor; ``num_speculative_tokens`` None keeps the current one.

        Raises:
            CaptureWindowError: called during a capture.
            ValueError: ``num_speculative_tokens`` below 0.
            RuntimeError: (torch.OutOfMemoryError, say) the new static buffers could not be allocated.
        """
        if self._in_capture_window:
            raise CaptureWindowError("reconfigure refused: a capture is in progress")
        self.invalidate("reconfigured for a recapture")
        spec = self.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        self._configure(mode, full_sizes, piecewise_sizes, capture_fault, spec)

    def _configure(
        self,
        mode: GraphMode,
        full_sizes: Sequence[int],
        piecewise_sizes: Sequence[int],
        capture_fault: Callable[[GraphKey], None] | None,
        num_speculative_tokens: int,
    ) -> None:
        """Set up the mode, the graph keys, the enabled state, the stats and the static buffers.

        All or nothing: the new keys and buffers are built first, so an error (a CUDA out-of-memory
        while allocating, say) leaves the runner configured as before."""
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0 (0: no speculative decoding), "
                             f"got {num_speculative_tokens}")
        query_lens = decode_query_lens(num_speculative_tokens)
        full = sorted(full_sizes) if mode.has_full else []
        piece = sorted(piecewise_sizes) if mode.has_piecewise else []
        keys = configured_keys(mode, full, piece, self.contract, uniform_query_lens=query_lens)
        buffers = self._new_buffers(full, piece, max(query_lens))
        self.mode, self.full_sizes, self.piecewise_sizes, self.keys = mode, full, piece, keys
        self.num_speculative_tokens, self.uniform_query_lens = num_speculative_tokens, query_lens
        self.capture_fault = capture_fault
        self.enabled = mode is not GraphMode.NONE
        self.disabled_reason: FallbackReason = FallbackReason.MODE_NONE
        self.stats = StepStats()
        self._plans: dict[tuple, Dispatch] = {}  # plan()'s decisions by batch shape, for _plan_state
        self._plan_state: tuple | None = None
        for name, value in buffers.items():
            setattr(self, name, value)

    def _new_buffers(self, full_sizes: list[int], piecewise_sizes: list[int], max_query_len: int) -> dict[str, object]:
        """The static buffers of these capture sizes, by attribute name: ``buffers`` (metadata
        [max tokens / max requests]), the PIECEWISE activations [max tokens, ...] (model dtype) and
        the FULL logits [max requests * max_query_len, vocab] (float32); those a mode does not use
        are None. Max tokens: the largest FULL key's ``R * q`` rows or the largest PIECEWISE size."""
        cfg = self.model.config
        max_reqs = max(full_sizes, default=1)
        max_full_tokens = max_reqs * max_query_len if full_sizes else max_reqs
        max_tokens = max([max_full_tokens, *piecewise_sizes])
        out: dict[str, object] = dict.fromkeys(_OPTIONAL_BUFFERS)
        out["buffers"] = StaticBuffers(max_tokens, max_reqs, self.max_blocks_per_seq, self.device)
        q_heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        act = dict(device=self.device, dtype=self.dtype)
        if piecewise_sizes:
            out["q_buf"] = torch.zeros(max_tokens, q_heads, d, **act)
            out["k_buf"] = torch.zeros(max_tokens, kv_heads, d, **act)
            out["v_buf"] = torch.zeros(max_tokens, kv_heads, d, **act)
            out["residual_buf"] = torch.zeros(max_tokens, cfg.hidden_size, **act)
            out["attn_buf"] = torch.zeros(max_tokens, q_heads * d, **act)
            out["hidden_buf"] = torch.zeros(max_tokens, cfg.hidden_size, **act)
        if full_sizes:
            out["logits_buf"] = torch.zeros(max_full_tokens, cfg.vocab_size, device=self.device, dtype=torch.float32)
        return out

    # -- addresses -------------------------------------------------------------------------

    def _watched(self) -> list[torch.Tensor]:
        """Every tensor whose address a graph records: weights, buffers, KV cache, static buffers."""
        tensors = [*self.model.parameters(), *self.model.buffers(), *self.kv_caches]
        tensors += list(self.buffers.tensors.values())
        tensors += [t for t in (getattr(self, name) for name in _OPTIONAL_BUFFERS) if t is not None]
        return tensors

    def check_addresses(self) -> bool:
        """True if every recorded address is unchanged; otherwise invalidates all graphs.

        Call after anything that may reallocate (weight reload, adapter change, KV rebuild).
        """
        if not self.graphs:
            return True
        if [t.data_ptr() for t in self._watched()] == self._watched_ptrs:
            return True
        self.invalidate("tensor addresses changed since capture")
        return False

    def invalidate(self, reason: str) -> None:
        """Drop every graph; the next :meth:`capture_all` recaptures. Batches run eagerly meanwhile."""
        if self.graphs:
            log.info("invalidating %d graphs: %s", len(self.graphs), reason)
        self.generation += 1  # a multi-step run on these graphs' static buffers must not continue
        self.graphs.clear()
        self.captures.clear()
        self.diverged.clear()
        if self.online_canary is not None:
            self.online_canary.reset()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def disable(self, reason: FallbackReason) -> None:
        """Serve every batch eagerly from now on (degraded), counting ``reason``."""
        self.enabled = False
        self.disabled_reason = reason
        self.generation += 1

    # -- capture ---------------------------------------------------------------------------

    def _full_fn(self, key: GraphKey) -> Callable[[], None]:
        view = self.buffers.full_view(key.num_reqs, key.uniform_query_len)
        logits_out = self.logits_buf[: key.num_tokens]

        def run() -> None:
            hidden = self.model.forward(view, self.kv_caches)
            self.model.compute_logits(hidden[view.logits_indices], out=logits_out)  # written in place

        return run

    def _segment_fn(self, index: int, num_tokens: int) -> Callable[[], None]:
        ids = self.buffers["input_ids"][:num_tokens]
        pos = self.buffers["positions"][:num_tokens]
        slots = self.buffers["slot_mapping"][:num_tokens]  # padded rows: PAD_SLOT_ID (MoE routes them nowhere)
        attn = self.attn_buf[:num_tokens]
        residual = self.residual_buf[:num_tokens]
        last = self.model.config.num_hidden_layers

        def run() -> None:
            if index == last:
                (hidden,) = self.model.run_segment(index, ids, pos, attn, residual, slots)
                self.hidden_buf[:num_tokens].copy_(hidden)
                return
            if index == 0:
                q, k, v, res = self.model.run_segment(0, ids, pos, None, None, slots)
            else:
                q, k, v, res = self.model.run_segment(index, ids, pos, attn, residual, slots)
            self.q_buf[:num_tokens].copy_(q)
            self.k_buf[:num_tokens].copy_(k)
            self.v_buf[:num_tokens].copy_(v)
            self.residual_buf[:num_tokens].copy_(res)

        return run

    def _capture_key(self, key: GraphKey) -> CapturedGraph | list[CapturedGraph]:
        if not self._in_capture_window:
            raise CaptureWindowError(f"capture of {key.label()} refused: outside the capture window")
        if self.capture_fault is not None:
            self.capture_fault(key)
        if key.mode is GraphRuntimeMode.FULL:
            return self.backend.capture(self._full_fn(key), self._watched)
        segments = self.model.config.num_hidden_layers + 1
        return [self.backend.capture(self._segment_fn(i, key.num_tokens), self._watched) for i in range(segments)]

    def capture_all(self, progress: Callable[[int, int, KeyCapture], None] | None = None) -> list[KeyCapture]:
        """Capture every configured key, largest first, into the shared pool.

        A key whose capture raises (including out-of-memory) is recorded as failed with the cause
        and never replayed; the others are captured regardless. Never raises for a capture error.

        Args:
            progress: called after each key with (done, total, result).

        Returns:
            One :class:`KeyCapture` per configured key, in capture order.
        """
        self.invalidate("recapture")
        if not self.enabled:
            return []
        self.buffers.reset()  # capture runs the forward pass: it must write only into the null block
        results: list[KeyCapture] = []
        self._in_capture_window = True
        try:
            with self.backend.capture_session():
                for i, key in enumerate(self.keys):
                    start = time.perf_counter()
                    try:
                        graph = self._capture_key(key)
                    except Exception as exc:  # record why, keep the worker alive
                        result = KeyCapture(key, False, 0, time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
                        log.warning("capture of %s failed: %s", key.label(), result.error)
                        if self.device.type == "cuda":
                            torch.cuda.synchronize(self.device)
                    else:
                        parts = graph if isinstance(graph, list) else [graph]
                        self.graphs[key] = graph
                        result = KeyCapture(
                            key, True, sum(p.memory_bytes for p in parts), time.perf_counter() - start
                        )
                    self.captures[key] = result
                    results.append(result)
                    if progress:
                        progress(i + 1, len(self.keys), result)
        finally:
            self._in_capture_window = False
        self._watched_ptrs = [t.data_ptr() for t in self._watched()]
        self.generation += 1
        return results

    def drop(self, key: GraphKey, reason: str) -> None:
        """Stop replaying one key (e.g. its canary failed); its batches fall back to eager."""
        self.graphs.pop(key, None)
        self.generation += 1
        if key in self.captures:
            self.captures[key].ok = False
            self.captures[key].error = reason

    # -- execution -------------------------------------------------------------------------

    def plan(self, meta: ForwardMetadata) -> Dispatch:
        """The dispatch decision for a batch (pure: see graph_key.dispatch).

        Remembered per batch shape (token rows, requests, longest query, whether every row samples)
        while the captured and diverged keys stay as they are (the generation and their counts): a
        decode loop asks the same question every step, and the answer costs host time before the
        replay can start."""
        if not self.enabled:
            return Dispatch(None, self.disabled_reason)
        num_tokens = meta.num_tokens
        shape = (num_tokens, meta.num_reqs, meta.max_query_len, int(meta.logits_indices.shape[0]) == num_tokens)
        state = (self.generation, len(self.graphs), len(self.diverged))
        if state != self._plan_state or len(self._plans) >= _MAX_REMEMBERED_PLANS:
            self._plans.clear()
            self._plan_state = state
        decision = self._plans.get(shape)
        if decision is None:
            decision = self._plans[shape] = dispatch(
                num_tokens=num_tokens,
                num_reqs=shape[1],
                max_query_len=shape[2],
                mode=self.mode,
                full_sizes=self.full_sizes,
                piecewise_sizes=self.piecewise_sizes,
                contract=self.contract,
                captured=self.graphs.keys(),
                samples_every_row=shape[3],
                diverged=self.diverged.keys(),
                uniform_query_lens=self.uniform_query_lens,
            )
        return decision

    def execute(self, meta: ForwardMetadata, decision: Dispatch | None = None) -> tuple[torch.Tensor, Dispatch]:
        """Run one forward pass and return the logits of ``meta.logits_indices``.

        Args:
            meta: an unpadded batch (as built by the model runner), on the host or the device. A
                verification batch (ForwardMetadata ``uniform_query_len = k + 1``, every token row
                in ``logits_indices``) replays the FULL key of query length ``k + 1``.
            decision: the dispatch decision to carry out (a tensor-parallel follower runs rank 0's,
                runtime/graphs/parallel.py); None: :meth:`plan`'s.

        Returns:
            (logits float32 [S, vocab], a tensor the caller owns; the dispatch decision).
        """
        decision = self.plan(meta) if decision is None else decision
        if self.metrics is not None:
            self.metrics.observe_pass(decision, meta.num_tokens)
        if decision.key is None:
            self.stats.eager[decision.reason] += 1
            return self.run_eager(meta.to(self.device)), decision
        return self.replay(decision.key, meta), decision

    def resident_decode_view(self, meta: ForwardMetadata) -> tuple[ForwardMetadata, Callable[..., torch.Tensor]] | None:
        """For multi-step decoding: the static buffers of the FULL key that just replayed ``meta``.

        Returns ``(view, replay)`` when :meth:`execute` of ``meta`` (just before) replayed a FULL
        key, as the pure dispatch decision (:meth:`plan`) says: ``view`` is the key's metadata
        (views of the static buffers, which still hold ``meta`` padded), to be advanced in place
        (``engine/decode_advance.py``); ``replay()`` replays the key on the
        buffers as they are, counts the pass like :meth:`execute` does, and returns the logits
        float32 [num_reqs, vocab]: a copy the caller owns, or with ``replay(copy_out=False)`` the
        runner's logits buffer itself, valid until the next replay (reading it in stream order
        before the next replay is safe: a decode loop that samples each step's logits right away
        saves one device copy per step). None when that pass was eager or piecewise: the caller then
        advances its own device metadata and calls :meth:`execute`.

        Raises:
            ValueError: ``meta`` is a verification batch (``uniform_query_len > 1``) or dispatches
                to a key of query length above 1: multi-step decoding advances one token per
                request; a verification run advances its batch with :meth:`resident_view`.
        """
        decision = self.plan(meta)
        query_len = decision.key.uniform_query_len if decision.key is not None else 0
        if meta.uniform_query_len > 1 or query_len > 1:
            raise ValueError(f"multi-step decoding advances decode batches only (query length 1); this batch has "
                             f"{meta.num_tokens} token rows for {meta.num_reqs} requests (uniform query length "
                             f"{max(meta.uniform_query_len, query_len)}): a verification run takes resident_view()")
        return self._resident(meta, decision)

    def resident_view(self, meta: ForwardMetadata) -> tuple[ForwardMetadata, Callable[..., torch.Tensor]] | None:
        """For a device-resident run of any uniform query length (a speculative verification run,
        runtime/engine/spec_decode/resident.py): write ``meta`` into the static buffers of the FULL
        key it dispatches to, without replaying, and return ``(view, replay)`` as
        :meth:`resident_decode_view` does (``replay()`` returns float32 logits [num_tokens, vocab]).
        None when ``meta`` dispatches to no captured FULL key."""
        decision = self.plan(meta)
        if decision.key is None or decision.key.mode is not GraphRuntimeMode.FULL or decision.key not in self.graphs:
            return None
        self.buffers.fill_full(meta, decision.key.num_reqs, decision.key.uniform_query_len)
        return self._resident(meta, decision)

    def _resident(self, meta: ForwardMetadata,
                  decision: Dispatch) -> tuple[ForwardMetadata, Callable[..., torch.Tensor]] | None:
        """``(view, replay)`` of the FULL key ``decision`` names, whose static buffers hold ``meta``."""
        if decision.key is None or decision.key.mode is not GraphRuntimeMode.FULL:
            return None
        key = decision.key
        graph = self.graphs.get(key)
        if graph is None:
            return None
        n = meta.num_tokens  # one token row per request, or k + 1 of a verification batch

        view = self.buffers.full_view(key.num_reqs, key.uniform_query_len)

        def replay(copy_out: bool = True) -> torch.Tensor:
            if key not in self.graphs:  # the online canary took the key out during this run
                gone = FallbackReason.CANARY_DIVERGENCE if key in self.diverged else FallbackReason.NOT_CAPTURED
                self.stats.eager[gone] += 1
                return self.run_eager(view)[:n]
            if self.metrics is not None:
                self.metrics.observe_pass(decision, n)
            self._count_replay(key, n)
            graph.replay()
            logits = self.logits_buf[:n]
            return self.checked(key, lambda: view, logits.clone() if copy_out else logits)

        return view, replay

    def _count_replay(self, key: GraphKey, num_tokens: int) -> None:
        self.stats.replays[key.label()] += 1
        self.stats.real_rows += num_tokens
        self.stats.padded_rows += key.num_tokens - num_tokens

    def randomize_blocks(self, block_ids: list[int], generator: torch.Generator) -> None:
        """Random K/V in the KV cache's ``block_ids`` (the canary's context: :func:`.canary.randomize_blocks`)."""
        randomize_blocks(self.kv_caches, block_ids, generator)

    def run_eager(self, meta: ForwardMetadata) -> torch.Tensor:
        """The reference path: the model's own forward pass, no graphs."""
        hidden = self.model.forward(meta, self.kv_caches)
        return self.model.compute_logits(hidden[meta.logits_indices])

    def replay(self, key: GraphKey, meta: ForwardMetadata) -> torch.Tensor:
        """Replay ``key`` on ``meta`` (padded into the static buffers) and copy the logits out."""
        graph = self.graphs[key]
        self._count_replay(key, meta.num_tokens)
        if key.mode is GraphRuntimeMode.FULL:
            self.buffers.fill_full(meta, key.num_reqs, key.uniform_query_len)
            graph.replay()
            return self.checked(key, lambda: self.buffers.full_view(key.num_reqs, key.uniform_query_len),
                                self.logits_buf[: meta.num_tokens].clone())
        n, t = meta.num_tokens, key.num_tokens
        view = self.buffers.fill_piecewise(meta, t)
        # Eager attention sees the real token rows only: padded rows belong to no request, and a
        # uniform-decode batch padded to more token rows than it has requests (one larger than
        # every FULL size, or PIECEWISE-only) is not one request row per token row.
        real = replace(view, input_ids=view.input_ids[:n], positions=view.positions[:n],
                       slot_mapping=view.slot_mapping[:n])
        rows = self.model.verification_rows(real)  # a verification batch: once for every layer
        graph[0].replay()
        for i in range(self.model.config.num_hidden_layers):
            out = self.model.run_attention(i, self.q_buf[:n], self.k_buf[:n], self.v_buf[:n], real, self.kv_caches[i],
                                           rows)
            self.attn_buf[:n].copy_(out)
            self.attn_buf[n:t].zero_()
            graph[i + 1].replay()
        hidden = self.hidden_buf[:t]
        return self.checked(key, lambda: meta.to(self.device), self.model.compute_logits(hidden[view.logits_indices]))

    def checked(self, key: GraphKey, inputs: Callable[[], ForwardMetadata], logits: torch.Tensor) -> torch.Tensor:
        """A replay's logits, compared with eager execution when the online canary samples it.

        Args:
            key: the key that just replayed.
            inputs: builds the device metadata of what it replayed (a FULL key's padded static
                view, or a PIECEWISE batch's real token rows), for eager execution to run on;
                called only for a sampled replay, so an unsampled one pays nothing for it.
            logits: the replay's float32 logits [S, vocab]; S may be fewer rows than ``inputs``
                has (a FULL key's real rows come first).

        Returns:
            ``logits``, or the eager logits of the same rows when the replay diverged (the key is
            then dropped, recorded in :attr:`diverged`, and the eager K/V stay in the cache).
        """
        canary = self.online_canary
        if canary is None or not canary.sampled():
            return logits
        meta = inputs()
        saved = save_slots(self.kv_caches, meta.slot_mapping)
        eager = self.run_eager(meta)[: logits.shape[0]]
        result = canary.judge(key, logits, eager)
        if result.passed:
            restore_slots(self.kv_caches, saved)  # what the request sees is the replay's
            return logits
        reason = f"{FallbackReason.CANARY_DIVERGENCE.value}: {result.reason}"
        log.warning("online canary: %s diverged from eager (%s); it runs eagerly until the next capture",
                    key.label(), result.reason)
        self.diverged[key] = reason
        self.drop(key, reason)
        return eager

    # -- reporting -------------------------------------------------------------------------

    def captured_keys(self) -> list[GraphKey]:
        return [k for k in self.keys if k in self.graphs]

    def graph_memory_bytes(self) -> int:
        return sum(c.memory_bytes for c in list(self.captures.values()) if c.ok)
