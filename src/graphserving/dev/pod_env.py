"""A container's environment as the kubelet computes it (the subset the node agent supports).

Supported: ``env[].value`` with ``$(VAR)`` expansion, ``valueFrom.fieldRef`` (the downward API:
``metadata.name``, ``metadata.namespace``, ``metadata.uid``, ``metadata.labels['k']``,
``metadata.annotations['k']``, ``spec.nodeName``, ``spec.serviceAccountName``, ``status.podIP``,
``status.podIPs``, ``status.hostIP``, ``status.hostIPs``), ``valueFrom.resourceFieldRef``
(limits/requests of cpu, memory, ephemeral-storage, defaulting to the node's allocatable when no
limit is set, as the kubelet does), ``valueFrom.configMapKeyRef`` / ``secretKeyRef`` and
``envFrom``. Service links (``FOO_SERVICE_HOST``...) are not generated.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Callable, Mapping
from decimal import Decimal

from kubernetes.utils.quantity import parse_quantity


class EnvError(ValueError):
    """A container's env cannot be resolved; the message names the variable and what is wrong."""


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined ``$(VAR)`` is replaced, ``$$`` gives ``$``,
    undefined references are left as written (``k8s.io/kubernetes/third_party/forked/golang/expansion``)."""
    def repl(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)
    return _REF.sub(repl, value)


_FIELD_INDEX = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")


def field_ref(pod: Mapping, path: str) -> str:
    """Value of a downward-API ``fieldRef.fieldPath`` for ``pod`` (a Pod as a dict)."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", "") or "default",
        "status.podIP": status.get("podIP", ""),
        "status.hostIP": status.get("hostIP", ""),
        "status.podIPs": ",".join(ip["ip"] for ip in status.get("podIPs") or []),
        "status.hostIPs": ",".join(ip["ip"] for ip in status.get("hostIPs") or []),
    }
    if path in simple:
        return simple[path]
    match = _FIELD_INDEX.fullmatch(path)
    if match:
        return (meta.get(match.group(1)) or {}).get(match.group(2), "")
    raise EnvError(f"fieldRef.fieldPath {path!r} is not supported")


def resource_ref(container: Mapping, resource: str, divisor: str | None,
                 allocatable: Mapping[str, str]) -> str:
    """Value of ``resourceFieldRef``: the quantity divided by ``divisor``, rounded up (kubelet rule)."""
    kind, _, name = resource.partition(".")
    if kind not in ("limits", "requests") or name not in ("cpu", "memory", "ephemeral-storage"):
        raise EnvError(f"resourceFieldRef.resource {resource!r} is not supported")
    resources = container.get("resources") or {}
    quantity = (resources.get(kind) or {}).get(name)
    if quantity is None:
        quantity = allocatable.get(name, "0") if kind == "limits" else "0"
    value = parse_quantity(str(quantity)) / parse_quantity(divisor or "1")
    return str(int(math.ceil(Decimal(value))))


def resolve_env(
    pod: Mapping, container: Mapping, allocatable: Mapping[str, str],
    get_config_map: Callable[[str], Mapping[str, str] | None],
    get_secret: Callable[[str], Mapping[str, str] | None],
) -> dict[str, str]:
    """The env of ``container`` in ``pod``: envFrom first, then env in order (later wins).

    ``get_config_map(name)`` / ``get_secret(name)`` return the object's ``data`` (secrets still
    base64-encoded) or None if it does not exist. Raises :class:`EnvError` naming the variable
    for a missing non-optional reference or an unsupported field.
    """
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            ref, data, decode = source["configMapRef"], get_config_map(source["configMapRef"]["name"]), False
        elif "secretRef" in source:
            ref, data, decode = source["secretRef"], get_secret(source["secretRef"]["name"]), True
        else:
            continue
        if data is None:
            if ref.get("optional"):
                continue
            raise EnvError(f"envFrom: {ref['name']!r} not found")
        for key, value in data.items():
            env[prefix + key] = base64.b64decode(value).decode() if decode else value
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[name] = field_ref(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            target = container
            if ref.get("containerName"):
                target = next((c for c in pod["spec"]["containers"] if c["name"] == ref["containerName"]), None)
                if target is None:
                    raise EnvError(f"env {name}: resourceFieldRef.containerName {ref['containerName']!r} not in pod")
            env[name] = resource_ref(target, ref["resource"], ref.get("divisor"), allocatable)
        elif "configMapKeyRef" in source or "secretKeyRef" in source:
            is_secret = "secretKeyRef" in source
            ref = source["secretKeyRef" if is_secret else "configMapKeyRef"]
            data = (get_secret if is_secret else get_config_map)(ref["name"])
            if data is None or ref["key"] not in data:
                if ref.get("optional"):
                    continue
                kind = "secret" if is_secret else "configmap"
                raise EnvError(f"env {name}: {kind} {ref['name']!r} key {ref['key']!r} not found")
            env[name] = base64.b64decode(data[ref["key"]]).decode() if is_secret else data[ref["key"]]
        else:
            raise EnvError(f"env {name}: unsupported valueFrom {sorted(source)}")
    return env


def command_line(container: Mapping, env: Mapping[str, str]) -> list[str]:
    """``command`` + ``args`` with ``$(VAR)`` expanded; the image's entrypoint is unknown here."""
    command = list(container.get("command") or [])
    if not command:
        raise EnvError(f"container {container['name']!r} has no command: the development node agent "
                       "runs commands on this machine and cannot use an image's entrypoint")
    return [expand(part, env) for part in command + list(container.get("args") or [])]
