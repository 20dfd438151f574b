"""Kubernetes Events from the operator (core/v1, so ``kubectl describe`` shows them)."""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
from collections.abc import Mapping
from typing import Any

from kubernetes import client

COMPONENT = "graphserving-operator"
log = logging.getLogger(__name__)


def involved(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata") or {}
    return {
        "apiVersion": obj.get("apiVersion"),
        "kind": obj.get("kind"),
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
        "uid": meta.get("uid"),
        "resourceVersion": meta.get("resourceVersion"),
    }


def event_body(obj: Mapping[str, Any], type_: str, reason: str, message: str, now: dt.datetime) -> dict[str, Any]:
    stamp = now.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    meta = obj.get("metadata") or {}
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta.get('name')}.", "namespace": meta.get("namespace")},
        "involvedObject": involved(obj),
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": os.environ.get("POD_NAME") or socket.gethostname(),
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def post(core: client.CoreV1Api, obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    """Create an Event about ``obj``; failures are logged, never raised (events are best effort)."""
    body = event_body(obj, type_, reason, message, dt.datetime.now(dt.timezone.utc))
    try:
        core.create_namespaced_event(body["metadata"]["namespace"], body)
    except Exception as exc:  # an Event must never break a reconcile
        log.warning("could not post event %s/%s: %s", reason, message, exc)
