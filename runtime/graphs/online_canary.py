"""The online canary: sampled graph replays re-run eagerly on the same inputs, while serving.

The pre-ready canary (:mod:`.canary`) proves every key on a synthetic batch before the worker is
Ready; nothing in it watches the graphs afterwards. The design document's production check
("sample and compare with eager", docs/architecture.md, "Graphs") does: a sampled fraction
(:attr:`~graphserving.contract.worker_config.CanaryThresholds.sample_rate`) of replays is run a
second time, eagerly, on the inputs the replay saw, and judged by the same
:func:`~.canary.compare_logits` and thresholds as the pre-ready canary.

What a comparison costs and changes (:meth:`GraphRunner.checked <.runner.GraphRunner>` runs it):

- one eager forward pass of the sampled batch, in the step it samples, on the replay's stream;
  the comparison itself reads a few scalars back to the host. Amortised over all replays that is
  ``sample_rate × eager step / replay step`` of decode time (bench/RESULTS.md measures it).
- nothing a request sees, when the replay passes: the eager pass rewrites the KV slots of the
  batch's tokens, so those slots are saved before it and restored after it (the replay's K/V
  stay, and a seeded request's tokens do not depend on whether it was sampled).
- when the replay diverges, the eager logits are the step's result (the reference), the eager
  K/V stay, and the key is taken out of dispatch until the next capture: its batches run eagerly
  (or on another graph) with :attr:`~.key.FallbackReason.CANARY_DIVERGENCE`.

Sampling is a Bernoulli draw per replay from a seeded generator: the rate is a mean, and which
replays are sampled is reproducible for a seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphserving.contract.worker_config import CanaryThresholds
from .canary import CanaryResult, compare_logits
from .key import GraphKey


@dataclass
class KeyTally:
    """One key's comparisons since its capture."""

    comparisons: int = 0
    divergences: int = 0
    last_divergence: CanaryResult | None = None


class OnlineCanary:
    """Which replays to compare with eager execution, how to judge them, and the tallies.

    Args:
        thresholds: the canary thresholds; ``sample_rate`` is the fraction of replays compared
            (0: never).
        dtype: the model dtype (picks the float32 or 16-bit logit-error bound).
        seed: seeds the sampling draws.
        on_divergence: called with (key, result) after a comparison fails (on the thread that ran
            the replay: the engine's).
        metrics: a :class:`~.metrics.GraphMetrics` counting comparisons and divergences per key.
    """

    def __init__(
        self,
        thresholds: CanaryThresholds,
        dtype: torch.dtype,
        *,
        seed: int = 0,
        on_divergence: Callable[[GraphKey, CanaryResult], None] | None = None,
        metrics=None,
    ):
        self.thresholds = thresholds
        self.rate = thresholds.sample_rate
        self.dtype = dtype
        self.on_divergence = on_divergence
        self.metrics = metrics
        self.tallies: dict[GraphKey, KeyTally] = {}
        self.comparisons = 0  # totals over every key and capture (reset() keeps them)
        self.divergences = 0
        self._draw = random.Random(seed).random

    def sampled(self) -> bool:
        """Whether to compare the replay that just ran (a Bernoulli draw with p = ``rate``)."""
        return self.rate > 0 and self._draw() < self.rate

    def judge(self, key: GraphKey, graph: torch.Tensor, eager: torch.Tensor) -> CanaryResult:
        """Compare one replay's logits with eager execution's and count the comparison.

        Args:
            key: the key that replayed.
            graph / eager: float32 logits [S, vocab] of the same rows.

        Returns:
            The :class:`~.canary.CanaryResult`; when it did not pass, ``on_divergence`` has been
            called with it.
        """
        result = compare_logits(key, eager, graph, self.thresholds, self.dtype)
        tally = self.tallies.setdefault(key, KeyTally())
        tally.comparisons += 1
        self.comparisons += 1
        if self.metrics is not None:
            self.metrics.observe_online_canary(key.label(), result.passed)
        if not result.passed:
            tally.divergences += 1
            self.divergences += 1
            tally.last_divergence = result
            if self.on_divergence is not None:
                self.on_divergence(key, result)
        return result

    def reset(self, thresholds: CanaryThresholds | None = None) -> None:
        """Forget the per-key tallies (a capture replaced the graphs they are about; the totals
        stay), and take new ``thresholds`` when given (a recapture's configuration)."""
        self.tallies.clear()
        if thresholds is not None:
            self.thresholds = thresholds
            self.rate = thresholds.sample_rate


def save_slots(kv_caches: list[torch.Tensor], slot_mapping: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Copies of the KV-cache entries of ``slot_mapping``'s slots, to put back with :func:`restore_slots`.

    Args:
        kv_caches: per-layer caches [2, num_blocks, block_size, Hkv, D] (contiguous).
        slot_mapping: int64 [T] slots (``PAD_SLOT_ID`` rows read the null block's first slot,
            which holds garbage by design and may be written back).

    Returns:
        (the slot index used, one [2, T, Hkv, D] copy per layer).
    """
    index = slot_mapping.clamp_min(0)
    saved = [_flat(kv).index_select(1, index) for kv in kv_caches]
    return index, saved


def restore_slots(kv_caches: list[torch.Tensor], saved: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    """Write the entries :func:`save_slots` copied back into the caches."""
    index, copies = saved
    for kv, copy in zip(kv_caches, copies):
        _flat(kv).index_copy_(1, index, copy)


def _flat(kv: torch.Tensor) -> torch.Tensor:
    """[2, num_blocks, block_size, Hkv, D] as [2, num_blocks * block_size, Hkv, D] (a view)."""
    return kv.view(kv.shape[0], kv.shape[1] * kv.shape[2], *kv.shape[3:])
