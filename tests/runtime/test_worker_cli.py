"""The ``graphserving-worker`` command: configuration, one-line start-up errors, and a real serve."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from graphserving.dev.ports import free_port
from graphserving.runtime.worker import StartupError, build_parser, resolve_config

WORKER = [sys.executable, "-m", "graphserving.runtime.worker"]


def run_worker(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*WORKER, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def assert_one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("graphserving-worker: error: ")
    assert "Traceback" not in proc.stderr + proc.stdout
    return lines[0]


def test_a_missing_model_file_exits_1_with_one_line(tmp_path):
    missing = tmp_path / "nope.gguf"
    line = assert_one_line_error(run_worker("--model", str(missing)))
    assert str(missing) in line and "does not exist" in line


def test_a_revision_mismatch_exits_1_with_one_line_giving_both_revisions(smollm2_path):
    from graphserving.runtime.model.loader import compute_revision

    wrong = "0" * 64
    line = assert_one_line_error(run_worker("--model", str(smollm2_path), "--revision", wrong))
    assert wrong in line
    assert compute_revision(smollm2_path) in line


def test_malformed_config_json_in_the_environment_exits_1_with_one_line():
    line = assert_one_line_error(run_worker(env={"GRAPHSERVING_WORKER_CONFIG": "{not json"}))
    assert "GRAPHSERVING_WORKER_CONFIG" in line and "malformed JSON" in line


def test_an_invalid_config_field_is_named(tmp_path):
    cfg = tmp_path / "worker.json"
    cfg.write_text(json.dumps({"model_name": "m", "model_path": "x.gguf", "engine": {"max_num_seqs": 0}}))
    line = assert_one_line_error(run_worker("--config", str(cfg)))
    assert "engine.max_num_seqs" in line


def test_flags_override_the_config_file(tmp_path):
    cfg = tmp_path / "worker.json"
    cfg.write_text(json.dumps({
        "model_name": "served", "model_path": "a.gguf", "port": 9000,
        "engine": {"max_num_seqs": 4, "num_kv_blocks": 100},
    }))
    args = build_parser().parse_args(["--config", str(cfg), "--port", "9100", "--max-num-seqs", "8", "--dtype", "float16"])
    config = resolve_config(args, environ={})
    assert (config.model_name, config.model_path, config.port, config.dtype) == ("served", "a.gguf", 9100, "float16")
    assert (config.engine.max_num_seqs, config.engine.num_kv_blocks) == (8, 100)


def test_the_served_name_defaults_to_the_file_stem():
    args = build_parser().parse_args(["--model", "models/SmolLM2.Q4_1.gguf"])
    assert resolve_config(args, environ={}).model_name == "SmolLM2.Q4_1"


def test_no_model_is_an_error():
    with pytest.raises(StartupError, match="no model given"):
        resolve_config(build_parser().parse_args([]), environ={})


@pytest.mark.slow
def test_the_worker_serves_a_chat_answer_at_the_exact_revision(smollm2_path):
    from graphserving.runtime.model.loader import compute_revision

    port = free_port()
    proc = subprocess.Popen(
        [*WORKER, "--model", str(smollm2_path), "--revision", compute_revision(smollm2_path), "--port", str(port),
         "--num-kv-blocks", "64", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        serving = False
        # /v1/models answers once the engine serves; /readyz additionally follows the graph
        # readiness policy (on CPU without --allow-degraded it stays 503 by design).
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                serving = httpx.get(f"{base}/v1/models", timeout=2).status_code == 200
            except httpx.TransportError:
                pass
            if serving:
                break
            time.sleep(0.5)
        assert serving, f"worker is not serving; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
        r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": smollm2_path.stem, "temperature": 0, "max_tokens": 24,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        })
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0


@pytest.mark.parametrize(("config", "field"), [
    ({"model_path": "x.gguf", "engine": [1]}, "engine"),
    ({"model_path": "x.gguf", "graphs": "x"}, "graphs"),
    ({"model_path": 5}, "model_path"),
])
def test_a_config_section_of_the_wrong_type_exits_1_with_one_line(config, field):
    line = assert_one_line_error(run_worker(env={"GRAPHSERVING_WORKER_CONFIG": json.dumps(config)}))
    assert f"invalid configuration: {field}:" in line


def test_a_port_in_use_exits_1_with_one_line_before_loading_the_model(smollm2_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = assert_one_line_error(run_worker("--model", str(smollm2_path), "--port", str(port)))
    assert f"cannot listen on 127.0.0.1:{port}" in line
