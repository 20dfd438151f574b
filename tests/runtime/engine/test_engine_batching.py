"""Continuous batching on the real SmolLM2: batched, chunked and preempted requests generate exactly
the tokens they generate alone (greedy, float32)."""

import pytest

from graphserving.runtime.engine.core import LLMEngine
from graphserving.runtime.engine.output import CompletedChoice
from graphserving.runtime.engine.sequence import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "List three colours:",
    "Water boils at a temperature of",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown fox",
]
MAX_TOKENS = [6, 4, 7, 5, 6, 3]

GREEDY = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    return [smollm2.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def alone(smollm2, prompt_ids):
    """Each prompt generated on its own engine with no other request in flight."""
    from graphserving.contract.worker_config import EngineLimits

    results = []
    for ids, params in zip(prompt_ids, GREEDY):
        engine = LLMEngine(smollm2.model, smollm2.config, smollm2.tokenizer, EngineLimits(num_kv_blocks=16))
        results.append(engine.generate([ids], params)[0][0].token_ids)
    return results


def run_staggered(engine: LLMEngine, prompt_ids, params, first: int = 3) -> dict[str, CompletedChoice]:
    """Submit ``first`` requests, step twice, submit the rest, then run everything to completion."""
    done = {f"r{i}": CompletedChoice(0) for i in range(len(prompt_ids))}

    def drain():
        for out in engine.step():
            for delta in out.choices:
                done[out.request_id].add(delta)

    for i in range(first):
        engine.add_request(f"r{i}", prompt_ids[i], params[i])
    drain()
    drain()
    for i in range(first, len(prompt_ids)):
        engine.add_request(f"r{i}", prompt_ids[i], params[i])
    while engine.has_unfinished():
        drain()
    return done


@pytest.mark.slow
def test_concurrent_requests_of_different_lengths_match_running_alone(make_engine, prompt_ids, alone):
    engine = make_engine(max_num_seqs=8, max_num_batched_tokens=16)  # small budget: chunked prefill
    done = run_staggered(engine, prompt_ids, GREEDY)
    for i, expected in enumerate(alone):
        assert done[f"r{i}"].token_ids == expected, f"request {i} ({PROMPTS[i]!r})"
        assert done[f"r{i}"].finish_reason == "length"
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.slow
def test_preemption_under_a_tiny_kv_cache_still_completes_every_request_correctly(make_engine, prompt_ids, alone):
    # 7 usable blocks of 4 tokens = 28 slots for 6 requests of 8..28 tokens each.
    engine = make_engine(num_kv_blocks=8, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    done = run_staggered(engine, prompt_ids, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    for i, expected in enumerate(alone):
        assert done[f"r{i}"].token_ids == expected, f"request {i} ({PROMPTS[i]!r})"
    assert engine.block_manager.num_used_blocks == 0


def test_max_num_seqs_bounds_the_running_batch(make_engine, prompt_ids):
    engine = make_engine(max_num_seqs=2)
    for i, ids in enumerate(prompt_ids[:4]):
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=2, temperature=0.0))
    engine.step()
    assert engine.scheduler.num_running == 2
    assert engine.scheduler.num_waiting == 2
