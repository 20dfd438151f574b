"""Greedy generation with our model through the paged KV cache equals transformers' generate()."""

from __future__ import annotations

import pytest
import torch

NEW_TOKENS = 24


def _chat(tokenizer, text):
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def _reference_greedy(reference, prompt, max_new_tokens):
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
def test_greedy_generations_are_token_identical_to_transformers(smollm2, smollm2_reference, paged_runner):
    tokenizer = smollm2.tokenizer
    prompts = [
        _chat(tokenizer, "What is the capital of France?"),
        _chat(tokenizer, "Write a haiku about the sea."),
        _chat(tokenizer, "List three uses of Python."),
        tokenizer.encode("Once upon a time, in a small village,"),
    ]
    # All prompts decode together as one batch, through scrambled block tables.
    ours = paged_runner(smollm2.model, num_blocks=160, table_width=40).greedy(prompts, NEW_TOKENS)
    for prompt, got in zip(prompts, ours):
        expected = _reference_greedy(smollm2_reference, prompt, NEW_TOKENS)
        assert got[:len(expected)] == expected, tokenizer.decode(prompt)


def test_greedy_chat_answer_names_paris(smollm2, paged_runner):
    tokenizer = smollm2.tokenizer
    (tokens,) = paged_runner(smollm2.model).greedy([_chat(tokenizer, "What is the capital of France?")], 12)
    answer = tokenizer.decode(tokens)
    assert "Paris" in answer, answer
