"""Traffic weights proportional to measured capacity, and the HTTPRoute that carries them (pure)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from graphserving.contract import graphserving_types as api
from . import naming

TOTAL_WEIGHT = 100
#: The Gateway API's HTTPRoute (group, version, plural).
GROUP, VERSION, PLURAL = "gateway.networking.k8s.io", "v1", "httproutes"


def capacity_weights(capacity: Mapping[str, float], fallback: str) -> dict[str, int]:
    """Integer weights summing to :data:`TOTAL_WEIGHT`, proportional to ``capacity`` per revision.

    Largest-remainder rounding (Hamilton's method), ties broken by revision name, so the result is
    deterministic and off by less than 1 from the exact share. When no revision has capacity, all
    weight goes to ``fallback`` (the revision the spec asks for), so a route always has a target.

    Args:
        capacity: effective capacity (tokens/s, >= 0) of every revision to route to.
        fallback: revision that gets everything when the total capacity is zero.
    """
    names = sorted(capacity)
    # Non-finite or huge values must not break the arithmetic below (reports are validated too).
    capacity = {n: min(max(0.0, c), 1e12) if math.isfinite(c) else 0.0 for n, c in capacity.items()}
    total = sum(capacity[n] for n in names)
    if total <= 0:
        return {n: (TOTAL_WEIGHT if n == fallback else 0) for n in sorted({*names, fallback})}
    exact = {n: TOTAL_WEIGHT * capacity[n] / total for n in names}
    weights = {n: math.floor(exact[n]) for n in names}
    left = TOTAL_WEIGHT - sum(weights.values())
    for n in sorted(names, key=lambda n: (-(exact[n] - weights[n]), n))[:left]:
        weights[n] += 1
    return weights


def http_route(gs: api.GraphServing, weights: Mapping[str, int], owner: dict[str, Any]) -> dict[str, Any] | None:
    """The Gateway API HTTPRoute for ``gs`` (None when ``spec.routing`` is unset).

    One rule whose backendRefs are the per-revision Services, weighted by ``weights``.
    """
    routing = gs.spec.routing
    if routing is None:
        return None
    name = gs.metadata.name
    route: dict[str, Any] = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "HTTPRoute",
        "metadata": {
            "name": name,
            "namespace": gs.metadata.namespace,
            "labels": naming.common_labels(name, component="routing"),
            "ownerReferences": [owner],
        },
        "spec": {
            "parentRefs": [p.to_api() for p in routing.parent_refs],
            "rules": [
                {
                    "backendRefs": [
                        {
                            "name": naming.revision_name(name, revision),
                            "port": gs.spec.runtime.port,
                            "weight": weight,
                        }
                        for revision, weight in sorted(weights.items())
                    ]
                }
            ],
        },
    }
    if routing.hostnames:
        route["spec"]["hostnames"] = list(routing.hostnames)
    return route
