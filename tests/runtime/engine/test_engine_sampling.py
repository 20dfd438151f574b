"""Sampling, stop conditions, log-probabilities, abort and metrics through the engine on SmolLM2."""

import pytest

from graphserving.runtime.engine.sequence import RequestError, SamplingParams

PROMPT = "My favourite animal is"
OTHER = "In the beginning of the story, the hero"


@pytest.fixture(scope="module")
def ids(smollm2):
    return smollm2.tokenizer.encode(PROMPT)


@pytest.fixture(scope="module")
def other_ids(smollm2):
    return smollm2.tokenizer.encode(OTHER)


SEEDED = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(make_engine, ids, other_ids):
    alone = make_engine().generate([ids], SEEDED)[0][0].token_ids
    again = make_engine().generate([ids], SEEDED)[0][0].token_ids
    other = SamplingParams(max_tokens=4, temperature=1.0, seed=99, ignore_eos=True)
    batched = make_engine().generate([other_ids, ids, other_ids], [other, SEEDED, other])[1][0].token_ids
    assert alone == again
    assert batched == alone


def test_choices_of_one_request_get_distinct_seeds(make_engine, ids):
    params = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    first, second = make_engine().generate([ids], params)[0]
    # choice i samples with seed + i: choice 1 of seed 7 equals choice 0 of seed 8
    single = make_engine().generate([ids], SamplingParams(max_tokens=6, temperature=1.0, seed=8, ignore_eos=True))
    assert second.token_ids == single[0][0].token_ids
    assert first.token_ids != second.token_ids


def test_max_tokens_ends_with_length(make_engine, ids):
    out = make_engine().generate([ids], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0][0]
    assert len(out.token_ids) == 3
    assert out.finish_reason == "length"


def test_a_stop_string_ends_generation_and_is_cut_from_the_text(make_engine, ids, smollm2):
    free = make_engine().generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0][0]
    text = smollm2.tokenizer.decode(free.token_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = make_engine().generate([ids], SamplingParams(max_tokens=8, temperature=0.0, stop=(stop,), ignore_eos=True))[0][0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop


def test_a_stop_token_id_ends_generation(make_engine, ids):
    free = make_engine().generate([ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0][0]
    stop_token = free.token_ids[2]
    first = free.token_ids.index(stop_token)
    out = make_engine().generate(
        [ids], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(stop_token,), ignore_eos=True)
    )[0][0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_token


def test_eos_ends_a_chat_answer(make_engine, smollm2):
    tok = smollm2.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    out = make_engine().generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0][0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in smollm2.config.eos_token_ids
    assert out.stop_reason is None


def test_logprobs_report_the_sampled_token_and_the_top_alternatives(make_engine, ids):
    out = make_engine().generate([ids], SamplingParams(max_tokens=3, temperature=0.0, logprobs=3, ignore_eos=True))[0][0]
    assert len(out.logprobs) == 3
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry.token_id == token
        assert len(entry.top) == 3
        # greedy: the sampled token is the most likely one
        assert entry.top[0] == (token, pytest.approx(entry.logprob))
        assert entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]
        assert entry.logprob <= 0.0


def test_abort_finishes_the_request_and_frees_its_blocks(make_engine, ids):
    engine = make_engine()
    engine.add_request("a", ids, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    engine.abort("a")
    outs = engine.step()
    assert [(o.request_id, o.finished, o.choices[0].finish_reason) for o in outs] == [("a", True, "abort")]
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished()


def test_prompt_longer_than_the_context_is_refused_naming_the_prompt(make_engine):
    engine = make_engine(num_kv_blocks=5, block_size=4)  # 16-token context
    with pytest.raises(RequestError) as err:
        engine.add_request("long", list(range(1, 17)), SamplingParams())
    assert err.value.param == "prompt"
    assert err.value.code == "context_length_exceeded"
    assert "16 tokens" in str(err.value)


def test_max_tokens_is_capped_by_the_context(make_engine):
    engine = make_engine(num_kv_blocks=5, block_size=4)  # 16-token context
    out = engine.generate([list(range(100, 112))], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    assert len(out[0][0].token_ids) == 4
    assert out[0][0].finish_reason == "length"


def test_metrics_count_tokens_requests_and_kv_blocks(make_engine, ids):
    engine = make_engine(metrics=True)
    engine.generate([ids, ids], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    text = engine.metrics.render().decode()
    assert 'graphserving_generation_tokens_total{model_name="smollm2"} 6.0' in text
    assert f'graphserving_prompt_tokens_total{{model_name="smollm2"}} {2.0 * len(ids)}' in text
    assert 'graphserving_requests_total{finish_reason="length",model_name="smollm2"} 2.0' in text
    assert 'graphserving_kv_cache_capacity_blocks{model_name="smollm2"} 63.0' in text
    assert 'graphserving_kv_cache_used_blocks{model_name="smollm2"} 0.0' in text
    assert 'graphserving_time_per_output_token_seconds_count{model_name="smollm2"} 2.0' in text
    assert 'graphserving_time_to_first_token_seconds_count{model_name="smollm2"} 2.0' in text
    # one prefill step of 2 rows, then 2 decode steps of 2 rows
    assert 'graphserving_batch_size_bucket{le="2.0",model_name="smollm2"} 3.0' in text
