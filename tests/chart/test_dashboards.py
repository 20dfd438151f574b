"""Every dashboard expression reads metrics (and labels) that the code really exports.

The exported names come from the real registries: the engine's (EngineMetrics), the graph and
lifecycle metrics registered beside it (GraphMetrics), and the operator's (OperatorMetrics), each
expanded with the sample suffixes Prometheus exposes (``_total`` for counters; ``_bucket``,
``_sum``, ``_count`` for histograms); a custom collector's (the engine's inter-token latency) are
the samples it yields.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from chart_helpers import CHART, REPO, one, render
from prometheus_client.metrics import MetricWrapperBase

from graphserving.operator.metrics import OperatorMetrics
from graphserving.runtime.graphs.metrics import GraphMetrics
from graphserving.runtime.engine.metrics import EngineMetrics

DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
#: Labels a scrape adds to every series besides the metric's own.
SCRAPE_LABELS = {"job", "instance"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                "offset", "inf", "nan"}


def _exported(registry) -> dict[str, set[str]]:
    """Sample name -> label names for every metric in ``registry`` (children or not; a custom
    collector's from the samples it yields)."""
    names: dict[str, set[str]] = {}
    for collector in registry._collector_to_names:  # prometheus_client keeps no public list
        if not isinstance(collector, MetricWrapperBase):
            for sample in (s for family in collector.collect() for s in family.samples):
                names.setdefault(sample.name, set()).update(sample.labels)
            continue
        base, kind, labels = collector._name, collector._type, set(collector._labelnames)
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""],
                    "summary": ["_sum", "_count"]}[kind]
        for suffix in suffixes:
            names[base + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return names


def _worker_target_labels() -> set[str]:
    """The labels the chart's PodMonitor gives worker series (its relabelings)."""
    monitor = one(render("podMonitor.enabled=true"), "PodMonitor")
    return {r["targetLabel"] for r in monitor["spec"]["podMetricsEndpoints"][0]["relabelings"]}


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    engine = EngineMetrics("smollm2")
    GraphMetrics(engine.registry, "smollm2")
    worker = {name: labels | _worker_target_labels() | SCRAPE_LABELS for name, labels in _exported(engine.registry).items()}
    operator = {name: labels | SCRAPE_LABELS for name, labels in _exported(OperatorMetrics().registry).items()}
    assert not set(worker) & set(operator)
    return {**worker, **operator}


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names in its matcher) for every series selector in a PromQL ``expr``."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\[[^\]]*\]", "", text)  # range and subquery durations
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r" ", text)  # grouping labels
    found: list[tuple[str, set[str]]] = []
    for match in re.finditer(r"(?<![\w$:.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?\s*(\()?", text):
        name, matcher, call = match.groups()
        if call or name in PROMQL_WORDS:
            continue
        if re.search(r"\{[^}]*$", text[:match.start()]):
            continue  # a label inside a matcher
        labels = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matcher or ""))
        found.append((name, labels))
    return found


def grouping_labels(expr: str) -> set[str]:
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    return {label.strip() for clause in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", text)
            for label in clause.split(",") if label.strip()}


def expressions(board: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every panel target and every query variable."""
    out = [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            inner = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", var["query"]["query"])
            assert inner, f"variable {var['name']}: unexpected query {var['query']['query']!r}"
            out.append((f"variable {var['name']}", inner.group(1)))
    return out


def test_the_selector_parser_reads_names_and_matcher_labels():
    expr = ('histogram_quantile(0.99, sum by (le) (rate(graphserving_ttft_bucket{namespace=~"$ns", a!="x{y}"}[$__rate_interval])))'
            ' / on (pod) group_left count(up) unless other_metric')
    assert selectors(expr) == [("graphserving_ttft_bucket", {"namespace", "a"}), ("up", set()), ("other_metric", set())]
    assert grouping_labels(expr) == {"le", "pod"}


def test_three_dashboards_ship():
    assert [p.name for p in DASHBOARDS] == ["capacity.json", "graphs.json", "serving.json"]


@pytest.mark.slow  # the registries import the runtime (torch)
@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_expression_uses_exported_metrics_and_their_labels(path: Path, exported):
    board = json.loads(path.read_text())
    problems = []
    for title, expr in expressions(board):
        used = selectors(expr)
        if not used:
            problems.append(f"{title}: no metric in {expr!r}")
        for name, labels in used:
            if name not in exported:
                problems.append(f"{title}: {name} is not exported")
            elif labels - exported[name]:
                problems.append(f"{title}: {name} has no label(s) {sorted(labels - exported[name])}")
        known = set().union(*(exported.get(n, set()) for n, _ in used)) if used else set()
        if grouping_labels(expr) - known:
            problems.append(f"{title}: grouping by {sorted(grouping_labels(expr) - known)} that no series in it has")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_panels_are_well_formed(path: Path):
    board = json.loads(path.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and board["uid"].startswith("graphserving-")
    for p in board["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        refs = [t["refId"] for t in p.get("targets", [])]
        assert len(refs) == len(set(refs)), p["title"]
        if p["type"] != "row":
            assert p["targets"] and p["description"], p["title"]


def test_the_docs_explain_every_panel():
    docs = (REPO / "docs" / "dashboards.md").read_text()
    missing = [f"{path.stem}: {p['title']}" for path in DASHBOARDS for p in json.loads(path.read_text())["panels"]
               if p["type"] != "row" and f"**{p['title']}**" not in docs]
    assert not missing, f"docs/dashboards.md does not explain: {missing}"


@pytest.mark.slow
def test_a_misspelt_metric_is_caught(exported):
    (name, _), = selectors('sum(rate(graphserving_graph_pases_total{mode="eager"}[5m]))')
    assert name not in exported
    assert "graphserving_graph_passes_total" in exported
    assert exported["graphserving_graph_passes_total"] >= {"mode", "key", "reason", "model_name", "graphserving"}


@pytest.mark.slow
def test_the_custom_itl_collector_and_the_router_aliases_are_exported_with_their_labels(exported):
    assert exported["graphserving_inter_token_latency_seconds_bucket"] >= {"le", "model_name", "graphserving"}
    assert "le" not in exported["graphserving_inter_token_latency_seconds_count"]
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"} <= set(exported)
