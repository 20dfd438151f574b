"""``graphserving-worker --tensor-parallel-size 2``: rank 0 starts rank 1, both hold half of a tiny
random model (gloo and emulated graphs on the CPU; NCCL and CUDA graphs on two GPUs), capture the
same graphs, and serve what one process serves.

Also: what tensor parallelism does not run yet is refused by name, SIGTERM to the whole process
group (what the dev node agent and many process managers send) stops both processes in order, rank
0 exits when its follower dies (the group could not go on), and a follower that fails ends with
status 1 through ``ranks.exit_now`` (never the interpreter's teardown of its process group).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from graphserving.dev.ports import free_port
from graphserving.runtime.worker import StartupError, build_parser, resolve_config

WORKER = [sys.executable, "-m", "graphserving.runtime.worker"]
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
DEVICES = [["--device", "cpu"],
           pytest.param(["--device", "cuda", "--dtype", "float32"], marks=[pytest.mark.gpu, TWO_GPUS], id="cuda")]
ARGS = ["--num-kv-blocks", "96", "--block-size", "4", "--max-num-seqs", "4",
        "--capture-sizes", "1,2,4", "--piecewise-capture-sizes", "8,16,32", "--allow-degraded",
        "--shutdown-delay-seconds", "0", "--drain-seconds", "5", "--log-level", "info"]
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]


class Served:
    """One worker command on a free port, in a process group of its own; its output in ``log``."""

    def __init__(self, model: Path, log: Path, *extra: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen([*WORKER, "--model", str(model), "--port", str(self.port), *ARGS, *extra],
                                     stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "GRAPHSERVING_EMULATE_GRAPHS": "1", **(env or {})})

    def wait_ready(self, timeout: float = 240) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.base}/readyz", timeout=2).status_code == 200:
                    return httpx.get(f"{self.base}/v1/graphs", timeout=5).json()
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"not ready (exit {self.proc.poll()}):\n{self.log.read_text()[-4000:]}")

    def completions(self) -> list[str]:
        r = httpx.post(f"{self.base}/v1/completions", timeout=120, json={
            "model": "m", "prompt": PROMPTS, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    def followers(self) -> list[int]:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        return [int(pid) for pid in children]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """``sig`` to the whole process group (rank 0 and its followers), as the dev node agent's
        ``killpg`` does; rank 0's exit status."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)


def _gone(pid: int, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES, ids=["cpu", "cuda"])
def test_two_ranks_serve_the_single_process_answers_and_stop_together(device, tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama3_rope")
    single = Served(model, tmp_path / "tp1.log", "--served-model-name", "m", *device)
    try:
        assert "parallelLayout" not in single.wait_ready()  # one rank: the report as before the field
        expected = single.completions()
    finally:
        assert single.stop() == 0
    pair = Served(model, tmp_path / "tp2.log", "--served-model-name", "m", "--tensor-parallel-size", "2", *device)
    try:
        report = pair.wait_ready()
        followers = pair.followers()
        assert len(followers) == 1
        assert pair.completions() == expected
        assert report["parallelLayout"] == "tp2-pp1"
        assert report["coverage"] == 1.0 and all(k["canary"]["passed"] for k in report["keys"])
    finally:
        code = pair.stop()
    log = pair.log.read_text()
    assert code == 0, log[-3000:]
    assert all(_gone(pid) for pid in followers), log[-3000:]
    # the follower ignored the group's SIGTERM and ended on rank 0's stop, after the drain
    assert "tensor-parallel rank 1 of 2 joined" in log and "rank 1 stopped after" in log
    assert "exited with status" not in log, log[-3000:]


@pytest.mark.slow
def test_rank_0_exits_when_its_follower_dies(tiny_model_dir, tmp_path):
    pair = Served(tiny_model_dir("llama3_rope"), tmp_path / "tp2.log", "--tensor-parallel-size", "2", "--device", "cpu")
    try:
        pair.wait_ready()
        os.kill(pair.followers()[0], signal.SIGKILL)
        code = pair.proc.wait(30)
    finally:
        pair.stop()
    assert code == 1
    assert "tensor-parallel rank 1 exited with status -9: the group cannot go on" in pair.log.read_text()


@pytest.mark.slow
def test_a_lifecycle_failure_on_rank_0_alone_kills_the_followers_and_reports_failed(tiny_model_dir, tmp_path):
    # capture faults are refused under tensor parallelism (a key failing on one rank only would
    # leave the others in its collective): rank 0's lifecycle fails there, the follower does not
    pair = Served(tiny_model_dir("llama3_rope"), tmp_path / "tp2.log", "--tensor-parallel-size", "2", "--device", "cpu",
                  env={"GRAPHSERVING_FAULT_INJECT_CAPTURE": "all"})
    try:
        deadline, report = time.monotonic() + 180, {}
        while time.monotonic() < deadline and report.get("phase") != "Failed":
            try:
                report = httpx.get(f"{pair.base}/v1/graphs", timeout=5).json()
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.5)
        assert report.get("phase") == "Failed", pair.log.read_text()[-3000:]
        assert "capture faults cannot be injected under tensor parallelism" in report["failureReason"]
        follower = pair.followers()
        assert follower == [] or all(_gone(pid) for pid in follower)
        assert pair.proc.poll() is None and httpx.get(f"{pair.base}/healthz", timeout=5).status_code == 200
    finally:
        code = pair.stop()
    assert code == 0
    assert "tensor-parallel group abandoned (the lifecycle failed" in pair.log.read_text()


@pytest.mark.slow
def test_a_model_that_does_not_split_over_the_ranks_exits_1_with_one_line(tiny_model_dir, tmp_path):
    trio = Served(tiny_model_dir("llama3_rope"), tmp_path / "tp3.log", "--tensor-parallel-size", "3", "--device", "cpu")
    code = trio.proc.wait(180)
    errors = [line for line in trio.log.read_text().splitlines() if line.startswith("graphserving-worker: error:")]
    assert code == 1
    assert any(e.startswith("graphserving-worker: error: ") and "is not divisible by the tensor-parallel size (3)" in e
               for e in errors), errors


@pytest.mark.parametrize(("flags", "field"), [
    (["--tensor-parallel-size", "2", "--speculative", "ngram:4"], "engine.speculative"),
    (["--tensor-parallel-size", "17"], "tensor_parallel_size"),
])
def test_what_tensor_parallelism_does_not_run_yet_is_refused_by_name(flags, field):
    with pytest.raises(StartupError, match=rf"invalid configuration: .*{field}"):
        resolve_config(build_parser().parse_args(["--model", "x.gguf", *flags]), environ={})


def test_the_tensor_parallel_size_is_a_configuration_field():
    config = resolve_config(build_parser().parse_args(["--model", "x.gguf", "--tensor-parallel-size", "2"]), environ={})
    assert config.tensor_parallel_size == 2
    assert json.loads(config.model_dump_json(exclude_unset=True))["tensor_parallel_size"] == 2


@pytest.mark.parametrize(("where", "error", "line"), [
    ("join", RuntimeError("the store timed out"), "rank 1: RuntimeError: the store timed out"),
    ("run_follower", ValueError("rank 0 sent 'execute' where the KV cache's size was due"),
     "rank 1: rank 0 sent 'execute'"),
    ("run_follower", MemoryError("KV cache"), "rank 1: MemoryError: KV cache"),
])
def test_a_follower_that_fails_ends_through_exit_now_with_status_1(monkeypatch, capsys, where, error, line):
    from graphserving.runtime import worker
    from graphserving.runtime.lifecycle import follower, ranks

    class Exited(Exception):
        pass

    def exit_now(code: int):
        raise Exited(code)

    def fail(*_, **__):
        raise error

    monkeypatch.setattr(ranks, "follower_setup", lambda: None)
    monkeypatch.setattr(ranks, "exit_now", exit_now)
    monkeypatch.setattr(ranks, "connect", lambda *_: None)
    monkeypatch.setattr(ranks, "join", fail if where == "join" else lambda *_: type("G", (), {
        "parallel": None, "device": torch.device("cpu"), "channel": None})())
    monkeypatch.setattr(worker, "load", lambda *_, **__: (None, 0.0))
    monkeypatch.setattr(follower, "run_follower", fail)
    args = build_parser().parse_args(["--model", "x.gguf", "--tensor-parallel-size", "2", "--device", "cpu",
                                      "--tensor-parallel-rank", "1", "--tensor-parallel-address", "127.0.0.1:1"])
    with pytest.raises(Exited) as exited:
        worker.follow_rank(args)
    assert exited.value.args == (1,)
    assert f"graphserving-worker: error: {line}" in capsys.readouterr().err
