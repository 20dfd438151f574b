"""Prefix caching on the real SmolLM2 engine (CPU, float32): the same tokens with and without it, for
greedy and seeded sampling, requests sharing a long system prompt and arriving before, during and
after each other; the hits and the prefill saved, read from the engine's metrics; prompt
log-probabilities unchanged."""

import pytest

from graphserving.runtime.engine.sequence import SamplingParams

LABELS = {"model_name": "smollm2"}
SYSTEM = ("You are a helpful assistant for a small bakery in the old town. You answer questions about "
          "opening hours, the bread and cakes of the day, prices and allergens, briefly and politely, "
          "and you never invent a product the bakery does not sell. The bakery opens at seven every day "
          "but Monday and closes at six, at one on Sundays. Every bread is baked on the premises from "
          "organic flour; the rye bread and the baguette are vegan, the brioche is not.")
QUESTIONS = ["When do you open on Sundays?", "Is the rye bread vegan?", "How much is a croissant?",
             "Do you sell gluten-free cakes?", "Can I order a birthday cake?"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm2):
    tok = smollm2.tokenizer
    chats = [tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
             for q in QUESTIONS]
    return [tok.encode(chat) for chat in chats]


def value(engine, name: str) -> float:
    return engine.metrics.registry.get_sample_value(name, LABELS)


def serve(engine, prompts, params) -> dict[str, list[int]]:
    """Request 0 alone to its end; then 1 and 2 together; 3 and 4 while those decode. Returns each
    request's tokens."""
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            assert not out.error
            for delta in out.choices:
                tokens.setdefault(out.request_id, []).extend(delta.token_ids)

    def add(i: int) -> None:
        engine.add_request(f"r{i}", prompts[i], params[i])

    add(0)
    while engine.has_unfinished():
        step()
    add(1)
    add(2)
    step()
    step()
    add(3)
    add(4)
    while engine.has_unfinished():
        step()
    return tokens


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_outputs_are_the_same_with_and_without_prefix_caching_and_the_cache_is_hit(make_engine, prompts, sampling):
    params = [GREEDY] * 5 if sampling == "greedy" else [seeded(100 + i) for i in range(5)]
    cached, plain = make_engine(metrics=True), make_engine(metrics=True, prefix_caching=False)
    with_cache, without = serve(cached, prompts, params), serve(plain, prompts, params)
    assert with_cache == without and all(len(t) == 6 for t in without.values())

    shared = next(i for i, column in enumerate(zip(*prompts)) if len(set(column)) > 1)  # system prompt + template
    hits = value(cached, "graphserving_prefix_cache_hit_tokens_total")
    assert hits == 4 * (shared // 16) * 16 > 0  # requests 1..4 each find the full blocks of the shared prefix
    assert value(cached, "graphserving_prefix_cache_query_tokens_total") == sum(map(len, prompts))
    assert value(plain, "graphserving_prefix_cache_hit_tokens_total") == 0
    assert value(plain, "graphserving_prefix_cache_query_tokens_total") == 0
    # every forward-pass token row the cache saved is a prompt token not prefilled (no preemption here)
    rows_cached, rows_plain = (value(e, "graphserving_batch_tokens_sum") for e in (cached, plain))
    assert rows_plain - rows_cached == hits
    assert value(cached, "graphserving_preemptions_total") == value(plain, "graphserving_preemptions_total") == 0


def test_finished_requests_leave_their_blocks_cached_and_counted_free(make_engine, prompts):
    engine = make_engine(metrics=True)
    engine.generate(prompts[:2], GREEDY)
    assert value(engine, "graphserving_kv_cache_used_blocks") == 0
    assert value(engine, "graphserving_kv_cache_usage_ratio") == 0
    cached = value(engine, "graphserving_prefix_cache_blocks")
    assert cached == engine.block_manager.num_cached_blocks >= len(prompts[0]) // 16
    stats = engine.scheduler.prefix_cache_stats()
    assert stats.hit_tokens == value(engine, "graphserving_prefix_cache_hit_tokens_total")
    assert stats.query_tokens == value(engine, "graphserving_prefix_cache_query_tokens_total")


def test_a_request_with_prompt_logprobs_scores_every_prompt_token_though_its_prefix_is_cached(make_engine, prompts):
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    results = {}
    for caching in (True, False):
        engine = make_engine(metrics=True, prefix_caching=caching)
        engine.generate([prompts[0]], GREEDY)  # caches the system prompt (when on)
        (choice,) = engine.generate([prompts[1]], params)[0]
        results[caching] = choice
    on, off = results[True], results[False]
    assert len(on.prompt_logprobs) == len(prompts[1]) and on.prompt_logprobs[0] is None
    assert [e.token_id for e in on.prompt_logprobs[1:]] == prompts[1][1:]
    assert [(e.token_id, e.rank, [t for t, _ in e.top]) for e in on.prompt_logprobs[1:]] == \
        [(e.token_id, e.rank, [t for t, _ in e.top]) for e in off.prompt_logprobs[1:]]
    assert [e.logprob for e in on.prompt_logprobs[1:]] == pytest.approx([e.logprob for e in off.prompt_logprobs[1:]],
                                                                          abs=1e-5)
    assert on.token_ids == off.token_ids
