"""The planner needs no torch: its extra (``graphserving[planner]``) installs none.

``replay-trace`` drives the worker's real scheduler and block manager, which reserve the KV
layout's null block (runtime/model/kv_layout.py, torch-free). Here torch is made unimportable in a
fresh interpreter (a ``None`` entry in ``sys.modules`` makes ``import torch`` raise ImportError),
then every planner module is imported and a trace is replayed and planned end to end.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PLANNER = Path(__file__).resolve().parents[2] / "src" / "graphserving" / "planner"

_SCRIPT = """
import importlib, json, sys
for blocked in ("torch", "triton", "transformers"):
    sys.modules[blocked] = None
try:
    import torch
except ImportError:
    pass
else:
    raise SystemExit("torch is still importable")
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
from graphserving.cli import main
code = main(["replay-trace", "--trace", sys.argv[2], "--max-num-seqs", "16", "--compare", "vllm,auto", "--json"])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton") and sys.modules[m] is not None)
print(json.dumps({"code": code, "loaded": loaded}))
"""


@pytest.fixture
def trace(tmp_path) -> Path:
    from graphserving.planner.traces import TraceRequest, trace_to_csv

    path = tmp_path / "trace.csv"
    requests = [TraceRequest(arrival_s=0.01 * i, input_tokens=20 + i, output_tokens=8 + i % 5) for i in range(24)]
    path.write_text(trace_to_csv(requests))
    return path


def test_the_planner_imports_and_replays_a_trace_with_torch_unimportable(trace):
    modules = sorted(f"graphserving.planner.{p.stem}" for p in PLANNER.glob("*.py") if p.stem != "__init__")
    assert "graphserving.planner.replay" in modules
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(modules), str(trace)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary == {"code": 0, "loaded": []}
    runs = json.loads("\n".join(lines[:-1]))
    assert set(runs["runs"]) == {"vllm", "auto"}
    assert all(run["requests"]["completed"] == 24 for run in runs["runs"].values())
