"""Container probes (startup, readiness, liveness) run by the development node agent.

:func:`run_probe` performs one ``httpGet``/``tcpSocket``/``exec`` check against a container's
process (success: HTTP 200-399, a TCP connect, exit code 0). :class:`ProbeTracker` applies the
probe's timing fields with Kubernetes' defaults (``initialDelaySeconds`` 0, ``periodSeconds`` 10,
``timeoutSeconds`` 1, ``successThreshold`` 1, ``failureThreshold`` 3; see the Probe API
reference) and turns individual results into the probe's current verdict.
"""

from __future__ import annotations

import dataclasses
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence


def _port(value: int | str, container: Mapping) -> int:
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        return int(value)
    for port in container.get("ports") or []:
        if port.get("name") == value:
            return int(port["containerPort"])
    raise ValueError(f"probe port {value!r} is not a containerPort name of container {container['name']!r}")


def run_probe(probe: Mapping, container: Mapping, pod_ip: str, env: Mapping[str, str],
              cwd: str | None = None, exec_prefix: Sequence[str] = ()) -> tuple[bool, str]:
    """Run ``probe`` once; returns (success, a short message for failures).

    ``exec_prefix`` is prepended to an ``exec`` probe's command (to run it in the pod's network
    namespace, as the kubelet runs it in the container).
    """
    timeout = float(probe.get("timeoutSeconds") or 1)
    try:
        if "httpGet" in probe:
            spec = probe["httpGet"]
            scheme = (spec.get("scheme") or "HTTP").lower()
            host = spec.get("host") or pod_ip
            url = f"{scheme}://{host}:{_port(spec['port'], container)}{spec.get('path') or '/'}"
            request = urllib.request.Request(url, headers={h["name"]: h["value"] for h in spec.get("httpHeaders") or []})
            request.add_header("User-Agent", "kube-probe/graphserving-node-agent")
            context = None
            if scheme == "https":  # the kubelet does not verify probe certificates either
                context = ssl.create_default_context()
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            try:
                with urllib.request.urlopen(request, timeout=timeout, context=context) as resp:
                    code = resp.status
            except urllib.error.HTTPError as exc:
                code = exc.code
            return (200 <= code < 400), f"HTTP probe failed with statuscode: {code}"
        if "tcpSocket" in probe:
            spec = probe["tcpSocket"]
            with socket.create_connection((spec.get("host") or pod_ip, _port(spec["port"], container)),
                                          timeout=timeout):
                return True, ""
        if "exec" in probe:
            result = subprocess.run([*exec_prefix, *probe["exec"]["command"]], env=dict(env), cwd=cwd,
                                    capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
            output = (result.stdout + result.stderr).decode(errors="replace").strip()[-200:]
            return result.returncode == 0, f"exec probe exited {result.returncode}: {output}"
        if "grpc" in probe:
            return False, "grpc probes are not supported by the development node agent"
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        return False, f"probe error: {exc}"
    return False, "probe has no handler"


@dataclasses.dataclass
class ProbeTracker:
    """The state of one probe of one running container.

    ``verdict`` is None until the probe has reached a threshold, then True (success threshold
    reached) or False (failure threshold reached). ``due(now)`` says whether to run it now.
    """

    probe: Mapping
    started_at: float
    verdict: bool | None = None
    successes: int = 0
    failures: int = 0
    last_run: float | None = None
    last_message: str = ""

    def due(self, now: float) -> bool:
        if now < self.started_at + float(self.probe.get("initialDelaySeconds") or 0):
            return False
        period = float(self.probe.get("periodSeconds") or 10)
        return self.last_run is None or now >= self.last_run + period

    def record(self, success: bool, message: str, now: float | None = None) -> bool | None:
        """Count one result and return the (possibly new) verdict."""
        self.last_run = time.monotonic() if now is None else now
        if success:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= int(self.probe.get("successThreshold") or 1):
                self.verdict = True
        else:
            self.successes, self.failures = 0, self.failures + 1
            self.last_message = message
            if self.failures >= int(self.probe.get("failureThreshold") or 3):
                self.verdict = False
        return self.verdict
