"""The tokenizer built from GGUF metadata: encoding, chat template, streaming detokenisation."""

from __future__ import annotations

import pytest

from graphserving.runtime.model.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

QUESTION = "What is the capital of France?"


def test_question_round_trips_through_encode_and_decode(smollm2):
    tokenizer = smollm2.tokenizer
    ids = tokenizer.encode(QUESTION)
    assert ids == [1780, 314, 260, 3575, 282, 4649, 47]
    assert tokenizer.decode(ids) == QUESTION


def test_chat_template_from_gguf_renders_the_chatml_prompt(smollm2):
    prompt = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_matches_transformers_rendering(smollm2):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Spain?"}]
    for add_generation_prompt in (True, False):
        ours = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        reference = smollm2.tokenizer.hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours == reference


def test_special_tokens_of_the_rendered_prompt_encode_as_single_ids(smollm2):
    tokenizer = smollm2.tokenizer
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}]))
    assert ids[0] == tokenizer.encode("<|im_start|>")[0] == 1
    assert tokenizer.eos_token_ids == (2,) and ids.count(2) == 2  # two <|im_end|>
    assert tokenizer.decode(ids, skip_special_tokens=True).startswith("system\nYou are")


def test_template_errors_become_tokenizer_errors(smollm2):
    tokenizer = Tokenizer(smollm2.tokenizer.hf_tokenizer,
                          chat_template="{{ raise_exception('only user turns, got ' + messages[0]['role']) }}")
    with pytest.raises(TokenizerError, match="only user turns, got system"):
        tokenizer.apply_chat_template([{"role": "system", "content": "x"}])


def test_template_sandbox_refuses_unsafe_attribute_access(smollm2):
    tokenizer = Tokenizer(smollm2.tokenizer.hf_tokenizer,
                          chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TokenizerError):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


MULTI_BYTE = (
    "Grüße aus Köln! Ça va? 東京は日本の首都です。 Ελληνικά και русский текст. "
    "Emoji: 🎉🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵. Math: ∑ x² ≤ ∞; arrows → ⇒. "
) * 3


@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_detokenizer_equals_full_decode_on_multi_byte_text(smollm2, chunk):
    tokenizer = smollm2.tokenizer
    ids = tokenizer.encode(MULTI_BYTE)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.feed(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    assert "".join(deltas) == tokenizer.decode(ids) == MULTI_BYTE
    assert not any("\ufffd" in d for d in deltas)
    assert detok.text == MULTI_BYTE and detok.token_ids == ids


def test_incremental_detokenizer_holds_back_a_split_character(smollm2):
    tokenizer = smollm2.tokenizer
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1  # byte-level BPE splits this emoji over several tokens
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.feed(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.feed(ids[-1]) == "🚀"


def test_incremental_detokenizer_skips_special_tokens(smollm2):
    tokenizer = smollm2.tokenizer
    ids = tokenizer.encode("Paris.<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("The capital is"))
    text = "".join(detok.feed(i) for i in ids) + detok.flush()
    assert text == "Paris."


def test_decode_skips_the_transformers_wrapper_only_where_the_wrapper_adds_nothing(smollm2):
    """With ``clean_up_tokenization_spaces`` set, the Rust decoder serves ``decode`` only if the
    wrapper leaves the text alone (recent transformers do for byte-level BPE); else the wrapper."""
    hf = smollm2.tokenizer.hf_tokenizer
    ids = hf.encode(Tokenizer.CLEAN_UP_PROBE + " " + QUESTION, add_special_tokens=False)
    saved = {k: getattr(hf, k, None) for k in ("clean_up_tokenization_spaces",
                                                "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")}
    try:
        hf.clean_up_tokenization_spaces = True
        ignored = Tokenizer(hf)
        expected = hf.decode(ids, skip_special_tokens=True)
        assert ignored.decode(ids) == expected
        assert (ignored._fast_decoder is not None) == (expected == hf.backend_tokenizer.decode(ids))
        hf.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
        cleaned = Tokenizer(hf)
        assert cleaned.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert cleaned._fast_decoder is None or cleaned.decode(ids) == hf.backend_tokenizer.decode(ids)
    finally:
        for k, v in saved.items():
            setattr(hf, k, v)
