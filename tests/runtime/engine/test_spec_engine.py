"""Speculative decoding through the engine (``EngineLimits.speculative = "ngram:k"``) on the real
SmolLM2 (CPU, float32): the same tokens as without it, greedy and seeded, on copy-heavy prompts
where drafts are accepted (asserted); stop strings and stop tokens cutting a verified run; no
drafts for structured output; the prefix cache holding only accepted tokens; the counters."""

import pytest

from graphserving.runtime.engine.sequence import SamplingParams, StructuredOutput

LABELS = {"model_name": "smollm2"}
CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n    return a / b\n")
PASSAGE = ("The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed "
           "the one hundred and twelve steps, trimmed the wick and wound the clockwork that turned the lens.")


def greedy(max_tokens: int = 40, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def seeded(seed: int, max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm2):
    tok = smollm2.tokenizer
    asks = [f"Repeat this code exactly:\n{CODE}", f"Copy this passage word for word:\n{PASSAGE}",
            "Write a haiku about autumn rain."]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": a}])) for a in asks]


def run(engine, prompts, params) -> list[list[int]]:
    return [choices[0].token_ids for choices in engine.generate(prompts, params)]


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_is_token_for_token_the_same_with_and_without_speculation(make_engine, prompts, k):
    plain = run(make_engine(num_scheduler_steps=1), prompts, greedy())
    engine = make_engine(num_scheduler_steps=1, speculative=f"ngram:{k}")
    assert run(engine, prompts, greedy()) == plain
    stats = engine.spec.stats
    assert stats.accepted_tokens > 0 and stats.emitted_tokens > stats.verifications


def test_seeded_sampling_is_the_same_with_and_without_speculation(make_engine, prompts):
    params = [seeded(7), seeded(8), seeded(9)]
    plain = run(make_engine(num_scheduler_steps=1), prompts, params)
    engine = make_engine(num_scheduler_steps=1, speculative="ngram:4")
    assert run(engine, prompts, params) == plain
    assert engine.spec.stats.accepted_tokens > 0


def test_a_multi_step_engine_drafts_too_and_decodes_the_same(make_engine, prompts):
    plain = run(make_engine(num_scheduler_steps=8), prompts, greedy())
    engine = make_engine(num_scheduler_steps=8, speculative="ngram:3")
    assert run(engine, prompts, greedy()) == plain
    assert engine.spec.stats.accepted_tokens > 0


def test_a_stop_string_inside_a_verified_run_cuts_it_as_without_speculation(make_engine, prompts, smollm2):
    params = greedy(60, stop=("return a * b",))
    [[plain]] = make_engine().generate([prompts[0]], params)
    engine = make_engine(speculative="ngram:4")
    [[spec]] = engine.generate([prompts[0]], params)
    assert (spec.text, spec.token_ids, spec.finish_reason) == (plain.text, plain.token_ids, plain.finish_reason)
    assert spec.finish_reason == "stop" and "return a + b" in spec.text
    stats = engine.spec.stats
    assert stats.emitted_tokens + 1 > len(spec.token_ids)  # tokens verified after the stop were discarded


def test_a_stop_token_inside_a_verified_run_ends_it_there(make_engine, prompts, smollm2):
    [[whole]] = make_engine().generate([prompts[0]], greedy(40))
    stop = whole.token_ids[20]
    params = greedy(40, stop_token_ids=(stop,))
    [[plain]] = make_engine().generate([prompts[0]], params)
    engine = make_engine(speculative="ngram:4")
    [[spec]] = engine.generate([prompts[0]], params)
    assert (spec.token_ids, spec.finish_reason, spec.stop_reason) == (plain.token_ids, "stop", stop)
    assert engine.spec.stats.accepted_tokens > 0


def test_max_tokens_is_never_passed_and_streams_see_every_token_once(make_engine, prompts):
    engine = make_engine(speculative="ngram:4")
    for max_tokens in (1, 2, 7, 23):
        [[choice]] = engine.generate([prompts[0]], greedy(max_tokens))
        assert len(choice.token_ids) == max_tokens and choice.finish_reason == "length"
    plain = run(make_engine(), [prompts[1]], greedy(30))[0]
    streamed: list[int] = []
    engine.add_request("s", prompts[1], greedy(30), stream_interval=1,
                       on_output=lambda out: [streamed.extend(d.token_ids) for d in out.choices])
    while engine.has_unfinished():
        engine.step()
    assert streamed == plain


def test_structured_output_requests_never_draft(make_engine, prompts):
    params = greedy(30, structured=StructuredOutput("json_object"))
    plain = run(make_engine(), [prompts[0]], params)
    engine = make_engine(speculative="ngram:4")
    out = run(engine, [prompts[0]], params)
    assert out == plain
    assert engine.tokenizer.decode(out[0]).startswith("{")
    assert engine.spec.stats.proposed_tokens == 0


def test_the_prefix_cache_holds_only_accepted_tokens(make_engine, prompts):
    engine = make_engine(speculative="ngram:4")
    first = run(engine, [prompts[0]], greedy(48))[0]
    assert engine.spec.stats.accepted_tokens > 0
    follow_up = prompts[0] + first  # its prefix is the first request's prompt and its verified output
    reused = run(engine, [follow_up], greedy(16))[0]
    assert engine.scheduler.prefix_cache_hit_tokens >= (len(follow_up) - 1) // 16 * 16 - 16
    assert reused == run(make_engine(prefix_caching=False), [follow_up], greedy(16))[0]


def test_the_metrics_count_what_the_stats_count(make_engine, prompts):
    engine = make_engine(metrics=True, speculative="ngram:4")
    run(engine, prompts[:2], greedy(24))
    stats, registry = engine.spec.stats, engine.metrics.registry
    assert registry.get_sample_value("graphserving_spec_decode_proposed_tokens_total", LABELS) == stats.proposed_tokens
    assert registry.get_sample_value("graphserving_spec_decode_accepted_tokens_total", LABELS) == stats.accepted_tokens
    for j in range(8):
        labels = {**LABELS, "position": str(j)}
        proposed = registry.get_sample_value("graphserving_spec_decode_proposed_tokens_per_position_total", labels)
        accepted = registry.get_sample_value("graphserving_spec_decode_accepted_tokens_per_position_total", labels)
        expected = (stats.proposed_per_position[j], stats.accepted_per_position[j]) if j < 4 else (0, 0)
        assert (proposed, accepted) == expected
    assert stats.accepted_tokens > 0
