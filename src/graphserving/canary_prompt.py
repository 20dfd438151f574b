"""``graphserving canary-prompt``: send one completion request to a GraphServing and check the answer.

The chart's ``helm test`` Pod runs it against a GraphServing's stable Service. It finds the
Service either through cluster DNS (``http://<service>.<namespace>.svc:<port>``, the normal path
through kube-proxy) or through the Service's EndpointSlices (a ready endpoint's address, for
clusters without Service routing such as the development node agent's), asks ``/v1/models`` for
the served model name unless one is given, and POSTs a greedy ``/v1/completions`` request.

Exit status: 0 when a completion with at least one generated token came back; 1 otherwise, with
one line naming the address and what went wrong. Only the standard library is needed for
``--resolve dns``; ``--resolve endpointslices`` uses the ``kubernetes`` client.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from typing import Any

from .contract.runtime_spec import API_KEY_ENV


class CanaryError(RuntimeError):
    """The canary prompt was not answered (the message names the address and the cause)."""


def dns_base_url(service: str, namespace: str, port: int, cluster_domain: str = "svc") -> str:
    """``http://<service>.<namespace>.<cluster_domain>:<port>`` (pure)."""
    return f"http://{service}.{namespace}.{cluster_domain}:{port}"


def ready_endpoint_urls(slices: Iterable[Mapping[str, Any]], port: int) -> list[str]:
    """Base URLs of the ready endpoints in ``slices`` (EndpointSlice objects as dicts, pure).

    The port is the slice port whose number equals ``port`` (the Service's target port may be
    named, so the stable Service's ``port`` and the container port are the same number here) or,
    failing that, the slice's only port. Endpoints with ``conditions.ready`` false are skipped.
    """
    urls: list[str] = []
    for s in slices:
        ports = [p.get("port") for p in s.get("ports") or [] if p.get("port")]
        if not ports:
            continue
        target = port if port in ports else (ports[0] if len(ports) == 1 else None)
        if target is None:
            continue
        for endpoint in s.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            for address in endpoint.get("addresses") or []:
                host = f"[{address}]" if ":" in address else address
                urls.append(f"http://{host}:{target}")
    return urls


def _endpointslice_urls(service: str, namespace: str, port: int) -> list[str]:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    api = client.DiscoveryV1Api()
    raw = api.list_namespaced_endpoint_slice(
        namespace, label_selector=f"kubernetes.io/service-name={service}", _preload_content=False
    )
    return ready_endpoint_urls(json.loads(raw.data).get("items") or [], port)


def _http(url: str, body: dict | None, timeout: float, api_key: str | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:500].decode(errors="replace")
        raise CanaryError(f"{url}: HTTP {exc.code}: {detail}") from exc
    except (urllib.error.URLError, OSError, json.JSONDecodeError) as exc:
        raise CanaryError(f"{url}: {exc}") from exc


def send_canary(base_url: str, prompt: str, max_tokens: int, model: str | None = None,
                timeout: float = 60.0, api_key: str | None = None) -> dict[str, Any]:
    """POST one greedy completion to ``base_url`` and return a summary; ``api_key``: sent as
    ``Authorization: Bearer`` (a worker started with an API key answers 401 without it).

    Returns ``{"url", "model", "text", "completion_tokens", "seconds"}``. Raises
    :class:`CanaryError` when the server does not answer, answers non-2xx, or returns no tokens.
    """
    if model is None:
        models = _http(f"{base_url}/v1/models", None, timeout, api_key).get("data") or []
        if not models:
            raise CanaryError(f"{base_url}/v1/models: no model is served")
        model = models[0]["id"]
    started = time.monotonic()
    answer = _http(f"{base_url}/v1/completions",
                   {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}, timeout, api_key)
    seconds = time.monotonic() - started
    choices = answer.get("choices") or []
    tokens = int((answer.get("usage") or {}).get("completion_tokens") or 0)
    if not choices or tokens < 1:
        raise CanaryError(f"{base_url}/v1/completions: no tokens in the answer: {json.dumps(answer)[:300]}")
    return {"url": base_url, "model": model, "text": choices[0].get("text", ""),
            "completion_tokens": tokens, "seconds": round(seconds, 3)}


def run(args: argparse.Namespace) -> int:
    try:
        if args.resolve == "dns":
            urls = [dns_base_url(args.service, args.namespace, args.port)]
        else:
            urls = _endpointslice_urls(args.service, args.namespace, args.port)
            if not urls:
                raise CanaryError(f"service {args.namespace}/{args.service} has no ready endpoint")
        errors = []
        for url in urls:
            try:
                result = send_canary(url, args.prompt, args.max_tokens, args.model, args.timeout,
                                     os.environ.get(API_KEY_ENV) or None)
            except CanaryError as exc:
                errors.append(str(exc))
                continue
            print(json.dumps({"ok": True, "service": f"{args.namespace}/{args.service}", "prompt": args.prompt, **result}))
            return 0
        raise CanaryError("; ".join(errors))
    except CanaryError as exc:
        print(f"canary prompt failed: {exc}", file=sys.stderr)
        return 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("canary-prompt", help="send one completion request to a GraphServing's Service (helm test)")
    p.add_argument("--service", required=True, help="the GraphServing's stable Service (its name)")
    p.add_argument("--namespace", default="default")
    p.add_argument("--port", type=int, default=8000, help="the Service port (spec.runtime.port)")
    p.add_argument("--resolve", choices=("dns", "endpointslices"), default="dns",
                   help="dns: <service>.<namespace>.svc; endpointslices: a ready endpoint of the Service")
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--model", default=None, help="model name; default: the first of /v1/models")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per HTTP request")
    p.description = f"The API key, when the workers need one, comes from ${API_KEY_ENV}."
    p.set_defaults(func=run)
