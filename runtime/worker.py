"""``graphserving-worker``: load a model at an exact revision and serve the OpenAI-compatible API.

Configuration comes from a :class:`~graphserving.contract.worker_config.WorkerConfig` (JSON, from
``--config FILE`` or the ``GRAPHSERVING_WORKER_CONFIG`` environment variable); command-line flags
override single fields. Without a configuration, ``--model`` is required.

Start-up errors (missing model file, revision mismatch, unsupported architecture, invalid
configuration) print one line ``graphserving-worker: error: ...`` on stderr and exit with status 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

from pydantic import ValidationError

from graphserving.contract.graph_policy import CaptureSizeError, GraphMode
from graphserving.contract.worker_config import EngineLimits, WorkerConfig, speculative_tokens

log = logging.getLogger("graphserving.worker")

CONFIG_ENV = "GRAPHSERVING_WORKER_CONFIG"
API_KEY_ENV = "GRAPHSERVING_API_KEY"
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "none")
"""``--tool-call-parser`` values (runtime/api/tool_parsers.py, ``PARSER_CHOICES``; kept here so that
``--help`` needs no import of the API)."""
SHUTDOWN_DELAY_SECONDS = 5.0
"""Default of ``--shutdown-delay-seconds``: after SIGTERM the worker serves this long with
``/readyz`` failing before it closes its listener. A deleted Pod leaves its Service's EndpointSlices
at once, but a gateway or kube-proxy applies that a little later; a listener closed at SIGTERM
refuses the requests sent meanwhile (502s through the gateway). Measured on the dev cluster's
Traefik: docs/rollout-traffic.md. The Pod's ``terminationGracePeriodSeconds`` (60, operator/children.py)
covers it plus ``--drain-seconds``."""

KEEP_ALIVE_SECONDS = 120.0
"""How long an idle keep-alive connection stays open (uvicorn's ``timeout_keep_alive``; its default
is 5 s). Longer than the idle timeout of the proxies in front (Go's HTTP transport, which Traefik
and most Gateway API implementations use, closes idle connections after 90 s): the proxy, not the
worker, closes an idle connection, so a request it sends on a pooled connection never meets a
close from this side (docs/rollout-traffic.md)."""

DRAIN_ABORT_MARGIN_S = 1.0
"""At the drain deadline less this (seconds), requests still running are aborted, so that their
streams end with ``finish_reason: "abort"`` before the server closes the connections."""


class StartupError(Exception):
    """A start-up failure reported as one line."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="graphserving-worker",
        description="Serve a Llama-family, Qwen3 or Qwen3-MoE model (GGUF file or Hugging Face directory) over an "
                    "OpenAI-compatible API.",
    )
    p.add_argument("--model", help="GGUF file or Hugging Face model directory; preset:NAME for random weights "
                                   "of a known shape (benchmarks only, runtime/model/presets.py)")
    p.add_argument("--revision", help="sha256 of the weights (the worker refuses to start on a mismatch)")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default 8000)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="model and KV-cache dtype (default float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="default auto: cuda when available")
    p.add_argument("--served-model-name", help="name at /v1/models and in requests (default: the file stem)")
    p.add_argument("--max-num-seqs", type=int, help="most requests in one batch (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, help="most tokens in one forward pass (default 2048)")
    p.add_argument("--max-model-len", type=int, help="longest sequence, prompt + output (default: the model's context)")
    p.add_argument("--num-kv-blocks", type=int, help="KV-cache size in blocks (CPU default 512)")
    p.add_argument("--block-size", type=int, help="tokens per KV block (default 16)")
    p.add_argument("--num-scheduler-steps", type=int,
                   help="decode steps per schedule when every request is decoding (default 8; 1 disables)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="share full KV blocks across requests by content and skip the cached prefix of a "
                        "prompt (default on; --no-prefix-caching turns it off)")
    p.add_argument("--speculative", type=_speculative, metavar="ngram:K",
                   help="speculative decoding: draft up to K tokens (1-8) per request by prompt lookup and verify "
                        "them in one forward pass (needs a graph mode with FULL graphs; default off)")
    p.add_argument("--tensor-parallel-size", type=_positive_int,
                   help="GPUs sharing the model's weights, one process each (default 1); rank 0 serves the API")
    p.add_argument("--tensor-parallel-rank", type=int, help=argparse.SUPPRESS)  # a follower, started by rank 0
    p.add_argument("--tensor-parallel-address", help=argparse.SUPPRESS)  # rank 0's rendezvous store, HOST:PORT
    p.add_argument("--seed", type=int, help="seed for requests without one (default 0)")
    p.add_argument("--config", help=f"WorkerConfig JSON file (or set {CONFIG_ENV} to the JSON itself)")
    p.add_argument("--graph-mode", choices=[m.value for m in GraphMode],
                   help="which passes replay CUDA graphs (default FULL_AND_PIECEWISE)")
    p.add_argument("--capture-sizes", type=_int_list, help="full-graph capture sizes in requests, e.g. 1,2,4,8")
    p.add_argument("--piecewise-capture-sizes", type=_int_list, help="piecewise capture sizes in tokens")
    p.add_argument("--canary-sample-rate", type=float,
                   help="online canary: fraction of graph replays re-run eagerly and compared (default 0.0005; 0: off)")
    p.add_argument("--allow-degraded", action="store_true", default=None,
                   help="report ready (declared degraded) when graphs cannot be used, e.g. without CUDA")
    p.add_argument("--shutdown-delay-seconds", type=_non_negative_float, default=SHUTDOWN_DELAY_SECONDS,
                   help="on SIGTERM, how long the worker keeps accepting requests, with /readyz failing, before it "
                        "stops listening: the time endpoints and gateways take to stop sending it traffic "
                        f"(default {SHUTDOWN_DELAY_SECONDS:g})")
    p.add_argument("--drain-seconds", type=_non_negative_float, default=30.0,
                   help="then, how long in-flight requests may take before they are cancelled (default 30)")
    p.add_argument("--stream-interval", type=_positive_int, default=1,
                   help="tokens per streamed chunk: 1 sends every token of a multi-step run as its own chunk (default 1)")
    p.add_argument("--api-key", help=f"require `Authorization: Bearer KEY` on the API (probes, /metrics and /v1/graphs "
                                     f"stay open); prefer the environment variable {API_KEY_ENV}, which ps does not show")
    p.add_argument("--tool-call-parser", default="auto", choices=TOOL_CALL_PARSERS,
                   help="the tool-call format chat outputs are parsed in: hermes (Hermes, Qwen2.5/3, ChatML "
                        "models), llama3_json (Llama 3.1-3.3), none; default auto: read from the chat template "
                        "(docs/worker.md, 'Tool calling')")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def resolve_api_key(args: argparse.Namespace, environ: dict[str, str] | None = None) -> str | None:
    """The API key requests must send: ``--api-key``, else ``GRAPHSERVING_API_KEY``; None (no key
    needed) when neither is set or both are empty.

    Raises:
        StartupError: the key has characters an HTTP header cannot carry (spaces, control
            characters, non-ASCII).
    """
    environ = os.environ if environ is None else environ
    key = args.api_key if args.api_key is not None else environ.get(API_KEY_ENV)
    if not key:
        return None
    if any(not 0x21 <= ord(c) <= 0x7E for c in key):
        source = "--api-key" if args.api_key is not None else API_KEY_ENV
        raise StartupError(f"{source}: the API key must be visible ASCII characters without spaces "
                           f"(it is sent as `Authorization: Bearer <key>`)")
    return key


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def resolve_config(args: argparse.Namespace, environ: dict[str, str] | None = None) -> WorkerConfig:
    """The effective configuration: the file or environment JSON, then flags on top.

    Raises:
        StartupError: unreadable file, malformed JSON, invalid fields (named), no model given.
    """
    environ = os.environ if environ is None else environ
    data: dict = {}
    if args.config:
        try:
            text = Path(args.config).read_text()
        except OSError as exc:
            raise StartupError(f"cannot read --config {args.config}: {exc.strerror or exc}") from exc
        source = args.config
    elif environ.get(CONFIG_ENV):
        text, source = environ[CONFIG_ENV], CONFIG_ENV
    else:
        text, source = "", None
    if source is not None:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StartupError(f"{source}: malformed JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise StartupError(f"{source}: expected a JSON object, got {type(data).__name__}")

    overrides = {
        "model_path": args.model, "revision": args.revision, "host": args.host, "port": args.port,
        "dtype": args.dtype, "device": args.device, "model_name": args.served_model_name, "seed": args.seed,
        "tensor_parallel_size": args.tensor_parallel_size,
    }
    data.update({k: v for k, v in overrides.items() if v is not None})
    engine = _section(data, "engine")
    engine_overrides = {
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len, "num_kv_blocks": args.num_kv_blocks, "block_size": args.block_size,
        "num_scheduler_steps": args.num_scheduler_steps, "prefix_caching": args.prefix_caching,
        "speculative": args.speculative,
    }
    engine.update({k: v for k, v in engine_overrides.items() if v is not None})
    if engine:
        data["engine"] = engine
    graphs = _section(data, "graphs")
    graph_overrides = {
        "mode": args.graph_mode, "capture_sizes": args.capture_sizes,
        "piecewise_capture_sizes": args.piecewise_capture_sizes,
    }
    graphs.update({k: v for k, v in graph_overrides.items() if v is not None})
    if args.canary_sample_rate is not None:
        graphs["canary"] = {**_section(graphs, "canary", "graphs."), "sample_rate": args.canary_sample_rate}
    if args.allow_degraded is not None:
        graphs["readiness"] = {**_section(graphs, "readiness", "graphs."), "allow_degraded": True}
    if graphs:
        data["graphs"] = graphs
    if not data.get("model_path"):
        raise StartupError("no model given: pass --model PATH (or model_path in --config)")
    if not isinstance(data["model_path"], str):
        raise StartupError(f"invalid configuration: model_path: expected a string, got {data['model_path']!r}")
    data.setdefault("model_name", _default_name(data["model_path"]))
    try:
        return WorkerConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise StartupError(f"invalid configuration: {field}: {err['msg']} (got {err.get('input')!r})") from exc


def _speculative(value: str) -> str:
    """``--speculative``'s value, checked (``worker_config.speculative_tokens``).

    Raises:
        argparse.ArgumentTypeError: not ``ngram:K`` with K in 1..8.
    """
    try:
        speculative_tokens(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _section(data: dict, name: str, prefix: str = "") -> dict:
    """A copy of the object ``data[name]`` (empty if absent).

    Raises:
        StartupError: it is not a JSON object (named with its path).
    """
    value = data.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise StartupError(f"invalid configuration: {prefix}{name}: expected an object, got {value!r}")
    return dict(value)


def check_port(host: str, port: int) -> None:
    """Fail early, before the model loads, when ``host:port`` cannot be bound.

    Raises:
        StartupError: the address is in use or not local.
    """
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise StartupError(f"cannot resolve --host {host}: {exc}") from exc
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


def _default_name(model_path: str) -> str:
    if model_path.startswith("preset:"):
        return model_path.removeprefix("preset:") + "-random"
    p = Path(model_path)
    return p.stem if p.suffix == ".gguf" else (p.name or str(p))


def resolve_device(device: str):
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise StartupError("--device cuda requested but CUDA is not available on this machine")
    return torch.device(device)


def load(config: WorkerConfig, parallel=None, device=None):
    """Load the model in the foreground (the Loading phase). Returns ``(loaded, seconds)``.

    Args:
        parallel: this rank's share of a tensor-parallel model (``TensorParallel``); device: its
            device (default: ``config.device`` resolved).

    Raises:
        StartupError: the model cannot be loaded (missing, revision mismatch, unsupported).
    """
    from .model.presets import PRESET_PREFIX

    preset = config.model_path.startswith(PRESET_PREFIX)
    if not preset and not Path(config.model_path).exists():  # fail before the slow imports
        raise StartupError(f"model path {config.model_path} does not exist")
    import torch

    from .model.config import ConfigError
    from .model.loader import ModelLoadError, load_model

    device = device or resolve_device(config.device)
    dtype_name = config.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    log.info("loading %s (revision %s) as %s on %s", config.model_path, config.revision or "unchecked", dtype_name, device)
    start = time.perf_counter()
    try:
        if preset:  # random weights of a known shape: benchmarks only (runtime/model/presets.py)
            from .model.presets import load_preset

            log.warning("%s: RANDOM WEIGHTS for benchmarks; outputs are meaningless", config.model_path)
            loaded = load_preset(config.model_path, getattr(torch, dtype_name), device, seed=config.seed,
                                 parallel=parallel)
            if config.revision and config.revision.lower().removeprefix("sha256:") != loaded.revision:
                raise StartupError(f"revision mismatch for {config.model_path}: expected {config.revision}, "
                                   f"the preset's random weights (seed {config.seed}) are {loaded.revision}")
        else:
            loaded = load_model(config.model_path, config.revision, getattr(torch, dtype_name), device,
                                parallel=parallel)
    except KeyError as exc:
        raise StartupError(str(exc.args[0])) from exc
    except (ModelLoadError, ConfigError) as exc:  # ConfigError: a preset's shape does not split over the ranks
        raise StartupError(str(exc)) from exc
    except OSError as exc:
        raise StartupError(f"cannot read {config.model_path}: {exc}") from exc
    seconds = time.perf_counter() - start
    log.info("loaded %s in %.1f s: %d layers, vocab %d, revision %s", loaded.name, seconds,
             loaded.config.num_hidden_layers, loaded.config.vocab_size, loaded.revision)
    return loaded, seconds


def freeze_startup_objects() -> None:
    """Collect once, then move every object that start-up left alive (modules, the model, the
    tokenizer, graph buffers: hundreds of thousands) to the garbage collector's permanent
    generation (:func:`gc.freeze`), so that collections while serving scan only what requests
    allocate. Without it a full collection scans them all, holding the GIL for 100-200 ms (measured
    on a CPU worker of a tiny preset), which stalls the event loop and the engine loop alike.
    Objects allocated later are collected as usual."""
    gc.collect()
    gc.freeze()


class Worker:
    """One worker process: the lifecycle, the HTTP front, the engine loop and the report publisher.

    Test hooks (environment, never for production): ``GRAPHSERVING_EMULATE_GRAPHS=1`` captures on
    the emulated backend without CUDA; ``GRAPHSERVING_FAULT_INJECT_CAPTURE`` and
    ``GRAPHSERVING_FAULT_INJECT_CANARY`` fail the named graph keys (labels such as
    ``full-t8-r8``, or ``all``).
    """

    def __init__(self, config: WorkerConfig, loaded, loading_seconds: float, environ=None, *, freeze_gc: bool = False,
                 api_key: str | None = None, stream_interval: int = 1, tool_call_parser: str = "auto", group=None):
        from .graphs.metrics import GraphMetrics
        from .lifecycle.faults import injected_fault
        from .lifecycle.phases import WorkerLifecycle
        from .engine.metrics import EngineMetrics
        from .api.access import served_by_headers
        from .api.app import ServerState, build_app

        environ = os.environ if environ is None else environ
        limits: EngineLimits = config.engine
        self.config = config
        self.freeze_gc = freeze_gc  # the command freezes start-up objects; in-process users (tests) need not
        self.stream_interval = stream_interval
        self.metrics = EngineMetrics(config.model_name, limits.max_num_seqs, limits.max_num_batched_tokens)
        self.graph_metrics = GraphMetrics(self.metrics.registry, config.model_name)
        pod_name, namespace = environ.get("POD_NAME"), environ.get("POD_NAMESPACE")
        try:
            self.lifecycle = WorkerLifecycle(
                config, loaded, loading_seconds=loading_seconds, pod_name=pod_name, namespace=namespace,
                metrics=self.metrics, graph_metrics=self.graph_metrics,
                capture_fault=injected_fault("GRAPHSERVING_FAULT_INJECT_CAPTURE", environ),
                canary_fault=injected_fault("GRAPHSERVING_FAULT_INJECT_CANARY", environ),
                emulate_graphs=environ.get("GRAPHSERVING_EMULATE_GRAPHS") == "1",
                channel=group.channel if group is not None else None,
            )
        except CaptureSizeError as exc:
            raise StartupError(f"invalid capture sizes: {exc}") from exc
        self.async_engine = None
        self.group = group  # the tensor-parallel group (runtime/lifecycle/ranks.py), rank 0's view; None: one rank
        self.server = ServerState(config.model_name, self.lifecycle, self.metrics, api_key=api_key,
                                  tool_call_parser=tool_call_parser,
                                  served_by=served_by_headers(pod_name, environ.get("GRAPHSERVING_REVISION")))
        self.app = build_app(self.server)
        self.publisher = None
        if pod_name and namespace:
            from .lifecycle.publisher import PodReportPublisher

            self.publisher = PodReportPublisher(pod_name, namespace, on_recapture=self._on_recapture_request)
            self.lifecycle.listeners.append(self.publisher.submit)
            log.info("publishing reports to pod %s/%s", namespace, pod_name)
        self._thread = threading.Thread(target=self._start_engine, name="lifecycle", daemon=True)

    def start(self) -> None:
        """Run warmup, profiling, capture and canary in the background, then serve."""
        self._thread.start()

    def _start_engine(self) -> None:
        from .engine.async_engine import AsyncLLMEngine

        self.lifecycle.run()
        engine = self.lifecycle.engine
        if self.group is not None and self.lifecycle.error is not None:  # the followers may be mid-collective
            from .lifecycle import ranks

            ranks.abandon(self.group, f"the lifecycle failed: {self.lifecycle.error}")
            return
        if engine is None:  # failed before the engine existed; the report says why
            return
        if self.freeze_gc:
            freeze_startup_objects()
        loop = AsyncLLMEngine(engine, stream_interval=self.stream_interval)
        loop.start()
        self.async_engine = loop  # only once it runs: call_in_loop runs inline on a loop not running
        self.lifecycle.attach_loop(self.async_engine.call_in_loop)  # canary retries run between steps
        self.server.engine = self.async_engine  # the OpenAI routes answer from now on
        log.info("serving %s (%s)", self.config.model_name, self.lifecycle.readiness.reason)

    def _on_recapture_request(self, request) -> bool:
        """A recapture asked for through the Pod annotation (publisher thread). Returns False while
        the engine loop is not serving yet (between the Ready report and the loop's start), so that
        the publisher delivers the request again instead of dropping it: the operator asks only once
        per graph config."""
        from graphserving.contract.report import config_hash

        if self.async_engine is None:
            return False
        if config_hash(request.graphs) == config_hash(self.lifecycle.config.graphs):
            return True
        wanted = request.graph_config_hash
        log.info("recapture requested through the pod annotation (graph config %s)", wanted)
        future = self.async_engine.call_in_loop(lambda: self.lifecycle.recapture(request.graphs))

        def log_failure(done) -> None:
            if not done.cancelled() and done.exception() is not None:
                log.error("recapture to graph config %s failed: %s", wanted, done.exception())

        future.add_done_callback(log_failure)
        return True

    def drain(self, drain_seconds: float | None = None, shutdown_delay: float = 0.0) -> None:
        """SIGTERM: leave readiness; new requests are still served for ``shutdown_delay`` s, then
        in-flight requests finish while the server shuts down. With ``drain_seconds`` (the
        server's graceful-shutdown timeout, counted from the end of the delay), those still running
        :data:`DRAIN_ABORT_MARGIN_S` before it are aborted, so that clients get
        ``finish_reason: "abort"`` instead of a cut connection."""
        self.lifecycle.start_draining()
        if drain_seconds is not None:
            deadline = shutdown_delay + drain_seconds
            timer = threading.Timer(max(deadline - DRAIN_ABORT_MARGIN_S, 0.0), self._abort_at_deadline,
                                    args=(drain_seconds,))
            timer.daemon = True
            timer.start()

    def _abort_at_deadline(self, drain_seconds: float) -> None:
        if self.async_engine is not None and self.async_engine.is_running:
            self.async_engine.abort_all(f"the drain deadline of {drain_seconds:g} s passed")

    def shutdown(self) -> None:
        if self.async_engine is not None:
            self.async_engine.shutdown()
        if self.publisher is not None:
            self.publisher.close()

    def follower_stop(self):
        """After :meth:`shutdown`: the call that ends the tensor-parallel followers' command loops, or
        None while anything may still send them commands (the lifecycle thread, or an engine loop
        still inside a step, a recapture or a canary retry): they are then killed."""
        runner, loop = self.lifecycle.runner, self.async_engine
        if self._thread.is_alive() or runner is None or (loop is not None and loop.is_running):
            return None
        return getattr(runner, "stop_followers", None)


def follow_rank(args: argparse.Namespace) -> NoReturn:
    """A tensor-parallel follower (``--tensor-parallel-rank R``, started by rank 0 with the resolved
    configuration in :data:`CONFIG_ENV`): no API, no report (runtime/lifecycle/follower.py). It always
    ends through ``ranks.exit_now`` (no interpreter teardown: NCCL's can hang after captured graphs):
    0 once rank 0 stops it, 1 after any failure, which rank 0's watchdog sees at once (one line on
    stderr; the traceback in the log unless a start-up error: a divergence, an out-of-memory...)."""
    from .lifecycle import ranks
    from .lifecycle.follower import run_follower
    from .model.parallel import ParallelLayout

    ranks.follower_setup()
    rank = args.tensor_parallel_rank
    try:
        config = resolve_config(args)
        layout = ParallelLayout(config.tensor_parallel_size, rank)
        group = ranks.join(layout, ranks.connect(args.tensor_parallel_address, layout.tensor_parallel_size),
                           resolve_device(config.device))
        loaded, _ = load(config, parallel=group.parallel, device=group.device)
        log.info("rank %d stopped after %d commands", rank, run_follower(config, loaded, group.channel))
    except BaseException as exc:  # noqa: BLE001 - ended here, never by the interpreter's teardown
        startup = isinstance(exc, (StartupError, ValueError))
        log.error("rank %d failed: %s", rank, exc, exc_info=not startup)
        print(f"graphserving-worker: error: rank {rank}: {exc if startup else f'{type(exc).__name__}: {exc}'}",
              file=sys.stderr)
        ranks.exit_now(1)
    ranks.leave(group)
    ranks.exit_now(0)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Progress goes to stdout; stderr carries only the one-line start-up error (if any).
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stdout)
    if args.tensor_parallel_rank is not None:
        return follow_rank(args)
    group = None
    try:
        config = resolve_config(args)
        api_key = resolve_api_key(args)
        check_port(config.host, config.port)
        if config.tensor_parallel_size > 1:
            from .lifecycle import ranks

            group = ranks.start(config, resolve_device(config.device), args.log_level)
        loaded, seconds = load(config, parallel=group and group.parallel, device=group and group.device)
        worker = Worker(config, loaded, seconds, freeze_gc=True, api_key=api_key, stream_interval=args.stream_interval,
                        tool_call_parser=args.tool_call_parser, group=group)
    except BaseException as exc:  # once a group exists, any failure stops it and ends the process
        if not isinstance(exc, StartupError) and group is None:
            raise
        if isinstance(exc, StartupError):
            print(f"graphserving-worker: error: {exc}", file=sys.stderr)
        else:
            log.exception("rank 0 failed while starting: stopping the tensor-parallel group")
        if group is not None:
            ranks.stop(group, None)
            ranks.exit_now(1)
        return 1

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(worker.app, host=config.host, port=config.port, log_level=args.log_level,
                                           access_log=False, timeout_graceful_shutdown=args.drain_seconds,
                                           timeout_keep_alive=KEEP_ALIVE_SECONDS))
    handle_exit = server.handle_exit

    delayed: list[threading.Timer] = []

    def drain_then_exit(sig, frame) -> None:
        if delayed:  # a second signal ends the shutdown delay
            delayed[0].cancel()
            handle_exit(sig, frame)
            return
        worker.drain(args.drain_seconds, args.shutdown_delay_seconds)
        log.info("draining: /readyz fails; serving %g s more, then in-flight requests get %g s",
                 args.shutdown_delay_seconds, args.drain_seconds)
        delayed.append(threading.Timer(args.shutdown_delay_seconds, handle_exit, args=(sig, frame)))
        delayed[0].daemon = True
        delayed[0].start()

    server.handle_exit = drain_then_exit
    # uvicorn restores the handlers it found and re-raises a handled signal after its graceful
    # shutdown, which would kill the process (status 143 for SIGTERM) before worker.shutdown();
    # the drain has handled it, so the restored handlers do nothing and the worker exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    worker.start()
    log.info("listening on http://%s:%d (model %s)", config.host, config.port, config.model_name)
    status = 1
    try:
        server.run()
        status = 0
    finally:
        worker.shutdown()
        if group is not None:  # the process ends here (ranks.exit_now): log a failure first
            if status:
                log.exception("rank 0's server failed")
            ranks.stop(group, worker.follower_stop())
            log.info("worker stopped")
            ranks.exit_now(status)
    log.info("worker stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
