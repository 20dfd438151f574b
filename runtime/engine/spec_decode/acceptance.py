"""Acceptance counts of speculative decoding: proposed and accepted draft tokens, per position.

Definitions (the ones the serving engines report):

- *proposed tokens*: real drafts sent to verification (padded positions are not proposals);
- *accepted tokens*: drafts the target kept;
- *acceptance rate*: accepted / proposed;
- *acceptance rate at position j*: of the requests that proposed a draft at position ``j``, the
  share whose drafts ``0 .. j`` were all accepted (a draft after a rejection is never accepted, so
  the rate falls with ``j``);
- *mean acceptance length*: tokens emitted per verification (accepted drafts + the target's own
  token), the speed-up's upper bound when a verification costs one decode step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class AcceptanceStats:
    """Running totals over verifications (one per request per speculative step).

    Attributes:
        num_speculative_tokens: ``k``, the draft positions tracked.
        verifications: requests verified (with or without drafts).
        proposed_tokens / accepted_tokens / emitted_tokens: totals.
        proposed_per_position / accepted_per_position: ``k`` counts, position 0 first.
    """

    num_speculative_tokens: int
    verifications: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        self.proposed_per_position = self.proposed_per_position or [0] * k
        self.accepted_per_position = self.accepted_per_position or [0] * k

    def observe(self, num_drafts: Sequence[int], num_accepted: Sequence[int]) -> None:
        """Count one verification step of several requests (host ints, request order).

        Raises:
            ValueError: lengths differ, a request accepted more than it proposed, or proposed
                more than ``k``.
        """
        if len(num_drafts) != len(num_accepted):
            raise ValueError(f"{len(num_drafts)} draft counts but {len(num_accepted)} acceptance counts")
        k = self.num_speculative_tokens
        for proposed, accepted in zip(num_drafts, num_accepted):
            if not 0 <= accepted <= proposed <= k:
                raise ValueError(f"need 0 <= accepted <= proposed <= k={k}; got accepted={accepted}, "
                                 f"proposed={proposed}")
            self.verifications += 1
            self.proposed_tokens += proposed
            self.accepted_tokens += accepted
            self.emitted_tokens += accepted + 1
            for j in range(proposed):
                self.proposed_per_position[j] += 1
            for j in range(accepted):
                self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / proposed, or None before any proposal."""
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else None

    @property
    def acceptance_rate_per_position(self) -> list[float | None]:
        """Per position ``j``: accepted / proposed at ``j`` (None where nothing was proposed)."""
        return [a / p if p else None for a, p in zip(self.accepted_per_position, self.proposed_per_position)]

    @property
    def mean_acceptance_length(self) -> float | None:
        """Emitted tokens per verification, ``1 .. k + 1``, or None before any."""
        return self.emitted_tokens / self.verifications if self.verifications else None

    def to_json(self) -> dict:
        """The totals and rates, for the worker report and benchmarks."""
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "verifications": self.verifications,
            "proposed_tokens": self.proposed_tokens,
            "accepted_tokens": self.accepted_tokens,
            "emitted_tokens": self.emitted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_rate_per_position": self.acceptance_rate_per_position,
            "mean_acceptance_length": self.mean_acceptance_length,
        }
