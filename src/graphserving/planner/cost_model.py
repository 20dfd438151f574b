"""Cost models for the planner: step time T(B, C) and per-graph costs M(C).

The planner's objective (docs/architecture.md, "Capture-size planner") needs, for a batch of ``B`` requests replayed in a
graph captured at size ``C >= B``:

- ``step_time(B, C)``: the time of one decode step;
- ``eager_step_time(B)``: the time of a step that runs eagerly (batches above the maximum);
- ``graph_memory_bytes(C)`` and ``capture_seconds(C)``: what one captured graph costs.

Two models implement that protocol:

- :class:`AnalyticCostModel`, the default when nothing was measured: T(B, C) = C row-times (a
  padded row costs as much as a real one, so the objective counts padded rows), and a linear
  per-graph memory and capture-time model whose defaults are documented on the class.
- :class:`MeasuredCostModel`, loaded from the JSON file the worker benchmark writes (format:
  :class:`CostModelFile`), interpolating between measured capture sizes.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

GIB = 1 << 30
MIB = 1 << 20


class CostModelError(ValueError):
    """A cost-model file that cannot be used."""


class CostModel(Protocol):
    """What the planner asks of a cost model. Sizes are in requests (rows)."""

    time_unit: str

    def step_time(self, batch_size: int, capture_size: int) -> float:
        """Time of one step of ``batch_size`` real rows replayed in the graph of ``capture_size``."""

    def eager_step_time(self, batch_size: int) -> float:
        """Time of one eager step of ``batch_size`` rows (no graph, no padding)."""

    def graph_memory_bytes(self, capture_size: int) -> float:
        """Device memory one captured graph of ``capture_size`` adds to the shared pool, bytes."""

    def capture_seconds(self, capture_size: int) -> float:
        """Wall-clock seconds to warm up and capture the graph of ``capture_size``."""


@dataclass(frozen=True)
class AnalyticCostModel:
    """The documented fallback when the worker benchmark has not measured anything.

    - Step time: ``T(B, C) = row_time * C`` and ``T_eager(B) = row_time * B``. Decode at small
      batch sizes is bound by reading the weights, yet a graph's replay does the full padded
      work, so with ``row_time = 1`` the objective is the expected number of rows computed per
      step, real plus padded. The time unit is then "rows".
    - Graph memory: ``M(C) = graph_fixed_bytes + graph_bytes_per_row * C``. The default 2 MiB per
      row is the heuristic SGLang reserves per batch-size unit of its graphs
      (docs/architecture.md, "Public facts behind the defaults"); the fixed part defaults to 0.
    - Capture time: ``capture_fixed_seconds + capture_seconds_per_row * C``. The defaults
      (0.15 s per graph plus 1 ms per row) put vLLM's default list up to 512 (51 graphs) at
      about 18 s, within the 5-20 s published for small and medium models.
    """

    row_time: float = 1.0
    graph_fixed_bytes: float = 0.0
    graph_bytes_per_row: float = 2.0 * MIB
    capture_fixed_seconds: float = 0.15
    capture_seconds_per_row: float = 0.001
    time_unit: str = "rows"

    def step_time(self, batch_size: int, capture_size: int) -> float:
        return self.row_time * capture_size

    def eager_step_time(self, batch_size: int) -> float:
        return self.row_time * batch_size

    def graph_memory_bytes(self, capture_size: int) -> float:
        return self.graph_fixed_bytes + self.graph_bytes_per_row * capture_size

    def capture_seconds(self, capture_size: int) -> float:
        return self.capture_fixed_seconds + self.capture_seconds_per_row * capture_size


class _Strict(BaseModel):
    # Python's json reads Infinity and NaN; a measured time or size is never either, and one
    # would make every objective infinite or NaN.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class MeasuredSize(_Strict):
    """One measured capture size."""

    capture_size: int = Field(..., ge=1, description="Padded batch size of the graph, requests.")
    step_seconds: float = Field(..., gt=0, description="Median replay time of one decode step, seconds.")
    graph_memory_bytes: float = Field(..., ge=0, description="Pool memory added by this graph, bytes.")
    capture_seconds: float = Field(..., ge=0, description="Warm-up plus capture time of this graph, seconds.")


class MeasuredEager(_Strict):
    """One measured eager batch size."""

    batch_size: int = Field(..., ge=1)
    step_seconds: float = Field(..., gt=0)


class CostModelFile(_Strict):
    """The JSON file the worker benchmark writes (``schema: graphserving.cost-model/v1``).

    Example::

        {"schema": "graphserving.cost-model/v1",
         "sizes": [{"capture_size": 1, "step_seconds": 0.0011,
                    "graph_memory_bytes": 2097152, "capture_seconds": 0.2}, ...],
         "eager": [{"batch_size": 1, "step_seconds": 0.009}, ...]}
    """

    schema_: Literal["graphserving.cost-model/v1"] = Field(..., alias="schema")
    sizes: list[MeasuredSize] = Field(..., min_length=1)
    eager: list[MeasuredEager] = Field(default_factory=list)

    @model_validator(mode="after")
    def _distinct(self) -> CostModelFile:
        sizes = [s.capture_size for s in self.sizes]
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"sizes: capture_size values must be distinct, got {sizes}")
        eager = [e.batch_size for e in self.eager]
        if len(set(eager)) != len(eager):
            raise ValueError(f"eager: batch_size values must be distinct, got {eager}")
        return self


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear interpolation through ``(xs, ys)`` (xs ascending, distinct).

    Between two measured points: the straight line through them. Below the smallest point: the
    smallest point's value (a step never gets cheaper than the smallest graph measured; launch
    and weight-read costs set a floor). Above the largest: the line through the last two points
    continued, never below the last value (cost grows with rows); with a single point, that
    value scaled by ``x / xs[0]`` (proportional to rows).
    """
    if len(xs) == 1:
        return ys[0] if x <= xs[0] else ys[0] * x / xs[0]
    if x <= xs[0]:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return ys[i]
    if i == len(xs):
        x0, x1, y0, y1 = xs[-2], xs[-1], ys[-2], ys[-1]
        return max(ys[-1], y1 + (y1 - y0) / (x1 - x0) * (x - x1))
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class MeasuredCostModel:
    """Step time and graph costs measured by the worker benchmark, interpolated (see
    :func:`interpolate`) for capture sizes that were not measured.

    ``T(B, C)`` is the measured replay time of the graph at ``C``: a replay does the same work
    whatever the number of real rows, so it depends on ``C`` only. ``T_eager(B)`` interpolates
    the measured eager times; without eager measurements it is the graph step time at ``B``
    (no padding, no launch saving: an optimistic bound for the fallback).
    """

    file: CostModelFile
    time_unit: str = "s"

    @classmethod
    def from_json(cls, path: str | Path) -> MeasuredCostModel:
        """Load a :class:`CostModelFile`.

        Raises:
            CostModelError: unreadable file, not UTF-8, invalid JSON, or a field that fails
                validation, an infinite or NaN number included (the message names it).
        """
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise CostModelError(f"cannot read cost model {str(path)!r}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise CostModelError(f"cost model {str(path)!r} is not UTF-8 text: {exc.reason}") from None
        except json.JSONDecodeError as exc:
            raise CostModelError(f"cost model {str(path)!r} is not JSON: {exc}") from None
        try:
            return cls(CostModelFile.model_validate(data))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(top level)"
            raise CostModelError(f"cost model {str(path)!r}: {where}: {first['msg']}") from None

    @cached_property
    def _columns(self) -> dict[str, tuple[list[float], list[float]]]:
        rows = sorted(self.file.sizes, key=lambda s: s.capture_size)
        xs = [float(r.capture_size) for r in rows]
        columns = {a: (xs, [float(getattr(r, a)) for r in rows]) for a in ("step_seconds", "graph_memory_bytes", "capture_seconds")}
        eager = sorted(self.file.eager, key=lambda e: e.batch_size)
        columns["eager"] = ([float(e.batch_size) for e in eager], [e.step_seconds for e in eager])
        return columns

    def _column(self, attr: str) -> tuple[list[float], list[float]]:
        return self._columns[attr]

    def step_time(self, batch_size: int, capture_size: int) -> float:
        return interpolate(*self._column("step_seconds"), capture_size)

    def eager_step_time(self, batch_size: int) -> float:
        if not self.file.eager:
            return self.step_time(batch_size, batch_size)
        return interpolate(*self._column("eager"), batch_size)

    def graph_memory_bytes(self, capture_size: int) -> float:
        return interpolate(*self._column("graph_memory_bytes"), capture_size)

    def capture_seconds(self, capture_size: int) -> float:
        return interpolate(*self._column("capture_seconds"), capture_size)
