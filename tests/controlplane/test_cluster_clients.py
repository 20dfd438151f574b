"""Clients a local cluster starts (the demo's operator) are recorded and stopped with it."""

import sys

from graphserving.dev import cluster


def test_down_stops_a_client_the_cluster_started(tmp_path):
    local = cluster.LocalCluster(tmp_path / "clients", node_name=None)
    local.state_dir.mkdir()
    proc = local.spawn_client("operator", [sys.executable, "-c", "import time; time.sleep(600)"])
    running = cluster.running_processes(local.state_dir)
    assert [(r.name, r.pid) for r in running] == [("operator", proc.pid)]
    assert cluster.read_state(local.state_dir)["running"] is True
    assert (local.state_dir / "operator.log").exists()

    cluster.stop_state_dir(local.state_dir)  # what `graphserving dev cluster down` runs
    assert proc.wait(timeout=30) is not None
    assert not cluster.process_alive(running[0].pid, running[0].start_time)
    assert not local.state_dir.exists()


def test_env_refuses_a_cluster_whose_api_server_is_not_running(tmp_path, capsys):
    import argparse

    from graphserving.dev.cli import cmd_env

    state_dir = tmp_path / "stopped"
    local = cluster.LocalCluster(state_dir, node_name=None)
    state_dir.mkdir()
    local.kubeconfig.write_text("apiVersion: v1\nkind: Config\n")  # what a failed `up` leaves
    local.spawn_client("kube-apiserver", [sys.executable, "-c", "import time; time.sleep(600)"])  # its stand-in
    args = argparse.Namespace(state_dir=str(state_dir), name=None)
    assert cmd_env(args) == 0 and f"export KUBECONFIG={local.kubeconfig}" in capsys.readouterr().out

    cluster.stop_state_dir(state_dir, remove=False)
    assert cmd_env(args) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "is not running (no kube-apiserver process)" in captured.err
