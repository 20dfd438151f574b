"""Graph modes and capture sizes: the part of the graph policy both sides must agree on.

The worker resolves its capture sizes with :func:`resolve_capture_sizes`; the operator uses
the same function to validate a GraphServing before it renders worker configuration, so a list
that the worker would refuse is refused at the API already.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence


class GraphMode(str, enum.Enum):
    """Which forward passes are replayed from CUDA graphs (names as vLLM uses them).

    - ``NONE``: everything runs eagerly.
    - ``PIECEWISE``: for every batch up to the largest token capture size, the segments between
      attention calls are replayed from graphs keyed by padded token count; attention runs eagerly
      between them (so prefill and mixed batches avoid most launches too).
    - ``FULL``: uniform-decode batches (every request has query length 1) replay one graph for the
      whole forward pass, keyed by padded request count; all other batches run eagerly.
    - ``FULL_DECODE_ONLY``: same graphs as ``FULL``; named for configurations that want to state
      that prefill never uses graphs.
    - ``FULL_AND_PIECEWISE``: full graphs for uniform decode, piecewise graphs for everything
      else up to the largest token capture size; the default of a GPU worker.
    """

    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"

    @property
    def has_full(self) -> bool:
        return self in (GraphMode.FULL, GraphMode.FULL_DECODE_ONLY, GraphMode.FULL_AND_PIECEWISE)

    @property
    def has_piecewise(self) -> bool:
        return self in (GraphMode.PIECEWISE, GraphMode.FULL_AND_PIECEWISE)


class CaptureSizeError(ValueError):
    """A capture-size list that the scheduler limits cannot honour."""


def default_capture_sizes(maximum: int) -> list[int]:
    """The default capture-size grid, cut at ``maximum`` and always ending at ``maximum``.

    Grid: ``[1, 2, 4]``, then steps of 8 up to 256, then steps of 16 (the grid vLLM ships,
    see docs/architecture.md, "Public facts behind the defaults"), plus ``maximum`` itself when it is off the grid.

    Raises:
        CaptureSizeError: ``maximum`` < 1.
    """
    if maximum < 1:
        raise CaptureSizeError(f"capture-size maximum must be >= 1, got {maximum}")
    grid = [1, 2, 4, *range(8, 257, 8), *range(272, max(maximum, 272) + 1, 16)]
    sizes = [s for s in grid if s <= maximum]
    if sizes[-1] != maximum:
        sizes.append(maximum)
    return sizes


def default_piecewise_capture_sizes(maximum: int) -> list[int]:
    """The default piecewise (token-count) grid: powers of two below ``maximum``, then ``maximum``.

    Piecewise graphs are captured once per segment (number of layers + 1 graphs per size), so the
    grid is coarser than the full-graph grid: padding a prefill chunk to the next power of two
    wastes at most half of a pass whose cost is dominated by its largest matrix products.

    Raises:
        CaptureSizeError: ``maximum`` < 1.
    """
    if maximum < 1:
        raise CaptureSizeError(f"capture-size maximum must be >= 1, got {maximum}")
    sizes = []
    size = 1
    while size < maximum:
        sizes.append(size)
        size *= 2
    return [*sizes, maximum]


def resolve_capture_sizes(
    explicit: Sequence[int] | None,
    maximum: int,
    *,
    what: str = "max_num_seqs",
    default=default_capture_sizes,
) -> list[int]:
    """The capture sizes a worker captures, given an explicit list (or None) and its maximum.

    Args:
        explicit: user-given sizes (must be strictly increasing, each >= 1), or None for
            ``default(maximum)``.
        maximum: the scheduler maximum this list serves (``max_num_seqs`` for full decode
            graphs, in requests; ``max_num_batched_tokens`` for piecewise graphs, in tokens).
            It is always captured.
        what: the name of the maximum, used in error messages.
        default: the grid used when ``explicit`` is None (:func:`default_capture_sizes` or
            :func:`default_piecewise_capture_sizes`).

    Returns:
        A strictly increasing list ending at ``maximum``.

    Raises:
        CaptureSizeError: the list is empty, not strictly increasing, has a size < 1, or has a
            size above ``maximum`` (the list and the maximum contradict each other; nothing is
            silently truncated). The message names both values.
    """
    if explicit is None:
        return default(maximum)
    sizes = list(explicit)
    if not sizes:
        raise CaptureSizeError("capture sizes must not be empty (omit them for the defaults)")
    for i, size in enumerate(sizes):
        if size < 1:
            raise CaptureSizeError(f"capture sizes must be >= 1, got {size} at index {i}")
        if i and size <= sizes[i - 1]:
            raise CaptureSizeError(
                f"capture sizes must be strictly increasing, got {sizes[i - 1]} then {size}"
            )
    if sizes[-1] > maximum:
        raise CaptureSizeError(
            f"capture size {sizes[-1]} exceeds {what}={maximum}: a batch can never reach it; "
            f"lower the capture size or raise {what}"
        )
    if sizes[-1] != maximum:
        sizes.append(maximum)
    return sizes
