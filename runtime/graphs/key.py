"""Graph keys and the dispatch decision: which captured graph (if any) runs a batch.

A :class:`GraphKey` holds every field that changes the captured topology. Two batches with the
same key can replay the same graph after their inputs are written into the static buffers; any
difference in a key field needs another graph. The per-worker constant fields (model revision,
dtype, parallel layout, adapter mode) live in :class:`GraphKeyContract`; they are part of every
key so that a graph captured under another contract can never be replayed by mistake.

:func:`dispatch` is the one pure function that maps a batch to a key or to eager execution with
a :class:`FallbackReason`.

Speculative decoding adds FULL keys whose ``uniform_query_len`` is ``k + 1``: verifying ``k`` draft
tokens runs ``k + 1`` query rows per request, every row producing logits, so a verification batch of
``R`` requests is ``T = R * (k + 1)`` token rows (runtime/model/verify_attention.py shows why its
attention is a uniform-decode computation of ``T`` rows, graph-safe). A speculative worker captures
both query lengths at each decode capture size: ``k + 1`` for verification steps, and ``1`` for
steps where no request has drafts (drafting paused for low acceptance, or a batch of fresh
decodes), which then cost one row per request instead of ``k + 1``.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import json
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, fields

from graphserving.contract.graph_policy import GraphMode
from graphserving.contract.report import GRAPH_KEY_CONTRACT_VERSION


class GraphRuntimeMode(str, enum.Enum):
    """How one forward pass runs."""

    EAGER = "eager"
    FULL = "full"
    PIECEWISE = "piecewise"


class FallbackReason(str, enum.Enum):
    """Why a batch ran eagerly (a bounded label set for metrics)."""

    MODE_NONE = "mode_none"
    """The worker's graph mode is NONE (or graphs are disabled: no CUDA, degraded)."""
    NOT_UNIFORM_DECODE = "not_uniform_decode"
    """A prefill or mixed batch under a full-only mode: not every request has the same query
    length, that length has no FULL keys, or a row produces no logits."""
    TOO_MANY_REQUESTS = "too_many_requests"
    """A uniform-decode batch larger than the largest full capture size, and no piecewise graph fits."""
    TOO_MANY_TOKENS = "too_many_tokens"
    """More token rows than the largest piecewise capture size."""
    NOT_CAPTURED = "not_captured"
    """The key is configured but its capture failed or was refused."""
    RECAPTURING = "recapturing"
    """Graphs are being invalidated and recaptured."""
    DEGRADED = "degraded"
    """Graphs are unavailable on this worker (no CUDA, or the policy's requirements failed)."""
    CANARY_DIVERGENCE = "canary_divergence"
    """The key's replay diverged from eager execution in the online canary: it is out of dispatch
    until the next capture (:mod:`.online_canary`)."""


@dataclass(frozen=True)
class GraphKeyContract:
    """Fields constant for one worker process that every key carries.

    Attributes:
        model_revision: the weights' revision (a graph replays whatever the weight buffers hold,
            but a revision change means a reload, and the keys must say which one was proven).
        dtype: activation dtype name.
        parallel_layout: tensor/pipeline layout, ``tp<N>-pp<M>``.
        adapter_mode: ``none`` (no LoRA adapters are served).
        moe_layout: the mixture-of-experts topology a captured graph bakes in (its expert count,
            top-k and expert-parallel layout fix the dispatch buffers' sizes and the grid):
            ``e<E>-top<k>-ep<N>``, or ``none`` for a dense model (``ModelConfig.moe_layout``).
    """

    model_revision: str
    dtype: str
    parallel_layout: str = "tp1-pp1"
    adapter_mode: str = "none"
    moe_layout: str = "none"

    def digest(self) -> str:
        """A short hash of the contract and the key-contract version (reported to the operator)."""
        payload = json.dumps({"v": GRAPH_KEY_CONTRACT_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass(frozen=True, order=True)
class GraphKey:
    """Everything that changes a captured topology.

    Attributes:
        mode: FULL (whole forward pass incl. logits) or PIECEWISE (segments between attention calls).
        num_tokens: padded token rows T.
        num_reqs: padded request rows R (FULL); 0 for PIECEWISE, whose segments see tokens only.
        uniform_query_len: query length q of every request for FULL keys (1 for decode, ``k + 1``
            for speculative verification of ``k`` draft tokens), ``num_tokens == num_reqs * q``;
            0 for PIECEWISE.
        contract: the per-worker constant fields.
    """

    mode: GraphRuntimeMode
    num_tokens: int
    num_reqs: int
    uniform_query_len: int
    contract: GraphKeyContract

    def __hash__(self) -> int:
        # computed once: a key is hashed several times a step (dispatch, the graph lookup, counters)
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.mode, self.num_tokens, self.num_reqs, self.uniform_query_len, self.contract))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        # without the cached hash: string hashes differ between processes (a tensor-parallel
        # follower unpickles rank 0's keys, runtime/graphs/parallel.py)
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def label(self) -> str:
        """A compact, bounded-cardinality label: ``full-t8-r8`` (decode), ``full-t24-r8-q3``
        (verification of 2 draft tokens per request) or ``piecewise-t256``. Built once per key."""
        cached = self.__dict__.get("_label")
        if cached is None:
            if self.mode is GraphRuntimeMode.FULL:
                suffix = "" if self.uniform_query_len == 1 else f"-q{self.uniform_query_len}"
                cached = f"full-t{self.num_tokens}-r{self.num_reqs}{suffix}"
            else:
                cached = f"piecewise-t{self.num_tokens}"
            object.__setattr__(self, "_label", cached)
        return cached


def full_key(size: int, contract: GraphKeyContract, query_len: int = 1) -> GraphKey:
    """The FULL key of a uniform batch of ``size`` requests of ``query_len`` rows each (1: decode;
    ``k + 1``: speculative verification), ``size * query_len`` token rows.

    Raises:
        ValueError: ``query_len < 1``.
    """
    if query_len < 1:
        raise ValueError(f"a FULL key's query length must be >= 1, got {query_len}")
    return GraphKey(GraphRuntimeMode.FULL, size * query_len, size, query_len, contract)


def piecewise_key(num_tokens: int, contract: GraphKeyContract) -> GraphKey:
    """The PIECEWISE key of ``num_tokens`` padded token rows."""
    return GraphKey(GraphRuntimeMode.PIECEWISE, num_tokens, 0, 0, contract)


def decode_query_lens(num_speculative_tokens: int) -> tuple[int, ...]:
    """The FULL keys' query lengths of a worker drafting ``k`` tokens (pure): ``(1,)`` without
    speculative decoding, ``(1, k + 1)`` with it (module docstring)."""
    return (1,) if num_speculative_tokens == 0 else (1, num_speculative_tokens + 1)


def configured_keys(
    mode: GraphMode,
    full_sizes: Sequence[int],
    piecewise_sizes: Sequence[int],
    contract: GraphKeyContract,
    uniform_query_lens: Sequence[int] = (1,),
) -> list[GraphKey]:
    """All keys a worker with ``mode`` captures, largest first within each mode (capture order).

    FULL keys come first: they are the largest single graphs, and capturing the largest first lets
    smaller graphs reuse the shared pool's memory. With several query lengths (a speculative
    worker: ``(1, k + 1)``) every full capture size gets a key per query length, ordered by token
    rows, then query length, largest first.

    Raises:
        ValueError: a query length below 1.
    """
    keys: list[GraphKey] = []
    if mode.has_full:
        full = [full_key(s, contract, q) for q in set(uniform_query_lens) for s in full_sizes]
        keys += sorted(full, key=lambda k: (k.num_tokens, k.uniform_query_len), reverse=True)
    if mode.has_piecewise:
        keys += [piecewise_key(s, contract) for s in sorted(piecewise_sizes, reverse=True)]
    return keys


@dataclass(frozen=True)
class Dispatch:
    """The outcome of :func:`dispatch`: a key to replay, or eager with a reason."""

    key: GraphKey | None
    reason: FallbackReason | None = None

    @property
    def runtime_mode(self) -> GraphRuntimeMode:
        return self.key.mode if self.key else GraphRuntimeMode.EAGER


def _pad_to(sizes: Sequence[int], n: int) -> int | None:
    """Smallest size in sorted ``sizes`` that is >= n, or None."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def dispatch(
    *,
    num_tokens: int,
    num_reqs: int,
    max_query_len: int,
    mode: GraphMode,
    full_sizes: Sequence[int],
    piecewise_sizes: Sequence[int],
    contract: GraphKeyContract,
    captured: Collection[GraphKey],
    samples_every_row: bool = True,
    diverged: Collection[GraphKey] = (),
    uniform_query_lens: Collection[int] = (1,),
) -> Dispatch:
    """Map a batch to the graph that replays it, or to eager execution with the reason.

    Order (docs/architecture.md, "Graphs"): a uniform batch (every request has the same query
    length q, one of ``uniform_query_lens``, and every row produces logits: q = 1 is decode,
    q = k + 1 speculative verification) pads its request count to the next full capture size and
    takes the FULL key of that size and q; otherwise, or if no full size fits, the token count pads
    to the next piecewise capture size; otherwise eager. A key that is configured but not in
    ``captured`` falls back with ``NOT_CAPTURED``. Where piecewise graphs are configured they are
    the last resort, so their reason (``TOO_MANY_TOKENS``) is the one reported.

    The batch's uniform query length is read from the counts: every query length is at most
    ``max_query_len``, so ``num_tokens == num_reqs * max_query_len`` holds exactly when all of
    them equal it.

    Args:
        num_tokens: real token rows in the batch (>= 1).
        num_reqs: real requests in the batch (>= 1).
        max_query_len: the largest query length of the batch.
        mode: the worker's graph mode.
        full_sizes / piecewise_sizes: sorted capture sizes (requests / tokens).
        contract: the worker's key contract.
        captured: keys whose graphs exist and passed their canary.
        diverged: keys the online canary took out of dispatch; a batch whose key is one of them
            falls back with ``CANARY_DIVERGENCE`` instead of ``NOT_CAPTURED``.
        samples_every_row: every token row produces logits this step. A FULL graph computes the
            logits of every row, so a batch with a row that does not (a one-token prefill chunk
            that does not reach its prompt's end; a multi-token prefill, whose last row alone
            samples) is not uniform. With q = 1 a token row is a request row; callers that
            configure q > 1 must compare the rows with logits to ``num_tokens``.
        uniform_query_lens: the query lengths FULL keys were configured for
            (:func:`configured_keys`); a uniform batch of another length is ``NOT_UNIFORM_DECODE``.

    Raises:
        ValueError: an empty batch.
    """
    if num_tokens < 1 or num_reqs < 1:
        raise ValueError(f"cannot dispatch an empty batch (tokens={num_tokens}, reqs={num_reqs})")
    if mode is GraphMode.NONE:
        return Dispatch(None, FallbackReason.MODE_NONE)

    reason: FallbackReason | None = None
    uniform = (num_tokens == num_reqs * max_query_len and max_query_len in uniform_query_lens
               and samples_every_row)
    if mode.has_full:
        if not uniform:
            reason = FallbackReason.NOT_UNIFORM_DECODE
        else:
            size = _pad_to(full_sizes, num_reqs)
            if size is None:
                reason = FallbackReason.TOO_MANY_REQUESTS
            else:
                key = full_key(size, contract, max_query_len)
                if key in captured:
                    return Dispatch(key)
                reason = FallbackReason.CANARY_DIVERGENCE if key in diverged else FallbackReason.NOT_CAPTURED
    if mode.has_piecewise:
        size = _pad_to(piecewise_sizes, num_tokens)
        if size is None:
            return Dispatch(None, FallbackReason.TOO_MANY_TOKENS)
        key = piecewise_key(size, contract)
        if key in captured:
            return Dispatch(key)
        return Dispatch(None, FallbackReason.CANARY_DIVERGENCE if key in diverged else FallbackReason.NOT_CAPTURED)
    assert reason is not None
    return Dispatch(None, reason)
