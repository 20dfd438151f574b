"""Tool calling for chat requests: ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` checked,
passed to the chat template, and (``required``, a named function) enforced by a grammar; the
model's output parsed back into ``tool_calls`` by the family parser (runtime/api/tool_parsers.py).

- The tools reach the template as ``tools`` (OpenAI function tools are the JSON-schema shape
  Hugging Face templates expect). A template that never mentions ``tools`` (SmolLM2's ChatML one)
  gets them in the system message instead, in the family's words (:meth:`ToolCallParser.system_prompt`).
- Earlier calls in the conversation reach the template as Hugging Face templates expect them:
  ``tool_calls[j].function.arguments`` as a dict (the OpenAI API sends JSON text), and a ``tool``
  message gets the ``name`` of the call it answers (``tool_call_id``) when it has none. A template
  that never mentions ``tool_calls`` sees them as text in the family's format instead.
- ``tool_choice``: ``none`` (the default without tools): the tools are not shown and the output is
  not parsed; ``auto`` (the default with tools): the output is parsed, unconstrained; ``required``
  / a named function: the output is constrained to one call (``parallel_tool_calls``: one or more)
  of any tool / that tool, by a grammar (:class:`StructuredOutput` kind ``grammar``, ``param``
  ``tool_choice``). ``parallel_tool_calls: false`` keeps the first call of an ``auto`` output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..engine.structured import StructuredOutput
from .protocol import APIError, ChatCompletionRequest, ChatTool
from .tool_parsers import ToolCallParser


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools change.

    Attributes:
        family: the worker's tool-call format (``--tool-call-parser``), or None; it writes earlier
            calls for templates that do not render ``tool_calls``.
        parse: parse the output into ``tool_calls`` with ``family``.
        functions: the tools' ``function`` objects shown to the model (empty: none).
        template_tools: the tools as the template's ``tools`` variable, or None (not rendered
            there: ``functions`` go into the system message).
        constraint: the grammar of ``tool_choice`` required / named, or None.
        max_calls: calls kept from the output (1 without ``parallel_tool_calls``), or None.
    """

    family: ToolCallParser | None = None
    parse: bool = False
    functions: list[dict] = field(default_factory=list)
    template_tools: list[dict] | None = None
    constraint: StructuredOutput | None = None
    max_calls: int | None = None


def check_tools(tools: list[ChatTool]) -> None:
    """Raises:
        APIError: 400 naming the field for a duplicate function name or ``parameters`` that are
            not an object schema (OpenAI requires ``"type": "object"``)."""
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        fn = tool.function
        if fn.name in seen:
            raise APIError(400, f"tools[{i}].function.name: {fn.name!r} is already the name of tools[{seen[fn.name]}]; "
                           "function names must be unique", param=f"tools[{i}].function.name", code="invalid_value")
        seen[fn.name] = i
        kind = (fn.parameters or {}).get("type", "object")
        if kind != "object":
            raise APIError(400, f"tools[{i}].function.parameters: must be a JSON schema of type object, got type "
                           f"{json.dumps(kind)}", param=f"tools[{i}].function.parameters", code="invalid_value")


def _check_schemas(tools: list[ChatTool], indices: list[int]) -> None:
    """Compile the parameters schema of each tool a grammar will force (llguidance, no tokenizer).

    Raises:
        APIError: 400 naming ``tools[i].function.parameters`` with the compiler's message.
    """
    import llguidance

    for i in indices:
        params = tools[i].function.parameters
        if not params:
            continue
        try:
            error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(params))
        except (ValueError, TypeError, RuntimeError) as exc:
            error = str(exc)
        if error:
            raise APIError(400, f"tools[{i}].function.parameters: invalid JSON schema: {error}",
                           param=f"tools[{i}].function.parameters", code="invalid_value")


def plan_tools(req: ChatCompletionRequest, family: ToolCallParser | None, template: str | None) -> ToolPlan:
    """The :class:`ToolPlan` of a chat request, for the worker's parser ``family`` and the chat
    template's source ``template`` (pure).

    Raises:
        APIError: 400 naming the field: :func:`check_tools`; ``tool_choice`` without ``tools``
            (other than ``none``) or naming a function not in ``tools``; ``tools`` with
            ``tool_choice`` other than ``none`` while the worker has no parser; a forced tool whose
            parameters schema does not compile.
    """
    tools = req.tools or []
    check_tools(tools)
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if not tools and choice != "none":
        raise APIError(400, "tool_choice: only allowed together with tools (or \"none\")", param="tool_choice",
                       code="invalid_value")
    names = [t.function.name for t in tools]
    if not isinstance(choice, str) and choice.function.name not in names:
        raise APIError(400, f"tool_choice: function {choice.function.name!r} is not one of tools "
                       f"({', '.join(map(repr, names))})", param="tool_choice", code="invalid_value")
    max_calls = None if req.parallel_tool_calls else 1
    if choice == "none":
        return ToolPlan(family=family, max_calls=max_calls)
    if family is None:
        raise APIError(400, "tools: this worker parses no tool calls: its --tool-call-parser is none, or auto found "
                       "no known tool-call format in the model's chat template; start it with --tool-call-parser "
                       "hermes or llama3_json (docs/worker.md, 'Tool calling'), or send tool_choice \"none\"",
                       param="tools", code="unsupported")
    functions = [t.function.model_dump(exclude_none=True) for t in tools]
    constraint = None
    if choice != "auto":
        forced = list(range(len(tools))) if choice == "required" else [names.index(choice.function.name)]
        _check_schemas(tools, forced)
        grammar = family.grammar([functions[i] for i in forced], parallel=req.parallel_tool_calls)
        constraint = StructuredOutput("grammar", grammar, "tool_choice")
    template_tools = [t.model_dump(exclude_none=True) for t in tools] if "tools" in (template or "") else None
    return ToolPlan(family=family, parse=True, functions=functions, template_tools=template_tools,
                    constraint=constraint, max_calls=max_calls)


def template_messages(messages: list[dict[str, Any]], plan: ToolPlan, template: str | None) -> list[dict[str, Any]]:
    """The messages as the chat template sees them (a new list; the module docstring has the
    rules): earlier calls' arguments as dicts, tool results named, and for a template without
    ``tools`` / ``tool_calls`` the family's text for them.

    Raises:
        APIError: 400 naming ``messages[i].tool_calls[j].function.arguments`` when it is not a JSON
            object, or ``messages[i].tool_calls`` when the template does not render calls and the
            worker has no tool-call format to write them in.
    """
    source = template or ""
    renders_calls = "tool_calls" in source
    names: dict[str, str] = {}
    out = []
    for i, message in enumerate(messages):
        message = dict(message)
        calls = message.get("tool_calls")
        if calls:
            parsed = [(c["function"]["name"], _arguments(c["function"]["arguments"], i, j)) for j, c in enumerate(calls)]
            names.update((c["id"], c["function"]["name"]) for c in calls)
            if renders_calls:
                message["tool_calls"] = [{**c, "function": {"name": n, "arguments": a}}
                                         for c, (n, a) in zip(calls, parsed)]
            elif plan.family is None:
                raise APIError(400, f"messages[{i}].tool_calls: the model's chat template does not render tool calls "
                               "and this worker has no tool-call format to write them in (--tool-call-parser)",
                               param=f"messages[{i}].tool_calls", code="unsupported")
            else:
                del message["tool_calls"]
                text = plan.family.call_text(parsed)
                message["content"] = f"{message['content']}\n{text}" if message.get("content") else text
        if message.get("role") == "tool":
            if "name" not in message and message.get("tool_call_id") in names:
                message["name"] = names[message["tool_call_id"]]
            if not renders_calls and plan.family is not None:
                message["content"] = plan.family.result_text(message.get("content") or "")
        out.append(message)
    if plan.functions and plan.template_tools is None:
        _add_system_text(out, plan.family.system_prompt(plan.functions))
    return out


def _arguments(text: str, i: int, j: int) -> dict:
    """An earlier call's ``arguments`` JSON text as a dict (``""``: no arguments)."""
    param = f"messages[{i}].tool_calls[{j}].function.arguments"
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError as exc:
        raise APIError(400, f"{param}: not valid JSON ({exc})", param=param, code="invalid_value") from None
    if not isinstance(value, dict):
        raise APIError(400, f"{param}: must be a JSON object, got {type(value).__name__}", param=param,
                       code="invalid_value")
    return value


def _add_system_text(messages: list[dict[str, Any]], text: str) -> None:
    """Append ``text`` to the first message when it is a system message (after a blank line),
    else open the conversation with a system message of it."""
    if messages and messages[0].get("role") == "system":
        first = messages[0].get("content") or ""
        messages[0] = {**messages[0], "content": f"{first}\n\n{text}" if first else text}
    else:
        messages.insert(0, {"role": "system", "content": text})
