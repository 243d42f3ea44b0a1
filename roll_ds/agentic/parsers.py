"""Tool-call parsers: the policy's text -> the tool calls in it, and what was malformed.

A parser is a function ``(text) -> ParsedTurn``; registered by name in ``TOOL_PARSERS``
(``roll_ds/agentic/registry.py``). A malformed call is never an exception: it is reported in
``ParsedTurn.errors`` and the environment turns it into an error observation the model sees.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    """``content``: the text outside tool-call blocks (the answer, when there is no call)."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        return bool(self.calls or self.errors)


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    """Qwen2.5 / Hermes form: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
    any number of blocks (whitespace around the JSON is allowed; an unclosed last block is an
    error). ``arguments`` may also be a JSON string holding the object (some models emit that).
    """
    calls: list[ToolCall] = []
    errors: list[str] = []
    for match in _HERMES_BLOCK.finditer(text):
        body, closing = match.group(1).strip(), match.group(2)
        if not closing:
            errors.append("unclosed <tool_call> block (missing </tool_call>)")
            continue
        call, error = _call_from_json(body)
        if error:
            errors.append(error)
        else:
            calls.append(call)
    content = _HERMES_BLOCK.sub("", text).strip()
    return ParsedTurn(content=content, calls=calls, errors=errors)


def _call_from_json(body: str) -> tuple[ToolCall | None, str | None]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"tool call is not valid JSON ({exc.msg} at char {exc.pos})"
    if not isinstance(obj, dict):
        return None, "tool call must be a JSON object with 'name' and 'arguments'"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, "tool call has no 'name' string"
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None, f"tool call '{name}': 'arguments' is a string that is not JSON"
    if not isinstance(args, dict):
        return None, f"tool call '{name}': 'arguments' must be a JSON object"
    return ToolCall(name=name, arguments=args), None
