"""The worker configuration: what the operator renders from a GraphServing and a worker reads.

A worker takes it as JSON (``graphserving-worker --config FILE`` or the ``GRAPHSERVING_WORKER_CONFIG``
environment variable); command-line flags override single fields for local use.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from graphserving.contract.graph_policy import GraphMode

Dtype = Literal["float32", "bfloat16", "float16"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


MAX_NUM_SEQS_LIMIT = 4096
"""Largest accepted ``max_num_seqs`` (requests): 4 times vLLM's largest default decode batch (1024, on
GPUs of 70 GiB and more; docs/architecture.md, "Public facts behind the defaults"). The default
capture-size grid up to it already holds 275 full graphs, and every request of a decode step takes a
float32 logits row of ``vocab_size`` values (0.8 GB for 4096 rows of SmolLM2's 49152 tokens)."""

MAX_NUM_BATCHED_TOKENS_LIMIT = 131072
"""Largest accepted ``max_num_batched_tokens`` (token rows per forward pass): 8 times vLLM's largest
default (16384; docs/architecture.md, "Public facts behind the defaults") and a whole 128k-token
context (Llama 3.2's, runtime/model/presets.py) in one step. Longer prompts are prefilled in chunks,
so a larger budget buys no capability."""

MAX_SPECULATIVE_TOKENS = 8
"""Largest number ``k`` of speculative tokens verified per request (issue 15: ``k > 8`` is refused;
runtime/engine/spec_decode/drafter.py takes it from here)."""

SPECULATIVE_PATTERN = rf"^ngram:[1-{MAX_SPECULATIVE_TOKENS}]$"
"""The accepted values of ``EngineLimits.speculative`` (and of the CRD's ``runtime.engine.speculative``)."""

MAX_BLOCK_SIZE = 256
"""Largest accepted ``block_size`` (tokens per KV block): the largest block size vLLM accepts (its
sizes run from 1 to 256 tokens; docs/architecture.md, "Public facts behind the defaults")."""


class EngineLimits(_Strict):
    """Scheduler and KV-cache limits of one worker, and its KV-cache policy (``prefix_caching``).

    ``prefix_caching`` is on unless it is ``False``: unset (None) is the default, so that a
    configuration rendered without it, and the revision hashed from it, stay what they were
    before the field existed (an operator upgrade restarts no worker).

    Maxima: :data:`MAX_NUM_SEQS_LIMIT`, :data:`MAX_NUM_BATCHED_TOKENS_LIMIT` and :data:`MAX_BLOCK_SIZE`
    (the API server rejects larger values naming the field). ``max_model_len`` needs none: the engine
    caps it at what the KV cache holds. Within them the worker checks at start-up that one forward pass
    of ``max_num_batched_tokens`` rows fits its device memory (runtime/lifecycle/profiling.py).
    """

    max_num_seqs: int = Field(64, ge=1, le=MAX_NUM_SEQS_LIMIT, description="Most requests in one batch.")
    max_num_batched_tokens: int = Field(
        2048,
        ge=1,
        le=MAX_NUM_BATCHED_TOKENS_LIMIT,
        description="Most token rows in one forward pass (prefill chunks + decodes); >= max_num_seqs.",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Longest sequence (prompt + output); default: the model's context."
    )
    block_size: int = Field(16, ge=1, le=MAX_BLOCK_SIZE, description="Tokens per KV-cache block.")
    kv_cache_memory_fraction: float = Field(
        0.85,
        gt=0,
        le=1,
        description="GPU: fraction of free device memory (after weights and graphs) for the KV cache.",
    )
    num_kv_blocks: int | None = Field(
        None, ge=2, description="Explicit KV-cache size in blocks (overrides the fraction; CPU default 512)."
    )
    num_scheduler_steps: int = Field(
        8,
        ge=1,
        le=64,
        description=(
            "Decode steps per schedule when every running request is decoding (multi-step decoding): "
            "sampled tokens are fed back on the device and the host syncs once per N steps. "
            "Higher values raise throughput; streams then arrive in bursts of up to N tokens and a new "
            "request may wait up to N steps for admission. 1 disables it."
        ),
    )
    prefix_caching: bool | None = Field(
        None,
        description=(
            "Prefix caching: full KV blocks are shared across requests by content (a hash of their tokens "
            "and of every token before them) and kept, evictable, after their requests end; a request's "
            "prefill skips its longest cached prefix. Outputs are the same either way. Unset: on (the "
            "default); false turns it off."
        ),
    )

    speculative: str | None = Field(
        None,
        pattern=SPECULATIVE_PATTERN,
        description=(
            "Speculative decoding: 'ngram:K' drafts up to K tokens (1 to 8) per request by prompt lookup (the "
            "continuation of the context's latest earlier match) and verifies them in one forward pass of K+1 "
            "tokens per request; greedy output is unchanged, sampled output follows the same distribution. "
            "Needs a graph mode that captures FULL graphs. Unset: off."
        ),
    )

    @property
    def num_speculative_tokens(self) -> int:
        """``k`` of ``speculative`` (``ngram:k``), 0 when speculative decoding is off."""
        return speculative_tokens(self.speculative)

    @model_validator(mode="after")
    def _decode_fits_token_budget(self) -> EngineLimits:
        """A decode step of ``max_num_seqs`` requests needs one token row each (the same rule as
        vLLM's scheduler config); with fewer rows the largest batches, and the full graphs captured
        for them, could never run.

        Raises:
            ValueError: ``max_num_batched_tokens < max_num_seqs``, naming both.
        """
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"maxNumBatchedTokens ({self.max_num_batched_tokens}) must be >= maxNumSeqs ({self.max_num_seqs}): "
                "a decode step of maxNumSeqs requests needs one token row each"
            )
        return self


def speculative_tokens(value: str | None) -> int:
    """``k`` of a speculative-decoding setting ``ngram:k`` (:data:`SPECULATIVE_PATTERN`); 0 for None.

    Raises:
        ValueError: any other value (the message gives it and the accepted form).
    """
    if value is None:
        return 0
    method, _, k = value.partition(":")
    if method != "ngram" or not k.isdigit() or not 1 <= int(k) <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"speculative decoding takes 'ngram:K' with K in 1..{MAX_SPECULATIVE_TOKENS}, got {value!r}")
    return int(k)


class CanaryThresholds(_Strict):
    """How close a graph replay must be to eager execution on the same inputs.

    Defaults: greedy tokens are compared only where the top-1/top-2 logit margin exceeds 0.7 (the
    margin below which vLLM's tests accept flipped tokens, docs/architecture.md, "Public facts behind the defaults").
    The relative logit error (max |graph - eager| / max |eager|) is bounded by 1e-3 in float32
    and by 2e-2 in bfloat16/float16 (about 2.5 units of bfloat16's 2^-7 rounding step).
    The online canary's ``sample_rate`` defaults to 0.0005: one comparison (an eager pass of the
    sampled batch) costs about as much as 10 to 14 replayed decode steps of SmolLM2 on an H200
    (bench/RESULTS.md, "Online canary"), so about 0.5-0.7% of decode time, under the 1% goal.
    """

    min_top1_margin: float = Field(
        0.7, ge=0, description="Greedy tokens are compared only where the top-1/top-2 logit margin exceeds this; default 0.7."
    )
    max_relative_logit_error: float = Field(
        1e-3, gt=0, description="Most relative logit error (max |graph - eager| / max |eager|) in float32; default 1e-3."
    )
    max_relative_logit_error_16bit: float = Field(
        2e-2, gt=0, description="The same bound in bfloat16 and float16; default 2e-2."
    )
    sample_rate: float = Field(
        0.0005,
        ge=0,
        le=1,
        description=(
            "Online canary: fraction of graph replays re-run eagerly on the same inputs (in the step they "
            "sample) and compared under these thresholds; a divergence takes the key out of dispatch. 0: off."
        ),
    )


class ReadinessPolicy(_Strict):
    """When a worker may report ready."""

    required_modes: list[GraphMode] = Field(default_factory=list)
    min_coverage: float = Field(1.0, ge=0, le=1, description="Fraction of configured graph keys captured and passing canary.")
    allow_degraded: bool = Field(False, description="Serve eagerly (declared degraded) when graphs cannot be used.")


class GraphConfig(_Strict):
    """What to capture."""

    mode: GraphMode = GraphMode.FULL_AND_PIECEWISE
    capture_sizes: list[int] | None = Field(
        None, description="Full-graph capture sizes in requests; None: the default grid up to max_num_seqs."
    )
    piecewise_capture_sizes: list[int] | None = Field(
        None,
        description="Piecewise capture sizes in tokens; None: the default grid up to max_num_batched_tokens.",
    )
    graph_memory_margin_fraction: float = Field(
        0.1, ge=0, le=10, description="Added to the graph-memory estimate before the KV cache is sized."
    )
    canary: CanaryThresholds = Field(default_factory=CanaryThresholds)
    readiness: ReadinessPolicy = Field(default_factory=ReadinessPolicy)


MAX_TENSOR_PARALLEL_SIZE = 16
"""Largest ``tensor_parallel_size``: the CRD's largest ``runtime.gpus`` (a group spans one Pod, so
the GPUs of one host)."""


class WorkerConfig(_Strict):
    """Everything a worker process needs to start."""

    model_name: str = Field(..., min_length=1, description="Name served at /v1/models.")
    model_path: str = Field(..., min_length=1, description="GGUF file or Hugging Face directory.")
    revision: str | None = Field(
        None, description="sha256 of the weights (manifest hash for a directory); None: not checked."
    )
    dtype: Dtype | None = Field(None, description="None: float32 on CPU, bfloat16 on CUDA.")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    seed: int = 0
    engine: EngineLimits = Field(default_factory=EngineLimits)
    graphs: GraphConfig = Field(default_factory=GraphConfig)
    tensor_parallel_size: int = Field(
        1, ge=1, le=MAX_TENSOR_PARALLEL_SIZE,
        description="Ranks (GPUs, one process each) that share the model's weights; 1: no tensor parallelism.",
    )

    @model_validator(mode="after")
    def _tensor_parallel_limits(self) -> WorkerConfig:
        """What tensor parallelism does not run yet (runtime/graphs/parallel.py), refused by name.

        Raises:
            ValueError: ``tensor_parallel_size > 1`` with ``engine.speculative``.
        """
        if self.tensor_parallel_size > 1 and self.engine.speculative is not None:
            raise ValueError(f"engine.speculative ({self.engine.speculative}) is not supported with tensor_parallel_size "
                             f"{self.tensor_parallel_size} yet: unset one of them")
        return self

    @model_validator(mode="after")
    def _speculative_needs_full_graphs(self) -> WorkerConfig:
        """Verification batches (``k + 1`` tokens per request) replay FULL graphs captured for them
        (runtime/graphs/key.py); a mode that captures none would verify every step eagerly.

        Raises:
            ValueError: ``engine.speculative`` is set and ``graphs.mode`` captures no FULL graphs.
        """
        if self.engine.speculative is not None and not self.graphs.mode.has_full:
            raise ValueError(speculative_mode_error(self.engine.speculative, self.graphs.mode))
        return self


def speculative_mode_error(speculative: str, mode: GraphMode) -> str:
    """The refusal of speculative decoding under a graph mode without FULL graphs (one wording for
    the worker and the CRD)."""
    return (f"engine.speculative (--speculative {speculative}) needs a graph mode that captures FULL graphs (FULL, FULL_DECODE_ONLY "
            f"or FULL_AND_PIECEWISE); graphs.mode is {mode.value}: change the mode or unset speculative decoding")
