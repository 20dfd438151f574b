"""Helpers for the chart tests: find helm and kubectl, render the chart, read its objects."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from graphserving.dev import binaries

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "graphserving"
#: helm template checks the chart's kubeVersion against this (the test control plane's release).
KUBE_VERSION = binaries.KUBERNETES_VERSION.lstrip("v")


def tool(component: str) -> Path:
    """The cached binary of ``component`` (helm, kubectl); skips (or fails under
    ``GRAPHSERVING_REQUIRE_CLUSTER``) when it is not built."""
    path = binaries.binary_path(component)
    if path is None:
        message = f"{component} is not built: run `graphserving dev build {component}`"
        if os.environ.get("GRAPHSERVING_REQUIRE_CLUSTER", "").lower() not in ("", "0", "false", "no"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return path


def run_helm(*args: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``helm ARGS`` with its own config/cache dirs under the test's environment (or ``env``)."""
    proc = subprocess.run([str(tool("helm")), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def render_text(*set_args: str, release: str = "graphserving", namespace: str = "graphserving-system",
                values: Path | None = None) -> str:
    """``helm template`` of the chart with ``--set`` arguments; the YAML text."""
    args = ["template", release, str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION]
    for s in set_args:
        args += ["--set", s]
    if values is not None:
        args += ["--values", str(values)]
    return run_helm(*args).stdout


def render(*set_args: str, **kwargs: Any) -> list[dict[str, Any]]:
    """The rendered objects (``helm template``), in output order."""
    return [d for d in yaml.safe_load_all(render_text(*set_args, **kwargs)) if d]


def find(objects: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def load_sync_module():
    """charts/sync_generated.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("sync_generated", REPO / "charts" / "sync_generated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
