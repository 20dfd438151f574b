"""Plausibility bounds on the capacity a worker reports about itself (pure).

A worker measures its own effective capacity (tokens/s) and reports it; traffic weights, the
rollout's floor and the pod-deletion cost follow it. A worker's token can write its own report, so a
report of 1e9 tok/s would take all the traffic and make the next rollout's floor unreachable. The
operator therefore counts a reported capacity at no more than :data:`PLAUSIBLE_CAPACITY_FACTOR`
times

- the median reported capacity of the revision's other serving Pods that serve the same way (same
  graph configuration, both degraded or both not), when there are any; and
- the capacity the operator first accepted from the same worker instance and graph configuration
  (:class:`AcceptedCapacity`, kept on the Pod in :data:`~.naming.ANNOTATION_ACCEPTED_CAPACITY`,
  which a worker's token may not write: manifests/policy), when there is one.

A report above the bound counts at the bound (:class:`Clamp`); the GraphServing's ``Reconciled``
condition (False, ``CapacityClamped``) and an Event say so, naming the Pod, the reported and the
counted value.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Sequence

from graphserving.contract.report import WorkerReport

#: K: how far above its peers' median (or its own first accepted measurement) a reported capacity
#: may lie. Peers run the same model, dtype, engine and graph configuration from the same pod
#: template and serve the same way (graphs or degraded, compared only with their kind: eager decode
#: is up to 20x slower than replay, bench/RESULTS.md "Graph runner"), so honest measurements differ
#: by node-to-node spread (clocks, a mixed GPU generation, co-tenants), well inside 4x; one worker's
#: measurements of one configuration differ by less. A report 4x above either is not a measurement,
#: and counting it at 4x bounds what a forged report can take (traffic weights, the rollout floor).
PLAUSIBLE_CAPACITY_FACTOR = 4.0

CLAMP_REASON = "CapacityClamped"


@dataclasses.dataclass(frozen=True)
class AcceptedCapacity:
    """The capacity first counted for a worker ``instance`` and ``graph_config_hash`` (tokens/s)."""

    instance: str
    graph_config_hash: str
    tokens_per_second: float

    def to_annotation(self) -> str:
        return json.dumps({"instance": self.instance, "graphConfigHash": self.graph_config_hash,
                           "tokensPerSecond": round(self.tokens_per_second, 3)}, separators=(",", ":"))

    @classmethod
    def parse(cls, value: str | None) -> AcceptedCapacity | None:
        """The annotation's value; None when absent or unreadable (then there is no history)."""
        if not value:
            return None
        try:
            raw = json.loads(value)
            accepted = cls(str(raw["instance"]), str(raw["graphConfigHash"]), float(raw["tokensPerSecond"]))
        except (ValueError, TypeError, KeyError):
            return None
        return accepted if accepted.tokens_per_second >= 0 else None

    def applies_to(self, report: WorkerReport) -> bool:
        return (self.instance, self.graph_config_hash) == (report.worker.instance, report.graph_config_hash)


@dataclasses.dataclass(frozen=True)
class Clamp:
    """A reported capacity above its plausibility ``bound`` (tokens/s); ``basis`` says whose."""

    reported: float
    bound: float
    basis: str

    def message(self, pod: str) -> str:
        return (f"pod {pod} reported {self.reported:.0f} tok/s; counted {self.bound:.0f} tok/s "
                f"({PLAUSIBLE_CAPACITY_FACTOR:g}x {self.basis})")


def plausible_bound(
    reported: float,
    peers: Sequence[float],
    accepted: float | None,
    factor: float = PLAUSIBLE_CAPACITY_FACTOR,
) -> Clamp | None:
    """The clamp of ``reported`` (tokens/s), or None when it is plausible.

    Args:
        reported: the worker's reported effective capacity.
        peers: reported capacities of the revision's other serving Pods of the same kind (> 0 only
            count; none: no peer bound).
        accepted: the capacity first accepted from this instance and graph config (None: no history).
        factor: K, :data:`PLAUSIBLE_CAPACITY_FACTOR`.

    Returns:
        A :class:`Clamp` to the lowest applicable bound when ``reported`` exceeds it.
    """
    bounds: list[tuple[float, str]] = []
    positive = [p for p in peers if p > 0]
    if positive:
        median = statistics.median(positive)
        bounds.append((factor * median, f"the median {median:.0f} tok/s of {len(positive)} peer(s)"))
    if accepted is not None and accepted > 0:
        bounds.append((factor * accepted, f"its own first accepted {accepted:.0f} tok/s"))
    if not bounds:
        return None
    bound, basis = min(bounds, key=lambda b: b[0])  # a tie names the peers
    return Clamp(reported, bound, basis) if reported > bound else None
