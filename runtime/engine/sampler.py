"""Token sampling over a batch of logits, every parameter a per-row tensor.

Order of operations for each row (as in transformers' logits processors and vLLM's sampler):

1. log-probabilities for the response are taken from the model's raw logits (before penalties,
   temperature and truncation: what the model itself predicts);
2. repetition penalty over prompt and output tokens, then frequency and presence penalties over
   output tokens (OpenAI's definition: ``logit -= frequency * count + presence * (count > 0)``);
3. greedy rows (temperature 0) take the argmax here;
4. other rows: divide by the temperature, keep the top-k, then the top-p nucleus, then drop tokens
   below ``min_p`` times the top probability, and draw from the renormalised distribution.

Randomness is counter-based: the noise of a row is a hash of ``(seed, step, token id)``, where
``step`` is the number of tokens the sequence has generated so far. A seeded request therefore gets
the same tokens whatever else is in the batch, after a preemption and recompute, on CPU and GPU,
and with or without CUDA graphs (no generator state is read or advanced, so padded rows consume no
randomness of real ones). Drawing uses the exponential race (Gumbel-max in another form):
``argmax(p_i / E_i)`` with ``E_i ~ Exp(1)`` samples ``i`` with probability ``p_i``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sequence import GREEDY_TEMPERATURE

# splitmix64 constants (Steele, Lea, Flood 2014), as signed int64.
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic on signed integers)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijective int64 -> int64 hash (wrapping multiplication)."""
    x = x ^ _shr(x, 30)
    x = x * _MIX1
    x = x ^ _shr(x, 27)
    x = x * _MIX2
    return x ^ _shr(x, 31)


def counter_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform noise in (0, 1) that depends only on ``(seed, step, column)``.

    Args:
        seeds: int64 [S]. steps: int64 [S]. vocab_size: columns.

    Returns:
        float64 [S, vocab_size] on the device of ``seeds``.
    """
    row_key = _mix64(_mix64(seeds) ^ (steps * _GOLDEN))
    cols = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    h = _mix64(row_key[:, None] + (cols[None, :] + 1) * _GOLDEN)
    # top 53 bits -> (0, 1), never exactly 0 or 1
    return (_shr(h, 11).to(torch.float64) + 0.5) * (2.0**-53)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters for ``S`` rows (one per sequence that samples this step).

    Attributes:
        temperature: float32 [S]; 0 for greedy rows.
        top_k: int64 [S]; ``vocab_size`` (or more) where disabled.
        top_p: float32 [S]; 1 where disabled.
        min_p: float32 [S]; 0 where disabled.
        repetition_penalty: float32 [S]; 1 where disabled.
        presence_penalty / frequency_penalty: float32 [S]; 0 where disabled.
        seeds: int64 [S]; the RNG seed of each row.
        steps: int64 [S]; tokens generated so far by each row's sequence (the RNG counter).
        prompt_token_ids: int64 [S, Lp], right-padded with ``vocab_size``; only read when
            ``do_penalties``.
        output_token_ids: int64 [S, Lo], right-padded with ``vocab_size``; only read when
            ``do_penalties``.
        num_logprobs: top log-probabilities to return per row (max over rows), or -1 for none.
        all_greedy / do_penalties / do_top_k_top_p / do_min_p: host flags that let an eager step skip
            work no row needs; setting a flag when no row needs it gives the same result.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    seeds: torch.Tensor
    steps: torch.Tensor
    prompt_token_ids: torch.Tensor
    output_token_ids: torch.Tensor
    num_logprobs: int = -1
    all_greedy: bool = False
    do_penalties: bool = True
    do_top_k_top_p: bool = True
    do_min_p: bool = True


@dataclass
class SamplerOutput:
    """What the sampler returns for ``S`` rows.

    Attributes:
        token_ids: int64 [S], the sampled tokens.
        logprobs: float32 [S], log-probability of each sampled token (raw model distribution), or
            None when no row asked for log-probabilities.
        top_token_ids / top_logprobs: int64 / float32 [S, K], the K most likely tokens, or None.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Occurrences of each token per row. token_ids: int64 [S, L] padded with ``vocab_size``.

    Returns int32 [S, vocab_size].
    """
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.int32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Repetition, frequency and presence penalties. logits: float32 [S, V]; returns a new tensor."""
    vocab_size = logits.shape[1]
    output_counts = token_counts(t.output_token_ids, vocab_size)
    seen = (token_counts(t.prompt_token_ids, vocab_size) > 0) | (output_counts > 0)
    rep = t.repetition_penalty[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - t.frequency_penalty[:, None] * output_counts
    return logits - t.presence_penalty[:, None] * (output_counts > 0).to(logits.dtype)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p nucleus.

    logits: float32 [S, V]; top_k: int64 [S] (>= V disables); top_p: float32 [S] (1 disables).
    The most likely token is always kept. Ties at the k-th logit are broken by sort order.
    """
    vocab_size = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab_size, device=logits.device)[None, :]
    drop = ranks >= top_k.clamp(min=1)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # probability mass strictly before each token; keep tokens whose preceding mass < top_p
    mass_before = probs.cumsum(dim=-1) - probs
    drop = drop | (mass_before >= top_p[:, None])
    drop[:, 0] = False
    mask = torch.empty_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(mask, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's top probability.

    logits: float32 [S, V]; min_p: float32 [S] (0 disables). Compared in log space:
    ``logit - max_logit < log(min_p)``.
    """
    threshold = torch.log(min_p.clamp(min=1e-30))[:, None]
    low = (logits - logits.max(dim=-1, keepdim=True).values) < threshold
    return logits.masked_fill(low & (min_p[:, None] > 0), float("-inf"))


def sample(logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
    """Sample one token per row.

    Args:
        logits: float32 [S, V] (the rows that sample this step, in batch order).
        t: per-row parameters, all with leading dimension S.

    Returns:
        :class:`SamplerOutput`.
    """
    logits = logits.float()
    out = SamplerOutput(token_ids=torch.empty(0))
    if t.num_logprobs >= 0:
        logprobs = torch.log_softmax(logits, dim=-1)

    if t.do_penalties:
        logits = apply_penalties(logits, t)
    greedy_tokens = logits.argmax(dim=-1)
    if t.all_greedy:
        tokens = greedy_tokens
    else:
        greedy = t.temperature < GREEDY_TEMPERATURE
        scaled = logits / torch.where(greedy, torch.ones_like(t.temperature), t.temperature)[:, None]
        if t.do_top_k_top_p:
            scaled = apply_top_k_top_p(scaled, t.top_k, t.top_p)
        if t.do_min_p:
            scaled = apply_min_p(scaled, t.min_p)
        probs = scaled.softmax(dim=-1)
        noise = (-torch.log(counter_uniform(t.seeds, t.steps, logits.shape[1]))).to(torch.float32)
        random_tokens = (probs / noise).argmax(dim=-1)
        tokens = torch.where(greedy, greedy_tokens, random_tokens)
    out.token_ids = tokens

    if t.num_logprobs >= 0:
        out.logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1)
        if t.num_logprobs > 0:
            out.top_logprobs, out.top_token_ids = logprobs.topk(t.num_logprobs, dim=-1)
    return out
