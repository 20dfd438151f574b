"""Fault injection for tests: the hooks the lifecycle's capture and canary phases call per key.

``GRAPHSERVING_FAULT_INJECT_CAPTURE`` and ``GRAPHSERVING_FAULT_INJECT_CANARY`` name graph keys by
label (comma-separated) or ``all``; the worker command reads them (runtime/worker.py) and passes
the hooks to ``WorkerLifecycle``. Never set in production: a warning says so at start-up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


def injected_fault(variable: str, environ) -> Callable | None:
    """The hook ``environ[variable]`` asks for: None when unset or empty; else a function of a graph
    key that raises RuntimeError for the keys named (labels, comma-separated, or ``all``)."""
    value = environ.get(variable, "").strip()
    if not value:
        return None
    labels = {v.strip() for v in value.split(",")}

    def fault(key) -> None:
        if "all" in labels or key.label() in labels:
            raise RuntimeError(f"injected failure for {key.label()} ({variable})")

    log.warning("%s is set: failing %s on purpose (testing only)", variable, ", ".join(sorted(labels)))
    return fault
