"""``graphserving-worker``: load a model at an exact revision and serve the OpenAI-compatible API.

Configuration comes from a :class:`~graphserving.contract.worker_config.WorkerConfig` (JSON, from
``--config FILE`` or the ``GRAPHSERVING_WORKER_CONFIG`` environment variable); command-line flags
override single fields. Without a configuration, ``--model`` is required.

Start-up errors (missing model file, revision mismatch, unsupported architecture, invalid
configuration) print one line ``graphserving-worker: error: ...`` on stderr and exit with status 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from graphserving.contract.worker_config import EngineLimits, WorkerConfig

log = logging.getLogger("graphserving.worker")

CONFIG_ENV = "GRAPHSERVING_WORKER_CONFIG"


class StartupError(Exception):
    """A start-up failure reported as one line."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="graphserving-worker",
        description="Serve a Llama-family model (GGUF file or Hugging Face directory) over an OpenAI-compatible API.",
    )
    p.add_argument("--model", help="GGUF file or Hugging Face model directory")
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
    p.add_argument("--seed", type=int, help="seed for requests without one (default 0)")
    p.add_argument("--config", help=f"WorkerConfig JSON file (or set {CONFIG_ENV} to the JSON itself)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


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
    }
    data.update({k: v for k, v in overrides.items() if v is not None})
    engine = dict(data.get("engine") or {})
    engine_overrides = {
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len, "num_kv_blocks": args.num_kv_blocks, "block_size": args.block_size,
    }
    engine.update({k: v for k, v in engine_overrides.items() if v is not None})
    if engine:
        data["engine"] = engine
    if not data.get("model_path"):
        raise StartupError("no model given: pass --model PATH (or model_path in --config)")
    data.setdefault("model_name", _default_name(data["model_path"]))
    try:
        return WorkerConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise StartupError(f"invalid configuration: {field}: {err['msg']} (got {err.get('input')!r})") from exc


def _default_name(model_path: str) -> str:
    p = Path(model_path)
    return p.stem if p.suffix == ".gguf" else (p.name or str(p))


def resolve_device(device: str):
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise StartupError("--device cuda requested but CUDA is not available on this machine")
    return torch.device(device)


def build_server(config: WorkerConfig):
    """Load the model and build the engine and the app. Returns ``(app, async_engine)``.

    Raises:
        StartupError: the model cannot be loaded (missing, revision mismatch, unsupported).
    """
    if not Path(config.model_path).exists():  # fail before the slow imports
        raise StartupError(f"model path {config.model_path} does not exist")
    import torch

    from graphserving.runtime.engine import AsyncLLMEngine, LLMEngine
    from graphserving.runtime.metrics import EngineMetrics
    from graphserving.runtime.model_loader import ModelLoadError, load_model
    from graphserving.runtime.server import build_app

    device = resolve_device(config.device)
    dtype_name = config.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    log.info("loading %s (revision %s) as %s on %s", config.model_path, config.revision or "unchecked", dtype_name, device)
    try:
        loaded = load_model(config.model_path, config.revision, dtype, device)
    except ModelLoadError as exc:
        raise StartupError(str(exc)) from exc
    except OSError as exc:
        raise StartupError(f"cannot read {config.model_path}: {exc}") from exc
    log.info("loaded %s: %d layers, vocab %d, revision %s", loaded.name, loaded.config.num_hidden_layers,
             loaded.config.vocab_size, loaded.revision)
    limits: EngineLimits = config.engine
    metrics = EngineMetrics(config.model_name, limits.max_num_seqs, limits.max_num_batched_tokens)
    try:
        engine = LLMEngine(loaded.model, loaded.config, loaded.tokenizer, limits, device=device, dtype=dtype,
                           seed=config.seed, metrics=metrics)
    except (RuntimeError, ValueError) as exc:
        raise StartupError(f"cannot set up the engine: {exc}") from exc
    log.info("KV cache: %d blocks of %d tokens; max_model_len %d; max_num_seqs %d; max_num_batched_tokens %d",
             engine.num_kv_blocks, limits.block_size, engine.max_model_len, limits.max_num_seqs,
             limits.max_num_batched_tokens)
    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, config.model_name, metrics=metrics)
    return app, async_engine


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Progress goes to stdout; stderr carries only the one-line start-up error (if any).
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stdout)
    try:
        config = resolve_config(args)
        app, async_engine = build_server(config)
    except StartupError as exc:
        print(f"graphserving-worker: error: {exc}", file=sys.stderr)
        return 1

    import uvicorn

    async_engine.start()
    # Eager serving is ready once the engine runs; the lifecycle (graph capture) gates this later.
    app.state.readiness.set_ready("eager")
    log.info("listening on http://%s:%d (model %s)", config.host, config.port, config.model_name)
    try:
        uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level, access_log=False)
    finally:
        async_engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
