"""Files that exist twice (chart and plain manifests) are written from one source and never drift."""

from __future__ import annotations

from chart_helpers import CHART, REPO, load_sync_module

from graphserving.operator import crd


def test_the_charts_crd_is_the_generator_output():
    assert (CHART / "files/crds/graphserving.io_graphservings.yaml").read_text() == crd.render()


def test_the_manifests_crd_is_the_generator_output():
    assert (REPO / crd.CRD_PATH).read_text() == crd.render()


def test_the_json_schema_is_the_generator_output():
    assert (REPO / crd.SCHEMA_PATH).read_text() == crd.render_json_schema()
    assert crd.SCHEMA_PATH == "manifests/schema/graphserving_v1alpha1.json"


def test_the_sync_check_names_a_stale_json_schema(tmp_path, monkeypatch, capsys):
    sync = load_sync_module()
    stale = tmp_path / crd.SCHEMA_PATH
    stale.parent.mkdir(parents=True)
    stale.write_text("{}\n")
    monkeypatch.setattr(sync, "REPO", tmp_path)
    assert sync.main(["--check"]) == 1
    assert f"stale: {crd.SCHEMA_PATH}" in capsys.readouterr().out


def test_every_copy_matches_its_source():
    sync = load_sync_module()
    assert sync.stale_copies() == [], "run: python charts/sync_generated.py"


def test_the_sync_check_names_a_copy_that_drifted(tmp_path, monkeypatch, capsys):
    sync = load_sync_module()
    copy = tmp_path / "worker-own-pod.yaml"
    copy.write_text("# edited by hand\n")
    monkeypatch.setattr(sync, "CHART_POLICY", copy)
    monkeypatch.setattr(sync, "REPO", tmp_path)
    assert sync.main(["--check"]) == 1
    assert "stale: worker-own-pod.yaml" in capsys.readouterr().out
