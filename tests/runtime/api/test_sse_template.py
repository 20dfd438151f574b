"""The pre-serialised chunk of a stream gives the same bytes as serialising the whole chunk (pure)."""

import pytest

from graphserving.runtime.api.protocol import TEXT_SLOT, sse_event, sse_text_template

TEXTS = ["", " fox", 'say "hi"', "back\\slash", "line\nbreak\ttab", "\u00e9t\u00e9 \u2014 \U0001F600", "\x00\x1f", "</script>"]


def chat_chunk(content):
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m",
            "choices": [{"index": 3, "delta": {"content": content}, "logprobs": None, "finish_reason": None}]}


@pytest.mark.parametrize("text", TEXTS)
def test_the_template_equals_the_whole_serialisation(text):
    assert sse_text_template(chat_chunk(TEXT_SLOT))(text) == sse_event(chat_chunk(text))


def test_a_payload_without_exactly_one_slot_is_refused():
    with pytest.raises(ValueError, match="0 times"):
        sse_text_template(chat_chunk("no slot"))
    with pytest.raises(ValueError, match="2 times"):
        sse_text_template({"a": TEXT_SLOT, "b": TEXT_SLOT})
