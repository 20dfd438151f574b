"""The Gateway API's own standard-channel CRDs, from the ``sigs.k8s.io/gateway-api`` Go module.

The module zip of each release carries ``config/crd/standard/*.yaml``: the CRDs (GatewayClass,
Gateway, HTTPRoute, GRPCRoute, ReferenceGrant, BackendTLSPolicy, ListenerSet, TCP/TLS/UDPRoute)
and the ``safe-upgrades`` ValidatingAdmissionPolicy that keeps experimental or pre-v1.5 CRDs from
being applied over them, exactly what the project's ``standard-install.yaml`` installs. They are
fetched once with ``go mod download`` through the module proxy and copied to
``${GRAPHSERVING_CACHE_DIR:-~/.cache/graphserving}/gateway-api-<version>/``; the dev cluster
applies them at start (:func:`install`).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from graphserving.dev import binaries, resources

GATEWAY_API_MODULE = "sigs.k8s.io/gateway-api"
GATEWAY_API_VERSION = "v1.6.3"
#: Where the release's standard-channel manifests are inside its module zip.
STANDARD_DIR = "config/crd/standard"
CRD_KIND = "CustomResourceDefinition"


def crd_dir() -> Path:
    """The cached copy of the release's ``config/crd/standard`` (whether or not it exists yet)."""
    return binaries.cache_dir() / f"gateway-api-{GATEWAY_API_VERSION}"


def cached() -> bool:
    """Whether :func:`crd_dir` holds the manifests already."""
    return any(crd_dir().glob("*.yaml"))


def ensure_crds(log: Callable[[str], None] | None = None) -> Path:
    """The folder of the standard-channel manifests; downloads the module first when not cached.

    Raises :class:`~graphserving.dev.binaries.BinaryError` when Go or the module proxy is missing,
    or the module has no ``config/crd/standard`` (its layout changed).
    """
    target = crd_dir()
    if cached():
        return target
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    log(f"fetching the Gateway API {GATEWAY_API_VERSION} CRDs from the Go module proxy")
    workdir = binaries.cache_dir() / "gomod" / f"gateway-api-{GATEWAY_API_VERSION}"
    info = binaries.download_module(GATEWAY_API_MODULE, GATEWAY_API_VERSION, workdir)
    source = Path(info["Dir"]) / STANDARD_DIR
    manifests = sorted(source.glob("*.yaml"))
    if not manifests:
        raise binaries.BinaryError(f"{GATEWAY_API_MODULE}@{GATEWAY_API_VERSION} has no {STANDARD_DIR}/*.yaml "
                                   f"(looked in {source})")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    for manifest in manifests:
        shutil.copyfile(manifest, staging / manifest.name)  # the module cache is read-only: copy, not link
    os.chmod(staging, 0o755)
    if target.is_dir() and not cached():
        shutil.rmtree(target)  # an empty folder left by hand
    try:
        os.rename(staging, target)
    except OSError:  # another process cached it first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def documents(folder: Path | None = None) -> list[dict[str, Any]]:
    """Every object of the standard channel, CRDs first (file order), then the admission policy
    and its binding, so the policy never judges the CRDs it is installed with."""
    docs = []
    for manifest in sorted((folder or crd_dir()).glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(manifest.read_text()) if d]
    return sorted(docs, key=lambda d: d["kind"] != CRD_KIND)


def install(api: resources.Requester, deadline: float, folder: Path | None = None) -> list[str]:
    """Apply the standard channel and wait until every CRD is ``Established``; returns the CRD names.

    ``deadline`` is a :func:`time.monotonic` value. Raises
    :class:`~graphserving.dev.resources.ApplyError` when the API server refuses an object or a CRD
    is not established in time.
    """
    docs = documents(folder)
    if not docs:
        raise resources.ApplyError(f"no Gateway API manifests in {folder or crd_dir()}; run `graphserving dev build`")
    for doc in docs:
        resources.apply(api, doc)
    crds = [d for d in docs if d["kind"] == CRD_KIND]
    for crd in crds:
        resources.wait_condition(api, crd, "Established", deadline)
    return [c["metadata"]["name"] for c in crds]


def install_cached(api: resources.Requester, timeout: float = 60.0) -> list[str]:
    """:func:`install` from the cache, fetching the manifests first if needed (tests, scripts)."""
    return install(api, time.monotonic() + timeout, ensure_crds())
