"""The sampler on hand-made logits: each transformation, seeds and log-probabilities."""

import pytest
import torch

from graphserving.runtime.engine.sampler import (
    SamplingTensors,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    counter_uniform,
    sample,
)

V = 6


def tensors(rows: int, *, temperature=1.0, top_k=V, top_p=1.0, min_p=0.0, rep=1.0, presence=0.0, frequency=0.0,
            seeds=None, steps=None, prompt=None, output=None, num_logprobs=-1, all_greedy=False) -> SamplingTensors:
    def full(v, dtype=torch.float32):
        return torch.as_tensor(v, dtype=dtype).expand(rows).clone() if not isinstance(v, list) else torch.tensor(v, dtype=dtype)

    return SamplingTensors(
        temperature=full(temperature), top_k=full(top_k, torch.int64), top_p=full(top_p), min_p=full(min_p),
        repetition_penalty=full(rep), presence_penalty=full(presence), frequency_penalty=full(frequency),
        seeds=full(seeds if seeds is not None else 0, torch.int64), steps=full(steps if steps is not None else 0, torch.int64),
        prompt_token_ids=prompt if prompt is not None else torch.full((rows, 1), V),
        output_token_ids=output if output is not None else torch.full((rows, 1), V),
        num_logprobs=num_logprobs, all_greedy=all_greedy,
    )


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.log(torch.tensor([probs], dtype=torch.float32))


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.0, 0, 0, 0], [5.0, 1.0, 0, 0, 0, 0]])
    out = sample(logits, tensors(2, temperature=0.0, all_greedy=True))
    assert out.token_ids.tolist() == [1, 0]


def test_greedy_and_random_rows_mix_in_one_batch():
    logits = torch.tensor([[0.1, 3.0, 2.0, 0, 0, 0], [0.1, 3.0, 2.0, 0, 0, 0]])
    out = sample(logits, tensors(2, temperature=[0.0, 1.0], top_k=[V, 1]))
    assert out.token_ids.tolist() == [1, 1]


def test_same_seed_and_step_give_the_same_token_whatever_the_batch():
    probs = [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]
    alone = sample(logits_of(probs), tensors(1, seeds=[42], steps=[3])).token_ids.tolist()
    batch_logits = torch.cat([logits_of(probs[::-1]), logits_of(probs), logits_of(probs[::-1])])
    in_batch = sample(batch_logits, tensors(3, seeds=[7, 42, 9], steps=[0, 3, 5])).token_ids.tolist()
    assert in_batch[1] == alone[0]


def test_seeded_draws_follow_the_distribution():
    probs = [0.5, 0.25, 0.125, 0.125, 0.0, 0.0]
    n = 4000
    logits = logits_of(probs).expand(n, V).clone()
    out = sample(logits, tensors(n, seeds=list(range(n)), steps=[0] * n))
    freq = torch.bincount(out.token_ids, minlength=V).double() / n
    # 4000 draws: standard error <= 0.008, so 0.03 is about four sigma; the seeds are fixed
    assert freq.tolist() == pytest.approx(probs, abs=0.03)


def test_counter_noise_is_a_function_of_seed_step_and_column_only():
    a = counter_uniform(torch.tensor([5, 6]), torch.tensor([1, 1]), 50)
    b = counter_uniform(torch.tensor([6]), torch.tensor([1]), 50)
    assert torch.equal(a[1], b[0])
    assert not torch.equal(a[0], a[1])
    assert float(a.min()) > 0 and float(a.max()) < 1


def test_top_k_keeps_the_k_most_likely_tokens():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0, -1.0]])
    masked = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(masked).tolist() == [[False, True, True, False, False, False]]


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    logits = logits_of([0.5, 0.3, 0.15, 0.05, 0.0, 0.0])
    masked = apply_top_k_top_p(logits, torch.tensor([V]), torch.tensor([0.7]))
    assert torch.isfinite(masked).tolist() == [[True, True, False, False, False, False]]


def test_top_p_always_keeps_the_top_token():
    logits = logits_of([0.9, 0.1, 0.0, 0.0, 0.0, 0.0])
    masked = apply_top_k_top_p(logits, torch.tensor([V]), torch.tensor([0.01]))
    assert torch.isfinite(masked).tolist() == [[True, False, False, False, False, False]]


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    logits = logits_of([0.5, 0.3, 0.15, 0.05, 0.0, 0.0])
    masked = apply_min_p(logits, torch.tensor([0.5]))  # threshold 0.25
    assert torch.isfinite(masked).tolist() == [[True, True, False, False, False, False]]
    assert torch.equal(apply_min_p(logits, torch.tensor([0.0])), logits)


def test_sampling_only_draws_allowed_tokens():
    logits = logits_of([0.3, 0.3, 0.2, 0.1, 0.05, 0.05]).expand(200, V).clone()
    out = sample(logits, tensors(200, top_k=2, seeds=list(range(200))))
    assert set(out.token_ids.tolist()) == {0, 1}


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])
    prompt = torch.tensor([[0, 1, V]])
    output = torch.tensor([[3, V, V]])
    ours = apply_penalties(logits, tensors(1, rep=1.3, prompt=prompt, output=output))
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([[0, 1, 3]]), logits.clone())
    assert torch.allclose(ours, ref)


def test_presence_and_frequency_penalties_follow_openai_definition():
    logits = torch.zeros(1, V)
    output = torch.tensor([[2, 2, 2, 4, V]])
    prompt = torch.tensor([[1, V]])  # prompt tokens are not penalised by presence/frequency
    out = apply_penalties(logits, tensors(1, presence=0.5, frequency=0.25, prompt=prompt, output=output))
    assert out.tolist() == [[0.0, 0.0, -(0.5 + 3 * 0.25), 0.0, -(0.5 + 0.25), 0.0]]


def test_logprobs_are_those_of_the_raw_model_distribution():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0, 0.0, 0.0]])
    out = sample(logits, tensors(1, temperature=0.0, rep=2.0, prompt=torch.tensor([[2]]), num_logprobs=2))
    ref = torch.log_softmax(logits, dim=-1)
    # the penalty moves the argmax to token 1, whose raw log-probability is reported
    assert out.token_ids.tolist() == [1]
    assert out.logprobs.tolist() == pytest.approx([ref[0, 1].item()])
    assert out.top_token_ids.tolist() == [[2, 1]]
    assert out.top_logprobs[0].tolist() == pytest.approx([ref[0, 2].item(), ref[0, 1].item()])


def test_temperature_sharpens_the_distribution():
    logits = logits_of([0.4, 0.3, 0.2, 0.1, 0.0, 0.0]).expand(2000, V).clone()
    cold = sample(logits, tensors(2000, temperature=0.25, seeds=list(range(2000))))
    share_top = (cold.token_ids == 0).double().mean().item()
    p = torch.softmax(logits[0] / 0.25, dim=-1)[0].item()
    assert share_top == pytest.approx(p, abs=0.04)
    assert p > 0.6  # vs 0.4 at temperature 1
