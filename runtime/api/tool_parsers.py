"""Tool-call formats of model families: parsing a model's output (whole or streamed) into OpenAI
``tool_calls``, the grammar that forces a call, and the prompt text that lists the tools.

Families (``--tool-call-parser``, runtime/worker.py; ``auto`` picks one from the chat template,
:func:`detect_family`):

- ``hermes`` (:class:`HermesParser`): Hermes 2/3, Qwen2.5, Qwen3 and other ChatML models. A call
  is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; several follow each other.
- ``llama3_json`` (:class:`Llama3JsonParser`): Llama 3.1/3.2/3.3 JSON tool calls. The output is
  ``{"name": ..., "parameters": {...}}`` (after an optional ``<|python_tag|>``), several separated
  by ``;``. Only an output that starts with ``{`` holds calls.

The rules of both parsers, streamed or not (a whole output is parsed by streaming it in one piece,
so the two always agree):

- a call's ``arguments`` is the JSON text the model wrote for them; the call's name is known, and
  sent, as soon as ``"name"`` is complete when it comes first (the grammar puts it first),
  otherwise when the call's object is complete;
- a call whose object does not parse as ``{"name": <string>, "arguments"/"parameters": ...}`` is
  passed through as content text, markers included;
- content is the text outside calls; whitespace next to a call is dropped (the model's newlines
  between calls), and text that may be the start of a call marker is held back until it is not;
- at most ``max_calls`` calls are kept (``parallel_tool_calls: false``: one); later ones are dropped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .protocol import random_hex

_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
"""The start of a call object whose name comes first and whose arguments are an object."""

_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON options for forced calls: one space after ``,`` and ``:``, no other whitespace
(the layout of the families' documented examples; a small model cannot pad a call with newlines)."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``arguments`` is JSON text, as the OpenAI API sends it."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict:
        """``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    """``call_`` and 24 random hex digits: the id of a tool call."""
    return "call_" + random_hex()[:24]


def _whole_call(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a complete call object, or None when it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        return obj["name"], args
    if isinstance(args, dict):
        return obj["name"], json.dumps(args, ensure_ascii=False)
    return None


class _CallObject:
    """One call object fed a piece at a time, from its ``{``: tracks JSON nesting (outside
    strings) to find where the arguments and the object end."""

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None
        self.end: int | None = None
        """Index just past the object's closing brace, once it came."""
        self.failed = False
        self._depth = 0
        self._in_str = self._escaped = False
        self._scanned = 0
        self._first_inner_end: int | None = None  # just past the first value closed inside the object
        self._sent = 0

    def _scan(self) -> None:
        for i in range(self._scanned, len(self.text)):
            c = self.text[i]
            if self._in_str:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_str = False
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 1 and self._first_inner_end is None:
                    self._first_inner_end = i + 1
                elif self._depth == 0:
                    self.end = i + 1
                    break
        self._scanned = len(self.text) if self.end is None else self.end

    def feed(self, piece: str) -> tuple[str | None, str]:
        """Add text; returns (the name when it became known now, else None; new arguments text).
        After the object's end, :attr:`rest` holds what followed it; :attr:`failed` is set when
        the complete object is not a call."""
        self.text += piece
        self._scan()
        new_name = None
        if self.name is None:
            head = _HEAD.match(self.text)
            if head is not None:
                self.name = new_name = json.loads(f'"{head.group(1)}"')
                self._sent = head.end()
            elif self.end is not None:
                whole = _whole_call(self.text[:self.end])
                if whole is None:
                    self.failed = True
                    return None, ""
                self.name, args = whole
                return self.name, args
            else:
                return None, ""
        stop = self._first_inner_end or self.end or len(self.text)
        args, self._sent = self.text[self._sent:stop], max(stop, self._sent)
        return new_name, args

    @property
    def rest(self) -> str:
        return self.text[self.end:] if self.end is not None else ""


class ToolCallStreamer:
    """Turns a model's text deltas into OpenAI streaming deltas: ``{"content": ...}`` or
    ``{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}`` when a
    call's name is known, then ``{"tool_calls": [{"index", "function": {"arguments": ...}}]}``
    fragments. Family subclasses implement :meth:`_run` (the module docstring has the rules).

    Args:
        max_calls: calls kept (later ones dropped); None: all.
    """

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.calls: list[list[str]] = []
        """[id, name, arguments so far] of each call, in order."""
        self._buf = ""
        self._ws = ""  # whitespace held back: content only if more content follows
        self._ws_before_call = ""  # given back when the call fails
        self._call: _CallObject | None = None
        self._mode = "start"

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    def feed(self, text: str) -> list[dict]:
        """The deltas a text delta completes (possibly none: text held back)."""
        out: list[dict] = []
        self._buf += text
        self._run(out, final=False)
        return out

    def finish(self) -> list[dict]:
        """The deltas left at the end of the output (held-back text; an unfinished call's raw
        text as content when its name never came)."""
        out: list[dict] = []
        self._run(out, final=True)
        if self._mode == "call" and self._call is not None and self._call.name is None:
            self._ws = self._ws_before_call
            self._content(out, self._raw_prefix() + self._call.text)
        if not self.calls and self._ws:
            _add(out, {"content": self._ws})
        self._ws = ""
        return out

    # -- helpers for the families
    def _run(self, out: list[dict], final: bool) -> None:
        raise NotImplementedError

    def _raw_prefix(self) -> str:
        """The marker text that opened the call being parsed (given back with a failed call)."""
        return ""

    def _content(self, out: list[dict], text: str) -> None:
        text = self._ws + text
        core = text.rstrip()
        self._ws = text[len(core):]
        if core:
            _add(out, {"content": core})

    def _room(self) -> bool:
        return self.max_calls is None or len(self.calls) < self.max_calls

    def _feed_call(self, out: list[dict], piece: str) -> str:
        """Feed the call being parsed; returns its state: ``open``, ``done`` or ``failed``."""
        if self._call is None:
            self._ws_before_call, self._ws, self._call = self._ws, "", _CallObject()
        name, args = self._call.feed(piece)
        if self._call.failed:
            self._ws = self._ws_before_call
            return "failed"
        if name is not None:
            call_id = new_call_id()
            self.calls.append([call_id, name, ""])
            _add(out, {"tool_calls": [{"index": len(self.calls) - 1, "id": call_id, "type": "function",
                                       "function": {"name": name, "arguments": ""}}]})
        if args:
            self.calls[-1][2] += args
            _add(out, {"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": args}}]})
        return "open" if self._call.end is None else "done"


def _add(out: list[dict], delta: dict) -> None:
    """Append a delta, merged into the last one when both are content or both extend the same
    call's arguments (a call's first delta, with its name, stays on its own)."""
    last = out[-1] if out else None
    if last is not None and "content" in delta and "content" in last:
        last["content"] += delta["content"]
    elif (last is not None and "tool_calls" in delta and "tool_calls" in last
          and "id" not in delta["tool_calls"][0] and "id" not in last["tool_calls"][0]
          and last["tool_calls"][0]["index"] == delta["tool_calls"][0]["index"]):
        last["tool_calls"][0]["function"]["arguments"] += delta["tool_calls"][0]["function"]["arguments"]
    else:
        out.append(delta)


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def collect(deltas: list[dict]) -> tuple[str | None, list[ToolCall]]:
    """A whole output's (content, calls) from its deltas; content is None when it is empty and
    there are calls (the OpenAI shape of a message that only calls tools)."""
    content, calls = "", []
    for delta in deltas:
        content += delta.get("content", "")
        for part in delta.get("tool_calls", ()):
            if "id" in part:
                calls.append([part["id"], part["function"]["name"], ""])
            calls[part["index"]][2] += part["function"]["arguments"]
    return (None if calls and not content else content), [ToolCall(*c) for c in calls]


class ToolCallParser:
    """A family's tool-call format. Subclasses set :attr:`name`, :attr:`args_key` and the
    streamer class, and write the prompt text."""

    name = ""
    args_key = "arguments"
    streamer_class: type[ToolCallStreamer] = ToolCallStreamer

    def streamer(self, max_calls: int | None = None) -> ToolCallStreamer:
        """A new streaming parser for one choice."""
        return self.streamer_class(max_calls)

    def parse(self, text: str, max_calls: int | None = None) -> tuple[str | None, list[ToolCall]]:
        """A whole output's (content, calls) (:func:`collect`)."""
        streamer = self.streamer(max_calls)
        return collect(streamer.feed(text) + streamer.finish())

    def call_schema(self, function: dict) -> dict:
        """The JSON schema of one call of ``function`` (an OpenAI ``function`` object): its name
        as a constant, then its parameters (``$defs`` moved to the top, where references point)."""
        params = dict(function.get("parameters") or {})
        params.setdefault("type", "object")
        defs = {key: params.pop(key) for key in ("$defs", "definitions") if key in params}
        return {"x-guidance": _COMPACT_JSON, "type": "object",
                "properties": {"name": {"const": function["name"]}, self.args_key: params},
                "required": ["name", self.args_key], "additionalProperties": False, **defs}

    def grammar(self, functions: list[dict], parallel: bool) -> str:
        """The Lark grammar (llguidance's dialect) of an output that is one call (``parallel``:
        one or more) of one of ``functions``, each call's arguments matching its parameters."""
        raise NotImplementedError

    def _rules(self, functions: list[dict]) -> list[str]:
        alternatives = " | ".join(f"f{i}" for i in range(len(functions)))
        return [f"function: {alternatives}"] + [
            f"f{i}: %json {json.dumps(self.call_schema(f), ensure_ascii=False)}" for i, f in enumerate(functions)]

    def system_prompt(self, functions: list[dict]) -> str:
        """The system-prompt text listing ``functions`` for a chat template that does not render
        ``tools`` (docs/worker.md, "Tool calling", quotes it)."""
        raise NotImplementedError

    def call_text(self, calls: list[tuple[str, dict]]) -> str:
        """Earlier calls ((name, arguments)) as the model writes them, for a chat template that
        does not render ``tool_calls``."""
        raise NotImplementedError

    def result_text(self, content: str) -> str:
        """A tool's result as the family shows it, for a chat template that does not render
        ``tool_calls``."""
        return content


def _tool_lines(functions: list[dict]) -> str:
    return "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)


# -- hermes -------------------------------------------------------------------------------------
class HermesStreamer(ToolCallStreamer):
    """The ``hermes`` format: ``<tool_call>`` + a call object + ``</tool_call>``, anywhere in the text."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._opening = self.START  # the marker and the whitespace after it, given back with a failed call

    def _raw_prefix(self) -> str:
        return self._opening

    def _run(self, out: list[dict], final: bool) -> None:
        while True:
            buf = self._buf
            if self._mode in ("start", "text"):
                i = buf.find(self.START)
                if i < 0:
                    keep = 0 if final else _held(buf, self.START)
                    self._content(out, buf[:len(buf) - keep])
                    self._buf = buf[len(buf) - keep:]
                    return
                self._content(out, buf[:i])
                self._buf, self._mode = buf[i + len(self.START):], "open"
            elif self._mode == "open":
                body = buf.lstrip()
                if not body and not final:
                    return
                if body.startswith("{"):
                    self._opening = self.START + buf[:len(buf) - len(body)]
                    self._buf, self._mode = body, ("call" if self._room() else "skip")
                    self._call = None
                else:
                    self._opening, self._mode = self.START, "raw"
            elif self._mode == "call":
                self._buf = ""
                state = self._feed_call(out, buf)
                if state == "open":
                    return
                self._buf = self._call.rest
                if state == "failed":
                    self._buf, self._mode = self._call.text, "raw"
                else:
                    self._mode = "close"
            elif self._mode in ("close", "skip", "raw"):
                i = buf.find(self.END)
                if i < 0:
                    if final and self._mode == "raw":
                        self._content(out, self._opening + buf)
                    if final or self._mode != "raw":  # dropped text: only a split end marker is kept
                        self._buf = "" if final else buf[len(buf) - _held(buf, self.END):]
                    return
                if self._mode == "raw":
                    self._content(out, self._opening + buf[:i + len(self.END)])
                self._buf, self._mode = buf[i + len(self.END):], "text"


class HermesParser(ToolCallParser):
    """Hermes 2/3, Qwen2.5, Qwen3 and other ChatML models (the module docstring)."""

    name = "hermes"
    streamer_class = HermesStreamer

    def grammar(self, functions: list[dict], parallel: bool) -> str:
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return "\n".join(["%llguidance {}", start, 'call: "<tool_call>\\n" function "\\n</tool_call>"',
                          *self._rules(functions)])

    def system_prompt(self, functions: list[dict]) -> str:
        # our wording; the markers and the call's JSON shape are the family's wire format
        return ("# Tools\n\nThese functions can be called, one JSON signature per line between <tools> and </tools>:\n"
                f"<tools>\n{_tool_lines(functions)}\n</tools>\n\n"
                "To call one (or several, one after the other), write for each call its name and arguments as "
                "one JSON object between <tool_call> and </tool_call>:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def call_text(self, calls: list[tuple[str, dict]]) -> str:
        return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n</tool_call>"
                         for n, a in calls)

    def result_text(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


# -- llama3_json --------------------------------------------------------------------------------
class Llama3JsonStreamer(ToolCallStreamer):
    """The ``llama3_json`` format: the whole output is calls when it starts with ``{`` (after an
    optional ``<|python_tag|>``), separated by ``;``."""

    PYTHON_TAG = "<|python_tag|>"

    def _run(self, out: list[dict], final: bool) -> None:
        while True:
            buf = self._buf
            if self._mode in ("start", "next"):
                body = buf.lstrip()
                if self._mode == "start" and body.startswith(self.PYTHON_TAG):
                    body = self._buf = body[len(self.PYTHON_TAG):]
                    continue
                waiting = not body or (self._mode == "start" and self.PYTHON_TAG.startswith(body))
                if waiting and not final:
                    return
                if body.startswith("{"):
                    self._buf, self._mode, self._call = body, ("call" if self._room() else "drop"), None
                else:
                    self._mode = "text"
            elif self._mode == "call":
                self._buf = ""
                state = self._feed_call(out, buf)
                if state == "open":
                    return
                self._buf, self._mode = self._call.rest, "sep"
                if state == "failed":
                    self._buf, self._mode = self._call.text, "text"
            elif self._mode == "sep":
                body = buf.lstrip()
                if not body:
                    self._buf = ""
                    return
                self._buf, self._mode = (body[1:], "next") if body[0] == ";" else (body, "text")
            elif self._mode == "text":
                self._content(out, buf)
                self._buf = ""
                return
            else:  # drop: calls past max_calls
                self._buf = ""
                return


class Llama3JsonParser(ToolCallParser):
    """Llama 3.1/3.2/3.3 JSON tool calls (the module docstring)."""

    name = "llama3_json"
    args_key = "parameters"
    streamer_class = Llama3JsonStreamer

    def grammar(self, functions: list[dict], parallel: bool) -> str:
        start = 'start: function ("; " function)*' if parallel else "start: function"
        return "\n".join(["%llguidance {}", start, *self._rules(functions)])

    def system_prompt(self, functions: list[dict]) -> str:
        # our wording; the call's JSON shape is the family's wire format
        return ("These functions can be called, one JSON signature per line:\n\n" + _tool_lines(functions) +
                '\n\nTo call one, answer with only a JSON object {"name": <function name>, "parameters": '
                "<an object of argument names and literal values>}.")

    def call_text(self, calls: list[tuple[str, dict]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)


PARSERS: dict[str, ToolCallParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser()}
"""The families by ``--tool-call-parser`` name."""

PARSER_CHOICES = ("auto", *PARSERS, "none")
"""The values of ``--tool-call-parser``."""


def detect_family(template: str | None) -> str:
    """The family a chat template's source writes calls in: ``hermes`` when it mentions
    ``<tool_call>``, ``llama3_json`` when it mentions ``<|python_tag|>`` or the ``ipython`` role
    (Llama 3.1+), else ``none``."""
    source = template or ""
    if "<tool_call>" in source:
        return "hermes"
    if "<|python_tag|>" in source or "ipython" in source:
        return "llama3_json"
    return "none"


def resolve_parser(flag: str, template: str | None) -> ToolCallParser | None:
    """The parser of ``--tool-call-parser`` ``flag`` (``auto``: :func:`detect_family` of
    ``template``); None for ``none``.

    Raises:
        ValueError: ``flag`` is not one of :data:`PARSER_CHOICES`.
    """
    if flag not in PARSER_CHOICES:
        raise ValueError(f"--tool-call-parser: expected one of {', '.join(PARSER_CHOICES)}, got {flag!r}")
    name = detect_family(template) if flag == "auto" else flag
    return PARSERS.get(name)
