"""Structured output: a request's output constrained to a grammar, as a token mask per step.

A request carries a :class:`StructuredOutput` (what its output must match). The engine compiles it
with the grammar library llguidance (docs/worker.md, "Structured output", says why this library)
into one matcher per sequence; before each step that samples such a sequence, the matcher fills
the row's bit of an allowed-token bitmask, and the sampler masks the other tokens to -inf before
anything else (penalties, temperature, truncation). The mask is applied to the logits the forward
pass returns, outside the captured graph, so FULL graphs still serve constrained requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StructuredKind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match.

    Attributes:
        kind: ``json_schema`` (``value`` is the schema as JSON text), ``json_object`` (any JSON
            object; ``value`` ignored), ``regex`` (a regular expression the whole output matches),
            ``grammar`` (llguidance's Lark dialect, which may embed JSON schemas with
            ``%json { ... }``), ``choice`` (``value`` is a JSON array of strings; the output is one
            of them).
        value: the kind's source text.
        param: the request field it came from (``response_format``, ``tool_choice``, ...), named
            in the error when it does not compile.
    """

    kind: StructuredKind
    value: str = ""
    param: str = "response_format"
