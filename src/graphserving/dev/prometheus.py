"""The dev cluster's Prometheus: Kubernetes service discovery against the local API server.

Prometheus (``binaries.PROMETHEUS_VERSION``, ``cmd/prometheus`` built from its Go module) finds
Pods with ``kubernetes_sd_configs`` (role ``pod``) as ``graphserving-dev:prometheus`` (a client
certificate, RBAC in ``prometheus-rbac.yaml``) and scrapes them at their pod addresses with the
jobs of ``prometheus-scrape.yaml``: the chart's PodMonitor for the workers and its
ServiceMonitor for the operator, rewritten as relabelling rules. The gateway's Traefik metrics
are a static target when a gateway runs. Processes that run outside Pods (an operator started by
the demo or a test) are added while Prometheus runs (:meth:`Prometheus.add_target`: a file that
the job ``local-processes`` reads through ``file_sd_configs``). It listens on a loopback port only
(:attr:`Prometheus.url`: the HTTP API, e.g. ``/api/v1/query``) and keeps its TSDB in
``<state>/prometheus/data``.

The shipped Grafana dashboards' queries run here as they would in Grafana:
:func:`dashboard_queries` reads every panel target of a dashboard file and :func:`grafana_expr`
substitutes its variables (``$namespace``, ``${graphserving}``, ``$__rate_interval``, ...), so the
demo and the live dashboard test (tests/operator/test_dashboards_live.py) query what the panels do.

The default scrape interval and timeout are the chart's ``podMonitor`` values (15 s and 10 s,
charts/graphserving/values.yaml); tests pass shorter ones.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from importlib import resources as package_files
from pathlib import Path
from typing import Any

import yaml

from graphserving.dev import binaries, cluster, resources
from graphserving.dev.ports import free_port

DEFAULT_SCRAPE_INTERVAL = "15s"
DEFAULT_SCRAPE_TIMEOUT = "10s"
DEFAULT_START_TIMEOUT = 90.0
#: The job of the targets added with :meth:`Prometheus.add_target`.
LOCAL_JOB = "local-processes"
#: Values of Grafana's built-in interval variables for a query sent to Prometheus directly: a rate
#: window of one minute holds four or more scrapes at the dev cluster's intervals (1-15 s) and
#: still covers a workload that ended seconds ago.
GRAFANA_INTERVALS = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m"}
#: Grafana's variable syntaxes: ``$name``, ``${name}``, ``${name:format}``, ``[[name]]``.
_VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]|\$(\w+)")


@dataclasses.dataclass(frozen=True)
class PanelQuery:
    """One target of a dashboard panel: its PromQL ``expr`` as written in the dashboard (with
    Grafana variables) and the target's ``legend`` (``legendFormat``, ``{{label}}`` templates)."""

    dashboard: str
    panel: str
    ref_id: str
    expr: str
    legend: str = ""

    def legend_for(self, labels: Mapping[str, str]) -> str:
        """The legend of one series: ``{{label}}`` replaced by its value (``__auto``: the labels)."""
        if self.legend in ("", "__auto"):
            return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or self.panel
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), self.legend)


def dashboard_queries(path: Path) -> list[PanelQuery]:
    """Every panel target with an ``expr`` in the Grafana dashboard file ``path``, in panel order
    (panels nested in rows included).

    Raises ``OSError`` or ``ValueError`` (``json.JSONDecodeError``) for an unreadable file.
    """
    board = json.loads(Path(path).read_text())
    title = board.get("title") or Path(path).stem
    panels = [p for top in board.get("panels", []) for p in [top, *top.get("panels", [])]]
    return [PanelQuery(title, panel.get("title", ""), target.get("refId", ""), target["expr"],
                       target.get("legendFormat", ""))
            for panel in panels for target in panel.get("targets", []) if target.get("expr")]


def panel_query(queries: list[PanelQuery], panel: str, ref_id: str | None = None) -> PanelQuery:
    """The target ``ref_id`` (default: the first) of the panel titled ``panel``.

    Raises ``KeyError`` naming the panel and the titles there are."""
    for query in queries:
        if query.panel == panel and ref_id in (None, query.ref_id):
            return query
    raise KeyError(f"no panel {panel!r} with target {ref_id or 'any'} among {sorted({q.panel for q in queries})}")


def grafana_expr(expr: str, variables: Mapping[str, str]) -> str:
    """``expr`` with its Grafana variables replaced: ``variables`` (e.g. ``namespace``, which a
    multi-value variable would give as a regex such as ``a|b``) over :data:`GRAFANA_INTERVALS`.

    Raises ``ValueError`` naming a variable that has no value (the query would reach Prometheus
    with a ``$`` in it, which it refuses).
    """
    values = {**GRAFANA_INTERVALS, **variables}

    def value(match: re.Match) -> str:
        name = next(g for g in match.groups() if g)
        if name.isdigit():  # a label_replace reference ($1), which Grafana leaves alone too
            return match.group(0)
        if name not in values:
            raise ValueError(f"the query names the variable ${name}, which has no value; pass it "
                             f"(known: {', '.join(sorted(values))}): {expr}")
        return values[name]

    return _VARIABLE.sub(value, expr)


def _package_yaml(name: str) -> list[dict[str, Any]]:
    text = package_files.files("graphserving.dev").joinpath(name).read_text()
    return [d for d in yaml.safe_load_all(text) if d]


def rbac() -> list[dict[str, Any]]:
    """The ClusterRole and ClusterRoleBinding of ``prometheus-rbac.yaml``."""
    return _package_yaml("prometheus-rbac.yaml")


def config(kubeconfig: Path, scrape_interval: str = DEFAULT_SCRAPE_INTERVAL,
           scrape_timeout: str = DEFAULT_SCRAPE_TIMEOUT, gateway_metrics: str | None = None,
           targets_dir: Path | None = None) -> dict[str, Any]:
    """The Prometheus configuration: the jobs of ``prometheus-scrape.yaml`` discovering Pods
    through ``kubeconfig``, plus a ``gateway`` job scraping ``gateway_metrics`` (``host:port``) if
    given, and the job :data:`LOCAL_JOB` reading target files ``targets_dir/*.json`` if given
    (``honor_labels``, as the operator's ServiceMonitor: its series name their GraphServing).

    ``scrape_timeout`` must not exceed ``scrape_interval`` (Prometheus refuses the file otherwise).
    """
    jobs = _package_yaml("prometheus-scrape.yaml")[0]["scrape_configs"]
    for job in jobs:
        for sd in job["kubernetes_sd_configs"]:
            sd["kubeconfig_file"] = str(kubeconfig)
    if gateway_metrics:
        jobs.append({"job_name": "gateway", "metrics_path": "/metrics",
                     "static_configs": [{"targets": [gateway_metrics]}]})
    if targets_dir is not None:
        jobs.append({"job_name": LOCAL_JOB, "metrics_path": "/metrics", "honor_labels": True,
                     "file_sd_configs": [{"files": [str(targets_dir / "*.json")], "refresh_interval": "5s"}]})
    return {"global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_timeout,
                       "evaluation_interval": scrape_interval},
            "scrape_configs": jobs}


class Prometheus:
    """Prometheus scraping the Pods of a running :class:`~graphserving.dev.cluster.LocalCluster`."""

    def __init__(self, local: cluster.LocalCluster, scrape_interval: str = DEFAULT_SCRAPE_INTERVAL,
                 scrape_timeout: str = DEFAULT_SCRAPE_TIMEOUT, gateway_metrics: str | None = None) -> None:
        self.cluster = local
        self.dir = local.state_dir / "prometheus"
        self.port = free_port()
        self.scrape_interval = scrape_interval
        self.scrape_timeout = scrape_timeout
        self.gateway_metrics = gateway_metrics
        self.record: cluster.ProcessRecord | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def targets_dir(self) -> Path:
        return self.dir / "targets"

    def add_target(self, name: str, address: str, labels: dict[str, str] | None = None) -> None:
        """Scrape ``http://address/metrics`` (``host:port``) in the job :data:`LOCAL_JOB`, with
        ``labels`` on its series, until :meth:`remove_target` ``name``. Prometheus reads the file
        within seconds (file watch, refreshed every 5 s)."""
        entry = [{"targets": [address], "labels": {"target": name, **(labels or {})}}]
        self.targets_dir.mkdir(parents=True, exist_ok=True)
        partial = self.targets_dir / f".{name}.json.tmp"
        partial.write_text(json.dumps(entry))
        partial.replace(self.targets_dir / f"{name}.json")  # whole files only: Prometheus watches the folder

    def remove_target(self, name: str) -> None:
        (self.targets_dir / f"{name}.json").unlink(missing_ok=True)

    @property
    def log_path(self) -> Path:
        return self.cluster.state_dir / "prometheus.log"

    def start(self, timeout: float = DEFAULT_START_TIMEOUT) -> Prometheus:
        """Apply its RBAC, write its configuration, run it and wait for ``/-/ready``.

        Raises :class:`~graphserving.dev.cluster.ClusterError` when prometheus is not built, the
        RBAC is refused, it exits (a bad configuration, say) or is not ready within ``timeout`` s.
        """
        path = binaries.binary_path("prometheus")
        if path is None:
            raise cluster.ClusterError("prometheus is not built; run `graphserving dev build prometheus`")
        try:
            for obj in rbac():
                resources.apply(self.cluster, obj)
        except resources.ApplyError as exc:
            raise cluster.ClusterError(f"prometheus: {exc}") from exc
        self.targets_dir.mkdir(parents=True, exist_ok=True)
        config_file = self.dir / "prometheus.yaml"
        config_file.write_text(yaml.safe_dump(config(
            self.cluster.state_dir / "prometheus.kubeconfig", self.scrape_interval, self.scrape_timeout,
            self.gateway_metrics, self.targets_dir), sort_keys=False))
        self.cluster.endpoints["prometheus"] = self.url
        proc = self.cluster.spawn_client("prometheus", [
            str(path), f"--config.file={config_file}", f"--storage.tsdb.path={self.dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d",
        ], env={"PATH": "/usr/bin:/bin"})
        self.record = next(r for r in self.cluster.records if r.pid == proc.pid)
        deadline = time.monotonic() + timeout
        while not self._ready():
            if proc.poll() is not None or time.monotonic() >= deadline:
                what = f"exited with code {proc.returncode}" if proc.poll() is not None else "was not ready in time"
                self.stop()
                tail = cluster.log_tail(self.log_path)
                raise cluster.ClusterError(f"prometheus {what}; log {self.log_path}:\n{tail}")
            time.sleep(0.2)
        return self

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def query(self, promql: str, timeout: float = 10.0) -> list[dict[str, Any]]:
        """The instant vector of ``promql`` from ``/api/v1/query``: ``[{"metric": {...}, "value": [t, "v"]}]``.

        Raises ``RuntimeError`` with Prometheus' error (a PromQL syntax error names the position).
        """
        return self._api(f"query?{urllib.parse.urlencode({'query': promql})}", timeout)["result"]

    def targets(self, timeout: float = 10.0) -> dict[str, list[dict[str, Any]]]:
        """``/api/v1/targets``: ``activeTargets`` (scraped, with ``labels`` and ``health``) and
        ``droppedTargets`` (discovered, then dropped by the relabelling; ``discoveredLabels``)."""
        return self._api("targets", timeout)

    def _api(self, path: str, timeout: float) -> Any:
        url = f"{self.url}/api/v1/{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise RuntimeError(f"GET {url} failed: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def stop(self) -> None:
        if self.record is not None:
            self.cluster.stop_client(self.record, grace=10)
            self.record = None

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
