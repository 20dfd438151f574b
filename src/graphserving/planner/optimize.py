"""Choosing capture sizes: an exact dynamic programme over sorted candidate sizes.

The objective (docs/architecture.md, "Capture-size planner"), for a batch-size histogram p(B), a cost model T and M and a
weight λ >= 0::

    J(S) = Σ_{B <= m} p(B) · T(B, C_S(B))  +  Σ_{B > m} p(B) · T_eager(B)  +  λ · Σ_{c in S} M(c)

where ``S`` is the capture-size list, ``m = max(S)`` the maximum (always captured: the
scheduler's ``max_num_seqs``, or the largest observed size), ``C_S(B)`` the smallest size in
``S`` that is >= B, and ``M(c)`` the graph memory of size ``c`` in GiB (so λ is in step-time
units per GiB). Batches above the maximum run eagerly; their term is the same for every ``S``.
p(B) is the histogram normalised by all its batches (overflow included).

Subject to a budget: at most ``max_graphs`` sizes, ``Σ graph memory <= max_graph_memory_bytes``,
``Σ capture seconds <= max_capture_seconds``.

Why a DP over candidates is exact: only observed sizes carry mass, so the candidates are the
observed sizes <= m plus m. Given the sizes chosen, a batch B's cost depends only on the next
chosen size at or above it, so J splits into independent segments between consecutive chosen
sizes: choosing ``s_i`` right after ``s_j`` costs ``seg(j, i) = Σ_{s_j < B <= s_i} p(B)·T(B, s_i)
+ λ·M(s_i)``. The best list is a shortest path through the sorted candidates ending at m.
Restricting to candidates loses nothing when T(B, C) and M(C) do not decrease with C (true of
both cost models here): a size between two candidates can be lowered to the largest observed
size below it without raising any term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from graphserving.planner.cost_model import GIB, AnalyticCostModel, CostModel
from graphserving.planner.histogram import BatchSizeHistogram

# Budgets are compared with this relative slack, so that a list whose summed costs equal the
# budget (summed in another order) is not refused for a rounding error.
_BUDGET_RTOL = 1e-9
# A plan with more graphs replaces one with fewer only when it is better by more than this.
_TIE_RTOL = 1e-12


class PlanError(ValueError):
    """Inputs for which no capture-size list can be planned."""


@dataclass(frozen=True)
class Budget:
    """Limits on the capture-size list; None means unlimited.

    Attributes:
        max_graphs: most capture sizes (>= 1; the maximum itself counts).
        max_graph_memory_bytes: most summed graph memory, bytes (cost model's M).
        max_capture_seconds: most summed capture time, seconds.
    """

    max_graphs: int | None = None
    max_graph_memory_bytes: float | None = None
    max_capture_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.max_graphs is not None and self.max_graphs < 1:
            raise PlanError(f"max_graphs must be >= 1 (the maximum is always captured), got {self.max_graphs}")
        for name in ("max_graph_memory_bytes", "max_capture_seconds"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise PlanError(f"{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class Plan:
    """The chosen capture sizes and the objective they reach.

    Attributes:
        capture_sizes: ascending, ending at ``maximum``.
        maximum: the largest capture size; batches above it run eagerly.
        objective: J(capture_sizes) in the cost model's time unit.
        lam: the λ used.
        candidates: the sizes the DP chose from, ascending.
        method: ``"dp"`` (no memory or capture-time budget was binding) or ``"dp-pareto"``.
    """

    capture_sizes: list[int]
    maximum: int
    objective: float
    lam: float
    candidates: list[int] = field(repr=False)
    method: str


def candidate_sizes(histogram: BatchSizeHistogram, maximum: int, extra: tuple[int, ...] = ()) -> list[int]:
    """Observed sizes <= ``maximum``, any ``extra`` sizes <= ``maximum``, and ``maximum``, ascending."""
    sizes = {s for s in histogram.sizes if s <= maximum} | {s for s in extra if 1 <= s <= maximum}
    sizes.add(maximum)
    return sorted(sizes)


def objective(
    histogram: BatchSizeHistogram,
    capture_sizes: list[int],
    cost_model: CostModel,
    lam: float = 0.0,
) -> float:
    """J(capture_sizes) evaluated directly (no DP); the maximum is ``max(capture_sizes)``."""
    sizes = sorted(capture_sizes)
    total = histogram.total
    if total <= 0:
        return lam * sum(cost_model.graph_memory_bytes(c) for c in sizes) / GIB
    value = 0.0
    for batch, count in histogram.items():
        idx = int(np.searchsorted(sizes, batch))
        if idx < len(sizes):
            value += count * cost_model.step_time(batch, sizes[idx])
        else:
            value += count * cost_model.eager_step_time(batch)
    # Overflow batches have no known size: cost them as eager at the largest observed size.
    if histogram.overflow:
        top = max(histogram.sizes, default=sizes[-1])
        value += histogram.overflow * cost_model.eager_step_time(max(top, sizes[-1] + 1))
    return value / total + lam * sum(cost_model.graph_memory_bytes(c) for c in sizes) / GIB


def plan_capture_sizes(
    histogram: BatchSizeHistogram,
    cost_model: CostModel | None = None,
    *,
    budget: Budget = Budget(),
    lam: float = 0.0,
    maximum: int | None = None,
    extra_candidates: tuple[int, ...] = (),
) -> Plan:
    """The capture-size list minimising J (module docstring) within ``budget``.

    Method: over the ``n`` sorted candidates, ``f_k(i)`` is the least cost of a list of ``k``
    sizes ending at candidate ``i`` that covers every batch <= ``s_i``:
    ``f_1(i) = seg(-1, i)``, ``f_k(i) = min_{j<i} f_{k-1}(j) + seg(j, i)``; the answer is
    ``min_{k <= K} f_k(n-1)``, ties going to fewer graphs.

    Complexity, with K = min(max_graphs, n):

    - Without memory or capture-time budgets (or when the unconstrained optimum already meets
      them, which is checked first): O(n²·K) time (vectorised per layer) and O(n·K) space, plus
      O(n²) cost-model calls to tabulate ``seg``.
    - With a binding memory or capture-time budget the problem contains 0/1 knapsack (NP-hard),
      so each state ``(k, i)`` keeps its Pareto set of (cost, resources used) labels, pruned by
      dominance, by feasibility (room must remain for the maximum) and by a bound: a label is
      dropped when its cost plus a lower bound on any completion exceeds the best feasible list
      known. The incumbent comes from a Lagrangian relaxation (the resources priced at a
      multiplier μ found by bisection, each try an O(n²·K) DP); the lower bound is the larger
      of the unconstrained completion cost and the Lagrangian one, ``B_μ(i, r) - μ·(room
      left)``, both tabulated backwards in O(n²·K). Exact, in O(n²·K·L·log L) time and
      O(n·K·L) space, where L is the largest Pareto set left after pruning; L is at most the
      number of distinct resource sums reachable (exponential in the worst case), and the bound
      keeps it small in practice (n = 256, K = 35 plans in seconds).

    Args:
        histogram: p(B), counts by batch size.
        cost_model: T and M; default :class:`AnalyticCostModel` (T(B, C) = C).
        budget: limits; the maximum is always included, so a budget it alone exceeds is refused.
        lam: λ >= 0, weight of graph memory (GiB) in the objective.
        maximum: largest capture size (e.g. ``max_num_seqs``); default: the largest observed
            batch size. Observed batches above it count as eager fallbacks.
        extra_candidates: further sizes the DP may choose (e.g. hardware-friendly multiples).

    Returns:
        The optimal :class:`Plan`.

    Raises:
        PlanError: λ < 0 or not finite, maximum < 1, no maximum and an empty histogram, or a budget that even
            the list ``[maximum]`` exceeds.
    """
    model: CostModel = cost_model if cost_model is not None else AnalyticCostModel()
    if not (lam >= 0 and math.isfinite(lam)):
        # An infinite λ makes J infinite (or NaN where M is 0) for every list: nothing to compare.
        raise PlanError(f"lambda must be a finite number >= 0, got {lam}")
    if maximum is None:
        if not histogram.sizes:
            raise PlanError("the histogram is empty and no maximum was given: nothing to plan")
        maximum = histogram.max_size
    if maximum < 1:
        raise PlanError(f"maximum must be >= 1, got {maximum}")

    sizes = candidate_sizes(histogram, maximum, extra_candidates)
    n = len(sizes)
    total = histogram.total
    counts = histogram.counts
    weights = np.array([counts.get(s, 0.0) / total if total > 0 else 0.0 for s in sizes])
    node_cost = np.array([lam * model.graph_memory_bytes(s) / GIB for s in sizes])
    seg = _segment_costs(sizes, weights, model)
    eager_part = objective(histogram, [maximum], model, 0.0) - float(seg[0, n - 1]) if total > 0 else 0.0

    limits, resources = _resources(sizes, model, budget)
    if np.any(resources[n - 1] > limits * (1 + _BUDGET_RTOL)):
        raise PlanError(
            f"budget too small: capturing only the maximum {maximum} already needs "
            f"{_describe(resources[n - 1], budget)}"
        )
    max_graphs = min(budget.max_graphs or n, n)

    chosen, cost = _dp_unconstrained(seg, node_cost, max_graphs)
    method = "dp"
    if limits.size and np.any(resources[chosen].sum(axis=0) > limits * (1 + _BUDGET_RTOL)):
        chosen, cost = _dp_budgeted(seg, node_cost, resources, limits * (1 + _BUDGET_RTOL), max_graphs)
        method = "dp-pareto"
    return Plan(
        capture_sizes=[sizes[i] for i in chosen],
        maximum=maximum,
        objective=cost + eager_part,
        lam=lam,
        candidates=sizes,
        method=method,
    )


def _segment_costs(sizes: list[int], weights: np.ndarray, model: CostModel) -> np.ndarray:
    """``seg[j + 1, i] = Σ_{j < b <= i} weights[b]·T(sizes[b], sizes[i])`` for -1 <= j < i.

    Shape (n + 1, n), float64; entries with j >= i are meaningless.
    """
    n = len(sizes)
    terms = np.zeros((n, n))
    for i, c in enumerate(sizes):
        for b in range(i + 1):
            if weights[b]:
                terms[b, i] = weights[b] * model.step_time(sizes[b], c)
    below = np.vstack([np.zeros(n), np.cumsum(terms, axis=0)])  # below[x, i] = Σ_{b < x} terms[b, i]
    through = below[np.arange(n) + 1, np.arange(n)]  # Σ_{b <= i} terms[b, i]
    return through[None, :] - below


def _resources(sizes: list[int], model: CostModel, budget: Budget) -> tuple[np.ndarray, np.ndarray]:
    """Budget limits (d,) and per-candidate resource use (n, d) for the d budgeted resources."""
    columns, limits = [], []
    if budget.max_graph_memory_bytes is not None:
        columns.append([model.graph_memory_bytes(s) for s in sizes])
        limits.append(budget.max_graph_memory_bytes)
    if budget.max_capture_seconds is not None:
        columns.append([model.capture_seconds(s) for s in sizes])
        limits.append(budget.max_capture_seconds)
    use = np.array(columns, dtype=float).T if columns else np.zeros((len(sizes), 0))
    return np.array(limits, dtype=float), use


def _describe(use: np.ndarray, budget: Budget) -> str:
    parts, k = [], 0
    if budget.max_graph_memory_bytes is not None:
        parts.append(f"{use[k]:.0f} bytes of graph memory (budget {budget.max_graph_memory_bytes:.0f})")
        k += 1
    if budget.max_capture_seconds is not None:
        parts.append(f"{use[k]:.3f} capture seconds (budget {budget.max_capture_seconds})")
    return " and ".join(parts)


def _dp_unconstrained(seg: np.ndarray, node_cost: np.ndarray, max_graphs: int) -> tuple[list[int], float]:
    """Best list under the graph-count limit only: (candidate indices, cost without eager part)."""
    n = seg.shape[1]
    later = np.triu(np.ones((n, n), dtype=bool), k=1)  # later[j, i]: j < i
    layer = seg[0] + node_cost
    parents: list[np.ndarray] = []
    best_k, best_cost = 1, float(layer[n - 1])
    for k in range(2, max_graphs + 1):
        options = np.where(later, layer[:, None] + seg[1:, :], np.inf)
        parent = np.argmin(options, axis=0)
        layer = options[parent, np.arange(n)] + node_cost
        parents.append(parent)
        if layer[n - 1] < best_cost - _TIE_RTOL * abs(best_cost):
            best_k, best_cost = k, float(layer[n - 1])
    chosen = [n - 1]
    for k in range(best_k, 1, -1):
        chosen.append(int(parents[k - 2][chosen[-1]]))
    return chosen[::-1], best_cost


@dataclass
class _Layer:
    """Pareto labels of all states (k, i) of one layer k, sorted by node i."""

    node: np.ndarray  # (L,) int: candidate index i
    cost: np.ndarray  # (L,) float
    use: np.ndarray  # (L, d) float: resources used
    back: np.ndarray  # (L,) int: label index in the previous layer (-1 in layer 1)


def _pareto(cost: np.ndarray, use: np.ndarray) -> np.ndarray:
    """Indices of the labels no other label dominates (<= in cost and every resource)."""
    d = use.shape[1]
    order = np.lexsort((cost, *[use[:, k] for k in range(d - 1, -1, -1)]))
    if d == 1:
        c = cost[order]
        running = np.minimum.accumulate(c)
        keep = np.ones(len(c), dtype=bool)
        keep[1:] = c[1:] < running[:-1]
        return order[keep]
    # Sorted by the first resource (then the others, then cost): a label can only be dominated
    # by one before it, so a strictly lower triangle of pairwise comparisons decides.
    c, rest = cost[order], use[order, 1:]
    dominated = np.zeros(len(order), dtype=bool)
    for start in range(0, len(order), 512):
        stop = min(start + 512, len(order))
        le = (c[None, :stop] <= c[start:stop, None]) & np.all(
            rest[None, :stop, :] <= rest[start:stop, None, :], axis=2
        )
        le &= np.arange(stop)[None, :] < np.arange(start, stop)[:, None]
        dominated[start:stop] = le.any(axis=1)
    return order[~dominated]


def _backward(seg: np.ndarray, node_cost: np.ndarray, max_more: int) -> np.ndarray:
    """``out[r, i]``: least cost to go from "last chosen = i" to the maximum with <= r more sizes.

    Shape (max_more + 1, n); ``inf`` where the maximum cannot be reached.
    """
    n = seg.shape[1]
    later = np.triu(np.ones((n, n), dtype=bool), k=1)
    out = np.full((max_more + 1, n), np.inf)
    out[:, n - 1] = 0.0
    step = seg[1:, :] + node_cost[None, :]  # step[i, j]: choose j right after i
    for r in range(1, max_more + 1):
        options = np.where(later, step + out[r - 1][None, :], np.inf)
        out[r] = np.minimum(out[r - 1], options.min(axis=1))
    return out


def _lagrangian_incumbent(
    seg: np.ndarray, node_cost: np.ndarray, resources: np.ndarray, limits: np.ndarray, max_graphs: int
) -> tuple[list[int], float, float]:
    """A feasible list from pricing resources: (indices, cost, μ).

    Resources are priced at ``μ·use/limit`` per size, summed over the budgeted resources; μ is
    the smallest (to bisection precision) whose unconstrained optimum meets the budget.
    """
    scaled = resources / np.where(limits > 0, limits, 1.0)
    price = scaled.sum(axis=1)

    def solve(mu: float) -> tuple[list[int], bool]:
        chosen, _ = _dp_unconstrained(seg, node_cost + mu * price, max_graphs)
        return chosen, bool(np.all(resources[chosen].sum(axis=0) <= limits))

    scale = max(float(np.abs(seg).max()), float(np.abs(node_cost).max()), 1e-12)
    low, high = 0.0, scale
    chosen, ok = solve(high)
    for _ in range(60):
        if ok:
            break
        low, high = high, high * 4
        chosen, ok = solve(high)
    for _ in range(24):
        mid = (low + high) / 2
        trial, trial_ok = solve(mid)
        if trial_ok:
            high, chosen = mid, trial
        else:
            low = mid
    cost = float(seg[0, chosen[0]] + node_cost[chosen[0]])
    cost += sum(float(seg[a + 1, b] + node_cost[b]) for a, b in zip(chosen, chosen[1:]))
    return chosen, cost, high


def _dp_budgeted(
    seg: np.ndarray, node_cost: np.ndarray, resources: np.ndarray, limits: np.ndarray, max_graphs: int
) -> tuple[list[int], float]:
    """Exact DP under resource budgets (see plan_capture_sizes): (candidate indices, cost)."""
    incumbent, incumbent_cost, mu = _lagrangian_incumbent(seg, node_cost, resources, limits, max_graphs)
    scaled = resources / np.where(limits > 0, limits, 1.0)
    plain = _backward(seg, node_cost, max_graphs - 1)
    priced = _backward(seg, node_cost + mu * scaled.sum(axis=1), max_graphs - 1)
    found = _dp_pareto(seg, node_cost, resources, limits, max_graphs, plain, priced, mu, incumbent_cost)
    if found is not None and found[1] < incumbent_cost - _TIE_RTOL * abs(incumbent_cost):
        return found
    return incumbent, incumbent_cost


def _dp_pareto(
    seg: np.ndarray,
    node_cost: np.ndarray,
    resources: np.ndarray,
    limits: np.ndarray,
    max_graphs: int,
    plain: np.ndarray,
    priced: np.ndarray,
    mu: float,
    incumbent_cost: float,
) -> tuple[list[int], float] | None:
    """DP with Pareto labels over the budgeted resources, pruned against ``incumbent_cost``.

    Returns the best list strictly better than the incumbent, or None if there is none.
    """
    n = seg.shape[1]
    last = n - 1
    scaled_limits = np.where(limits > 0, limits, 1.0)
    cutoff = incumbent_cost - _TIE_RTOL * abs(incumbent_cost)

    def promising(k: int, nodes: np.ndarray, cost: np.ndarray, use: np.ndarray) -> np.ndarray:
        """Labels of layer k (k sizes chosen) whose best completion could beat the incumbent."""
        more = max_graphs - k
        left = ((limits[None, :] - use) / scaled_limits[None, :]).sum(axis=1)
        bound = np.maximum(plain[more, nodes], priced[more, nodes] - mu * left)
        return cost + bound < cutoff
    # A label ending at i < last must leave room for the maximum, which every list ends with.
    room = np.tile(limits, (n, 1))
    room[:last] -= resources[last]

    def feasible(nodes: np.ndarray, use: np.ndarray) -> np.ndarray:
        return np.all(use <= room[nodes], axis=1)

    nodes = np.arange(n)
    use = resources.copy()
    first = seg[0] + node_cost
    ok = feasible(nodes, use) & promising(1, nodes, first, use)
    layers = [_Layer(nodes[ok], first[ok], use[ok], np.full(int(ok.sum()), -1))]
    best: tuple[float, int, int] | None = None  # (cost, layer, label)

    def consider(k: int) -> None:
        nonlocal best
        layer = layers[k]
        at_last = np.flatnonzero(layer.node == last)
        if at_last.size:
            j = at_last[np.argmin(layer.cost[at_last])]
            c = float(layer.cost[j])
            if best is None or c < best[0] - _TIE_RTOL * abs(best[0]):
                best = (c, k, int(j))

    consider(0)
    for k in range(2, max_graphs + 1):
        prev = layers[-1]
        # Only labels that can still be extended: not at the maximum.
        ends = np.searchsorted(prev.node, np.arange(n), side="left")
        parts_node, parts_cost, parts_use, parts_back = [], [], [], []
        for i in range(1, n):
            m = ends[i]  # labels with node < i
            if m == 0:
                continue
            cost = prev.cost[:m] + seg[prev.node[:m] + 1, i] + node_cost[i]
            use = prev.use[:m] + resources[i]
            ok = np.all(use <= room[i], axis=1)
            ok &= promising(k, np.full(m, i), cost, use)
            if not ok.any():
                continue
            idx = np.flatnonzero(ok)
            keep = idx[_pareto(cost[idx], use[idx])]
            parts_node.append(np.full(keep.size, i))
            parts_cost.append(cost[keep])
            parts_use.append(use[keep])
            parts_back.append(keep)
        if not parts_node:
            break
        layers.append(
            _Layer(
                np.concatenate(parts_node),
                np.concatenate(parts_cost),
                np.concatenate(parts_use),
                np.concatenate(parts_back),
            )
        )
        consider(len(layers) - 1)
    if best is None:
        return None
    cost, k, label = best
    chosen = []
    while k >= 0:
        chosen.append(int(layers[k].node[label]))
        label = int(layers[k].back[label])
        k -= 1
    return chosen[::-1], cost
