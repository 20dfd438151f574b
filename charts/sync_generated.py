"""Write (or check) the generated files and the files the chart and the plain manifests share.

Helm cannot read files outside a chart and kustomize cannot read files outside a kustomization
root (symlinks included), so a few files exist twice. Each has exactly one source; the copy is
written here and never edited by hand, and so are the files generated from the API models:

============================================================  =====================================
copy                                                          source
============================================================  =====================================
manifests/crd/graphserving.io_graphservings.yaml              ``graphserving operator crd`` (the
                                                              pydantic models)
charts/graphserving/files/crds/graphserving.io_graphservings  the same generator
.yaml
manifests/schema/graphserving_v1alpha1.json                   ``graphserving operator crd
                                                              --json-schema`` (the same generator:
                                                              the manifests' JSON Schema)
charts/graphserving/files/policy/worker-own-pod.yaml          manifests/policy/worker-own-pod.yaml
manifests/dashboards/<name>.json                              charts/graphserving/dashboards/
============================================================  =====================================

Usage: ``python charts/sync_generated.py`` writes them; ``--check`` exits 1 and names every copy
that differs (``tests/chart/test_generated_copies.py`` runs the same check).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "graphserving"
CHART_CRD = CHART / "files" / "crds" / "graphserving.io_graphservings.yaml"
CHART_POLICY = CHART / "files" / "policy" / "worker-own-pod.yaml"
MANIFEST_POLICY = REPO / "manifests" / "policy" / "worker-own-pod.yaml"
CHART_DASHBOARDS = CHART / "dashboards"
MANIFEST_DASHBOARDS = REPO / "manifests" / "dashboards"


def expected_copies() -> dict[Path, str]:
    """Every generated copy (absolute path) and the text it must have."""
    from graphserving.operator.crd import CRD_PATH, SCHEMA_PATH, render, render_json_schema

    copies = {
        REPO / CRD_PATH: render(),
        CHART_CRD: render(),
        REPO / SCHEMA_PATH: render_json_schema(),
        CHART_POLICY: MANIFEST_POLICY.read_text(),
    }
    for source in sorted(CHART_DASHBOARDS.glob("*.json")):
        copies[MANIFEST_DASHBOARDS / source.name] = source.read_text()
    return copies


def stale_copies() -> list[Path]:
    """The copies whose text differs from their source (or that are missing)."""
    return [path for path, text in expected_copies().items()
            if not path.is_file() or path.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale copies (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_copies()
        for path in stale:
            print(f"stale: {path.relative_to(REPO)} (run: python charts/sync_generated.py)")
        return 1 if stale else 0
    for path, text in expected_copies().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
