"""Compare grammar libraries for structured output on the shipped model's tokenizer.

For llguidance (the engine's choice, runtime/engine/structured.py) and xgrammar (when installed):
the one-off tokenizer set-up, the compile time of a few JSON schemas, and the host time to fill one
row's allowed-token bitmask at each token of a schema-valid output (median and p99), plus
llguidance's parallel fill of a 64-row batch. Prints a table and one JSON line.

    python3 bench/grammar_libraries.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf [--rows 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMAS = {
    "person": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "age"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"]}),
    "tool_call": ({"type": "object", "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14}},
            "required": ["city", "unit"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}),
    "nested": ({"type": "object", "properties": {
        "order": {"type": "object", "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "items": {"type": "array", "items": {"type": "object", "properties": {
                "sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"}},
                "required": ["sku", "qty", "price"]}}},
            "required": ["id", "items"]}},
        "required": ["order"]},
        {"order": {"id": "ABC-1234", "items": [{"sku": "x-1", "qty": 2, "price": 9.5},
                                              {"sku": "y-22", "qty": 1, "price": 120.0}]}}),
}


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _us(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return round(statistics.median(ordered) * 1e6, 1), round(ordered[int(0.99 * (len(ordered) - 1))] * 1e6, 1)


def bench_llguidance(hf, eos: int, rows: int) -> dict:
    import llguidance
    import llguidance.torch

    from graphserving.runtime.engine.structured import byte_level_json

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(byte_level_json(hf.backend_tokenizer), n_vocab=len(hf), eos_token=eos)
    out = {"tokenizer_ms": _ms(time.perf_counter() - t0), "schemas": {}}
    executor = llguidance.LLExecutor()
    for name, (schema, example) in SCHEMAS.items():
        ids = hf.encode(json.dumps(example), add_special_tokens=False) + [eos]
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        compile_s = time.perf_counter() - t0
        mask = llguidance.torch.allocate_token_bitmask(rows, len(hf))
        fills = []
        for t in ids:
            t0 = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
            fills.append(time.perf_counter() - t0)
            assert matcher.consume_token(t), (name, t)
        batch = [llguidance.LLMatcher(tok, grammar, log_level=0) for _ in range(rows)]
        batch_fills = []
        for t in ids[:-1]:
            t0 = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(batch)], mask)
            batch_fills.append(time.perf_counter() - t0)
            for m in batch:
                m.consume_token(t)
        median, p99 = _us(fills)
        out["schemas"][name] = {"tokens": len(ids), "compile_ms": _ms(compile_s), "fill_us_median": median,
                                "fill_us_p99": p99, f"fill_{rows}_rows_us_median": _us(batch_fills)[0]}
    return out


def bench_xgrammar(hf, eos: int, rows: int) -> dict | None:
    try:
        import xgrammar
    except ImportError:
        return None
    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf), stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    out = {"tokenizer_ms": _ms(time.perf_counter() - t0), "schemas": {}}
    for name, (schema, example) in SCHEMAS.items():
        ids = hf.encode(json.dumps(example), add_special_tokens=False) + [eos]
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema))
        matcher = xgrammar.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - t0
        mask = xgrammar.allocate_token_bitmask(rows, info.vocab_size)
        fills = []
        for t in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            fills.append(time.perf_counter() - t0)
            if not matcher.accept_token(t):  # its reading of this tokenizer's vocabulary
                return {"error": f"{name}: xgrammar refused token {t} of a schema-valid output"}
        batch = [xgrammar.GrammarMatcher(compiled) for _ in range(rows)]
        batch_fills = []
        for t in ids[:-1]:
            t0 = time.perf_counter()
            for i, m in enumerate(batch):
                m.fill_next_token_bitmask(mask, i)
            batch_fills.append(time.perf_counter() - t0)
            for m in batch:
                m.accept_token(t)
        median, p99 = _us(fills)
        out["schemas"][name] = {"tokens": len(ids), "compile_ms": _ms(compile_s), "fill_us_median": median,
                                "fill_us_p99": p99, f"fill_{rows}_rows_us_median": _us(batch_fills)[0]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, help="the SmolLM2 GGUF (its tokenizer is used)")
    ap.add_argument("--rows", type=int, default=64, help="rows of the batch fill")
    args = ap.parse_args()
    from graphserving.runtime.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(args.gguf)
    hf, eos = tokenizer.hf_tokenizer, tokenizer.eos_token_ids[0]
    results = {"llguidance": bench_llguidance(hf, eos, args.rows), "xgrammar": bench_xgrammar(hf, eos, args.rows)}
    print(f"{'library':<11} {'schema':<10} {'compile ms':>10} {'fill µs p50':>11} {'fill µs p99':>11} "
          f"{f'{args.rows} rows µs':>12}")
    for lib, res in results.items():
        if res is None or "error" in res:
            print(f"{lib:<11} {'not installed' if res is None else res['error']}")
            continue
        for name, r in res["schemas"].items():
            print(f"{lib:<11} {name:<10} {r['compile_ms']:>10} {r['fill_us_median']:>11} {r['fill_us_p99']:>11} "
                  f"{r[f'fill_{args.rows}_rows_us_median']:>12}")
        print(f"{lib:<11} tokenizer set-up {res['tokenizer_ms']} ms")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
