"""The operator process: ``graphserving operator run`` (or ``python -m graphserving.operator run``).

Starts the ``/healthz`` + ``/metrics`` endpoint, waits to win the leader Lease (unless disabled),
then runs kopf (standalone: kopf's peering is not used) until stopped or until leadership is lost,
in which case it exits non-zero so that Kubernetes restarts it as a candidate.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import uuid

log = logging.getLogger("graphserving.operator")


def run(args: argparse.Namespace) -> int:
    import kopf
    from kubernetes import client

    from . import handlers
    from .kube import load_kube_config
    from .leader import LeaderElector
    from .metrics import OperatorMetrics, serve

    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    load_kube_config()
    metrics = OperatorMetrics()
    handlers.configure(metrics, workers=args.workers)
    stop = threading.Event()
    lost = threading.Event()
    elector: LeaderElector | None = None
    server = serve(
        metrics,
        args.metrics_port,
        lambda: {
            "ok": not lost.is_set(),
            "leader": elector.is_leader if elector else True,
            "reconciling": handlers.LOOP.started,
        },
        host=args.metrics_host,
    )
    log.info("serving /healthz and /metrics on %s:%d", args.metrics_host, server.server_address[1])
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    if args.leader_election:
        identity = f"{os.environ.get('POD_NAME') or socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        namespace = args.lease_namespace or os.environ.get("POD_NAMESPACE") or "default"
        elector = LeaderElector(client.CoordinationV1Api(), namespace, args.lease_name, identity)
        if not elector.acquire(stop):
            return 0
        metrics.leader.set(1)

        def on_lost() -> None:
            metrics.leader.set(0)
            lost.set()
            stop.set()

        threading.Thread(target=elector.keep_renewing, args=(stop, on_lost), name="lease-renew", daemon=True).start()
    else:
        metrics.leader.set(1)

    @kopf.on.cleanup()
    async def _release_stop_flag(**_: object) -> None:
        # kopf.run replaces the SIGTERM/SIGINT handlers above with its own and stops on its own
        # flag; without this, the lease thread keeps renewing and kopf's executor thread waiting
        # on ``stop`` keeps the process alive after a SIGTERM.
        stop.set()

    namespaces = args.namespace or []
    try:
        kopf.run(
            standalone=True,
            clusterwide=not namespaces,
            namespaces=namespaces,
            stop_flag=stop,
        )
    finally:
        if elector is not None and not lost.is_set():
            elector.release()
        server.shutdown()
    return 1 if lost.is_set() else 0


def print_crd(args: argparse.Namespace) -> int:
    from .crd import render, render_json_schema

    sys.stdout.write(render_json_schema() if args.json_schema else render())
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("operator", help="the GraphServing operator")
    ops = parser.add_subparsers(dest="operator_command", required=True)
    r = ops.add_parser("run", help="run the operator against the current kubeconfig / in-cluster API")
    r.add_argument("-n", "--namespace", action="append", help="watch only this namespace (repeatable); default: all")
    r.add_argument("--metrics-port", type=int, default=int(os.environ.get("GRAPHSERVING_METRICS_PORT", "8080")),
                   help="port of /healthz and /metrics (0: any free port)")
    r.add_argument("--metrics-host", default="0.0.0.0")
    r.add_argument("--leader-election", action=argparse.BooleanOptionalAction, default=True)
    r.add_argument("--lease-name", default="graphserving-operator")
    r.add_argument("--lease-namespace", default=None, help="default: $POD_NAMESPACE or 'default'")
    r.add_argument("--workers", type=int, default=4, help="concurrent reconciles")
    r.add_argument("--log-level", default="info")
    r.set_defaults(func=run)
    c = ops.add_parser("crd", help="print the generated GraphServing CRD (YAML)")
    c.add_argument("--json-schema", action="store_true",
                   help="print the JSON Schema of GraphServing manifests instead (editors, kubeconform)")
    c.set_defaults(func=print_crd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphserving-operator")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["operator", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
