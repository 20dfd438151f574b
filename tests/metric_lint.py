"""Lint a Prometheus text exposition: the official linter (``promtool check metrics``) when its
binary is built, else a port of its rules; plus the conventions it does not check.

The port follows promtool's linter, ``github.com/prometheus/client_golang/prometheus/testutil/promlint``
(validations/*.go: help text, base units, ``_total`` on counters and only on counters, the
histogram/summary reserved suffixes and labels, the type in the name, ``:``, camelCase, unit
abbreviations, duplicate series). :func:`convention_problems` adds what promtool lets through and
https://prometheus.io/docs/practices/naming/ asks for: ratios as ``_ratio`` (not percent) and no
``_created`` series (prometheus_client's, which Prometheus would ingest as extra series).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

from graphserving.dev.binaries import binary_path

_BASE_UNITS = {"amperes", "bytes", "celsius", "grams", "joules", "kelvin", "meters", "metres", "seconds", "volts"}
_NON_BASE_UNITS = {
    "minutes": "seconds", "hours": "seconds", "days": "seconds", "weeks": "seconds", "kelvins": "kelvin",
    "fahrenheit": "celsius", "rankine": "celsius", "inches": "meters", "yards": "meters", "miles": "meters",
    "bits": "bytes", "calories": "joules", "pounds": "grams", "ounces": "grams",
}
_UNIT_PREFIXES = ("pico", "nano", "micro", "milli", "centi", "deci", "deca", "hecto", "kilo", "kibi", "mega",
                  "mebi", "giga", "gibi", "tera", "tebi", "peta", "pebi")
_UNIT_ABBREVIATIONS = ("s", "ms", "us", "ns", "sec", "b", "kb", "mb", "gb", "tb", "pb", "m", "h", "d")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_CAMEL = re.compile(r"[a-z][A-Z]")


@dataclasses.dataclass
class Family:
    name: str
    type: str = "untyped"
    help: str | None = None
    samples: list[tuple[str, dict[str, str], float]] = dataclasses.field(default_factory=list)


def parse(text: str) -> dict[str, Family]:
    """The families of a text exposition (format 0.0.4), samples attached to the family declared
    last before them, as promtool's parser (expfmt) attaches them."""
    families: dict[str, Family] = {}
    current: Family | None = None
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            _, kind, name, *rest = line.split(" ", 3)
            current = families.setdefault(name, Family(name))
            if kind == "HELP":
                current.help = rest[0] if rest else ""
            else:
                current.type = rest[0]
        elif line and not line.startswith("#"):
            match = _SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            name, labels, value = match.groups()
            if current is None or not name.startswith(current.name):
                current = families.setdefault(name, Family(name))
            current.samples.append((name, dict(_LABEL.findall(labels or "")), float(value)))
    return families


def _unit_problem(name: str) -> str | None:
    for token in name.split("_"):
        for prefix in ("", *_UNIT_PREFIXES):
            unit = token[len(prefix):] if token.startswith(prefix) else None
            if unit in _BASE_UNITS:
                return None if not prefix else f'use base unit "{unit}" instead of "{token}"'
            if unit in _NON_BASE_UNITS:
                return f'use base unit "{_NON_BASE_UNITS[unit]}" instead of "{token}"'
    return None


def promlint_problems(family: Family) -> list[str]:
    """promlint's validations of one family, with its messages."""
    name, kind, problems = family.name, family.type, []
    if family.help is None:
        problems.append("no help text")
    if unit := _unit_problem(name):
        problems.append(unit)
    if kind == "counter" and not name.endswith("_total"):
        problems.append('counter metrics should have "_total" suffix')
    if kind not in ("counter", "untyped") and name.endswith("_total"):
        problems.append('non-counter metrics should not have "_total" suffix')
    labels = {label for _, sample_labels, _ in family.samples for label in sample_labels}
    if kind != "untyped":
        if kind != "histogram" and name.endswith("_bucket"):
            problems.append('non-histogram metrics should not have "_bucket" suffix')
        for suffix in ("_count", "_sum"):
            if kind not in ("histogram", "summary") and name.endswith(suffix):
                problems.append(f'non-histogram and non-summary metrics should not have "{suffix}" suffix')
        if kind != "histogram" and "le" in labels:
            problems.append('non-histogram metrics should not have "le" label')
        if kind != "summary" and "quantile" in labels:
            problems.append('non-summary metrics should not have "quantile" label')
        if f"_{kind}_" in name.lower() or name.lower().endswith(f"_{kind}"):
            problems.append(f"metric name should not include type '{kind}'")
    if ":" in name:
        problems.append("metric names should not contain ':'")
    if _CAMEL.search(name):
        problems.append("metric names should be written in 'snake_case' not 'camelCase'")
    if any(_CAMEL.search(label) for label in labels):
        problems.append("label names should be written in 'snake_case' not 'camelCase'")
    for abbreviation in _UNIT_ABBREVIATIONS:
        if f"_{abbreviation}_" in name.lower() or name.lower().endswith(f"_{abbreviation}"):
            problems.append("metric names should not contain abbreviated units")
    seen = [(s, tuple(sorted(labels.items()))) for s, labels, _ in family.samples]
    if len(seen) != len(set(seen)):
        problems.append("metric not unique")
    return problems


def convention_problems(family: Family) -> list[str]:
    """The naming conventions promtool does not check."""
    problems = []
    if any(token in ("percent", "percentage") for token in family.name.split("_")):
        problems.append('a ratio is "_ratio" in [0, 1], not percent')
    created = sorted({s for s, _, _ in family.samples if s.endswith("_created")})
    if family.name.endswith("_created") or created:
        problems.append(f"_created series {created or [family.name]} (prometheus_client.disable_created_metrics)")
    return problems


def promtool() -> Path | None:
    """The cached ``promtool`` (``python -m graphserving.dev.binaries promtool`` builds it), or None."""
    return binary_path("promtool")


def promtool_problems(text: str, binary: Path) -> list[str]:
    """``promtool check metrics`` on ``text``: its problem lines (``name message``; exit status 3
    when there are any)."""
    out = subprocess.run([str(binary), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    assert out.returncode in (0, 3), f"promtool check metrics failed to run ({out.returncode}): {lines}"
    return lines


def lint(text: str) -> list[str]:
    """Every problem of ``text`` as ``name message``: promtool's (or the port's) and the conventions'."""
    families = parse(text)
    binary = promtool()
    if binary is not None:
        problems = promtool_problems(text, binary)
    else:
        problems = [f"{f.name} {p}" for f in families.values() for p in promlint_problems(f)]
    return problems + [f"{f.name} {p}" for f in families.values() for p in convention_problems(f)]


def silent_families(text: str) -> list[str]:
    """Families declared but without a single sample (a labelled metric before its first event)."""
    return sorted(f.name for f in parse(text).values() if not f.samples)
