"""Where an engine step's time goes: cProfile of the host and torch.profiler of the device.

Starts the worker's engine in process (load, warmup, capture, canary: the worker's own start-up),
then runs ``LLMEngine.generate`` on N fixed prompts and prints the wall time, output tokens/s,
the host functions by own time (cProfile) and the device kernels by total time (torch.profiler).

    python3 bench/engine_profile.py --model FILE.gguf [--sequences 64 --prompt-tokens 32 --new-tokens 64]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from serve import fixed_prompts  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="GGUF file or preset:NAME")
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("worker_flags", nargs="*", help="extra worker flags after --")
    args = p.parse_args(argv)

    from graphserving.runtime import worker as worker_cli
    from graphserving.runtime.lifecycle.phases import WorkerLifecycle
    from graphserving.runtime.engine.sequence import SamplingParams

    flags = ["--model", args.model, "--max-num-seqs", str(max(args.sequences, 1)), *args.worker_flags]
    config = worker_cli.resolve_config(worker_cli.build_parser().parse_args(flags), environ={})
    loaded, load_s = worker_cli.load(config)
    lifecycle = WorkerLifecycle(config, loaded, loading_seconds=load_s)
    lifecycle.run()
    engine = lifecycle.engine
    if engine is None:
        print(f"worker did not start: {lifecycle.readiness.reason}")
        return 1
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    for n in (args.sequences, 1):
        prompts = fixed_prompts(n, args.prompt_tokens, 0)
        engine.generate(prompts, params)
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        wall = time.perf_counter() - start
        tokens = sum(len(c[0].token_ids) for c in out)
        print(f"\n=== {n} sequences: {tokens} tokens in {wall * 1e3:.1f} ms = {tokens / wall:.0f} tok/s", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        engine.generate(prompts, params)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.top)
        print(buf.getvalue())
        if torch.cuda.is_available():
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
                engine.generate(prompts, params)
                torch.cuda.synchronize()
            print(tp.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
