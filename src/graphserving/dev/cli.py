"""``graphserving dev``: build the control-plane binaries and run a local cluster.

    graphserving dev build                 # build or reuse etcd, kube-*, kubectl, helm, kwok, promtool,
                                           # prometheus, traefik; fetch the Gateway API CRDs
    graphserving dev cluster up            # control plane + local node + Gateway API CRDs + gateway
                                           # (Traefik) + Prometheus; returns when ready
    eval "$(graphserving dev cluster env)" # KUBECONFIG, PATH (kubectl, helm), gateway and Prometheus URLs
    graphserving dev cluster status
    graphserving dev logs POD [-n NS] [-c CONTAINER] [-f]
    graphserving dev cluster down          # stop everything, remove the state directory
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from graphserving.dev import binaries, cluster, gateway, gateway_api, prometheus


def _state_dir(args: argparse.Namespace) -> Path:
    return Path(args.state_dir) if args.state_dir else cluster.default_state_dir(args.name)


def cmd_build(args: argparse.Namespace) -> int:
    components = args.components or list(binaries.ALL_COMPONENTS)
    started = time.monotonic()
    try:
        report = binaries.ensure_binaries(components, jobs=args.jobs)
        if not args.components:
            crds = gateway_api.ensure_crds()
            print(f"{'gateway-api CRDs':<24} {gateway_api.GATEWAY_API_VERSION:<9} {'cached':<16} {crds}")
    except (binaries.BinaryError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name, path in report.paths.items():
        how = f"built in {report.built[name]:.0f}s" if name in report.built else "cached"
        print(f"{name:<24} {binaries.component_version(name):<9} {how:<16} {path}")
    print(f"binaries ready in {time.monotonic() - started:.0f}s", file=sys.stderr)
    return 0


def up_components(args: argparse.Namespace) -> list[str]:
    """The binaries ``cluster up`` runs with these flags: the control plane, traefik, prometheus."""
    wanted = ["etcd", *binaries.KUBERNETES_COMPONENTS]
    if not args.no_gateway:
        wanted.append("traefik")
    if not args.no_prometheus:
        wanted.append("prometheus")
    return wanted


def cmd_up(args: argparse.Namespace) -> int:
    state_dir = _state_dir(args)
    started = time.monotonic()
    args.no_gateway = args.no_gateway or args.no_gateway_api  # no CRDs: nothing for a gateway to serve
    wanted = up_components(args)
    missing = binaries.missing_components(wanted)
    if missing and not args.build:
        print(f"error: not built: {', '.join(missing)}; run `graphserving dev build`, or pass --build "
              "(or --no-gateway / --no-prometheus to start without them)", file=sys.stderr)
        return 1
    local = None
    try:
        if args.build:
            binaries.ensure_binaries(wanted)
        local = cluster.LocalCluster(state_dir, node_name=None if args.no_node else args.node_name,
                                     gateway_api=not args.no_gateway_api)
        local.start(timeout=args.timeout)
        gw = None if args.no_gateway else gateway.Gateway(local).start()
        if not args.no_prometheus:
            gateway_metrics = gw.admin_url.removeprefix("http://") if gw else None
            prometheus.Prometheus(local, gateway_metrics=gateway_metrics).start()
    except (cluster.ClusterError, binaries.BinaryError) as exc:
        if local is not None:
            local.stop()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"cluster up in {time.monotonic() - started:.1f}s: {local.server}", file=sys.stderr)
    print(f"  kubeconfig: {local.kubeconfig}", file=sys.stderr)
    for name, url in local.endpoints.items():
        print(f"  {name}: {url}", file=sys.stderr)
    print(f'  eval "$(graphserving dev cluster env{_name_flag(args)})"  # then: kubectl get nodes', file=sys.stderr)
    return 0


def _name_flag(args: argparse.Namespace) -> str:
    if args.state_dir:
        return f" --state-dir {shlex.quote(str(args.state_dir))}"
    return f" --name {args.name}" if args.name != "default" else ""


def env_lines(state_dir: Path) -> list[str]:
    """Shell lines exporting KUBECONFIG and a PATH with the matching kubectl and helm."""
    dirs = []
    for component in ("kubectl", "helm", "kwok"):
        path = binaries.binary_path(component)
        if path is not None and str(path.parent) not in dirs:
            dirs.append(str(path.parent))
    lines = [f"export KUBECONFIG={shlex.quote(str(state_dir / 'admin.kubeconfig'))}"]
    endpoints = cluster.read_state(state_dir).get("endpoints") or {}
    for name, url in sorted(endpoints.items()):
        lines.append(f"export GRAPHSERVING_{name.upper()}_URL={shlex.quote(url)}")
    if dirs:
        lines.append(f"export PATH={shlex.quote(':'.join(dirs))}:\"$PATH\"")
    return lines


def cmd_env(args: argparse.Namespace) -> int:
    state_dir = _state_dir(args)
    if not (state_dir / "admin.kubeconfig").exists():
        print(f"error: no cluster in {state_dir}; run `graphserving dev cluster up`", file=sys.stderr)
        return 1
    if not any(r.name == "kube-apiserver" for r in cluster.running_processes(state_dir)):
        # a failed or stopped `up` leaves its kubeconfig: exporting it would point kubectl at nothing
        print(f"error: the cluster in {state_dir} is not running (no kube-apiserver process); "
              "see `graphserving dev cluster status`, or run `graphserving dev cluster up`", file=sys.stderr)
        return 1
    print("\n".join(env_lines(state_dir)))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    state_dir = _state_dir(args)
    state = cluster.read_state(state_dir)
    if not state:
        print(f"no cluster in {state_dir}")
        return 1
    alive = {(r.name, r.pid) for r in cluster.running_processes(state_dir)}
    print(f"state dir: {state_dir}\nserver:    {state.get('server')}\nkubeconfig: {state.get('kubeconfig')}")
    for name, url in (state.get("endpoints") or {}).items():
        print(f"{name + ':':<11}{url}")
    for record in state.get("processes", []):
        mark = "running" if (record["name"], record["pid"]) in alive else "stopped"
        print(f"  {record['name']:<24} pid {record['pid']:<8} {mark:<8} log {record['log']}")
    network = state.get("pod_network") or {}
    if network.get("namespaced"):
        print(f"pod network: {network['subnet']} in namespace {network['netns']} (veth {network['interface']}, "
              f"host end {network['gateway']}); pods reach the API server at {network['apiserver']}")
    elif network.get("subnet"):
        print(f"pod network: {network['subnet']} on loopback (Services get no endpoints)")
    pods = [r for r in cluster.running_processes(state_dir) if not r.log]
    if pods:
        print(f"  {len(pods)} pod process(es) running")
    if args.json:
        print(json.dumps(state, indent=2))
    return 0 if any(name == "kube-apiserver" for name, _ in alive) else 1


def cmd_down(args: argparse.Namespace) -> int:
    state_dir = _state_dir(args)
    if not state_dir.exists():
        print(f"no cluster in {state_dir}", file=sys.stderr)
        return 0
    killed = cluster.stop_state_dir(state_dir, remove=not args.keep)
    left = cluster.running_processes(state_dir) if args.keep else []
    if killed:
        print(f"had to SIGKILL: {', '.join(killed)}", file=sys.stderr)
    if left:
        print(f"error: still running: {', '.join(f'{r.name}({r.pid})' for r in left)}", file=sys.stderr)
        return 1
    print(f"cluster in {state_dir} stopped", file=sys.stderr)
    return 0


def pod_log_path(state_dir: Path, pod: str, namespace: str, container: str | None) -> Path:
    """The log file of ``container`` (or the pod's only/first container) of the newest pod named ``pod``."""
    candidates = sorted((state_dir / "node" / "pods").glob(f"{namespace}_{pod}_*"),
                        key=lambda p: p.stat().st_mtime, reverse=True)
    if not candidates:
        raise FileNotFoundError(f"no pod {namespace}/{pod} has run on the local node (looked in "
                                f"{state_dir / 'node' / 'pods'})")
    logs = sorted(candidates[0].glob("*.log"))
    if container:
        path = candidates[0] / f"{container}.log"
        if not path.exists():
            raise FileNotFoundError(f"pod {namespace}/{pod} has no container {container!r}; "
                                    f"logs: {', '.join(p.stem for p in logs)}")
        return path
    if not logs:
        raise FileNotFoundError(f"pod {namespace}/{pod} has no container logs yet in {candidates[0]}")
    return logs[0]


def cmd_logs(args: argparse.Namespace) -> int:
    try:
        path = pod_log_path(_state_dir(args), args.pod, args.namespace, args.container)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    with open(path, errors="replace") as fh:
        sys.stdout.write(fh.read())
        while args.follow:
            chunk = fh.read()
            if chunk:
                sys.stdout.write(chunk)
                sys.stdout.flush()
            else:
                time.sleep(0.5)
    return 0


def _state_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default="default", help="cluster name (state under the cache dir)")
    parser.add_argument("--state-dir", help="explicit state directory (overrides --name)")


def add_parser(subparsers) -> None:
    dev = subparsers.add_parser("dev", help="local control plane for development and tests",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = dev.add_subparsers(dest="dev_command", required=True)

    build = sub.add_parser("build", help="build or reuse the pinned binaries (Go toolchain + module proxy)")
    build.add_argument("components", nargs="*", help=f"subset of: {', '.join(binaries.ALL_COMPONENTS)} (default: all)")
    build.add_argument("-j", "--jobs", type=int, default=binaries.DEFAULT_BUILD_JOBS, help="go build -p")
    build.set_defaults(func=cmd_build)

    cl = sub.add_parser("cluster", help="start/stop the local control plane")
    csub = cl.add_subparsers(dest="cluster_command", required=True)
    up = csub.add_parser("up", help="start etcd, kube-apiserver, controller-manager, scheduler, a local node, "
                                    "the gateway and Prometheus")
    _state_flags(up)
    up.add_argument("--node-name", default=cluster.DEFAULT_NODE_NAME)
    up.add_argument("--no-node", action="store_true", help="control plane only, no node agent")
    up.add_argument("--no-gateway", action="store_true", help="no gateway (Traefik)")
    up.add_argument("--no-prometheus", action="store_true", help="no Prometheus")
    up.add_argument("--no-gateway-api", action="store_true",
                    help="do not install the Gateway API CRDs (implies --no-gateway)")
    up.add_argument("--build", action="store_true", help="build missing binaries first")
    up.add_argument("--timeout", type=float, default=cluster.DEFAULT_START_TIMEOUT)
    up.set_defaults(func=cmd_up)
    for name, func, text in (("down", cmd_down, "stop every process of the cluster"),
                             ("env", cmd_env, "print export lines for KUBECONFIG and PATH"),
                             ("status", cmd_status, "show the cluster's processes")):
        p = csub.add_parser(name, help=text)
        _state_flags(p)
        p.set_defaults(func=func)
    csub.choices["down"].add_argument("--keep", action="store_true", help="keep the state directory (logs)")
    csub.choices["status"].add_argument("--json", action="store_true")

    logs = sub.add_parser("logs", help="print a pod's container log from the local node")
    _state_flags(logs)
    logs.add_argument("pod")
    logs.add_argument("-n", "--namespace", default="default")
    logs.add_argument("-c", "--container")
    logs.add_argument("-f", "--follow", action="store_true")
    logs.set_defaults(func=cmd_logs)
