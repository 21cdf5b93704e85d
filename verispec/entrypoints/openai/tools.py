"""Forced tool calls on /v1/chat/completions: `tool_choice` "required" or a named function.

The answer is generated under a JSON-schema grammar (sample/grammar.py), so it always parses and
its arguments fit the function's `parameters`:
- a named function: the output is that function's arguments object;
- "required": the output is a non-empty array of {"name", "parameters"} items, each item one of
  the tools (the same shape vLLM forces).
"none", "auto" or no tool_choice give a text answer: no parser for a model's own tool-call
format runs, so "auto" never produces tool_calls.
"""

from __future__ import annotations

import json
import uuid

from verispec.entrypoints.openai.protocol import ChatCompletionRequest, FunctionCall, NamedToolChoice, ToolCall
from verispec.entrypoints.openai.serving import RequestError

ANY_OBJECT = {"type": "object"}


def forces_tools(req: ChatCompletionRequest) -> bool:
    return req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice)


def tool_schema(req: ChatCompletionRequest) -> dict | None:
    """The JSON schema the answer must follow, or None when no tool call is forced."""
    if not forces_tools(req):
        return None
    if not req.tools:
        raise RequestError("tool_choice needs tools: the functions the model may call", "tool_choice")
    if isinstance(req.tool_choice, NamedToolChoice):
        name = req.tool_choice.function.name
        tool = next((t for t in req.tools if t.function.name == name), None)
        if tool is None:
            known = [t.function.name for t in req.tools]
            raise RequestError(f"tool_choice names function {name!r}, which is not in tools ({known})", "tool_choice")
        return tool.function.parameters or ANY_OBJECT
    calls = [{"type": "object", "properties": {"name": {"enum": [t.function.name]},
                                               "parameters": t.function.parameters or ANY_OBJECT},
              "required": ["name", "parameters"], "additionalProperties": False} for t in req.tools]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def tool_calls(req: ChatCompletionRequest, text: str) -> list[ToolCall] | None:
    """The forced answer as tool calls; None when it was cut short (max_tokens) and is no JSON."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(req.tool_choice, NamedToolChoice):
        return [_call(req.tool_choice.function.name, value)]
    return [_call(item["name"], item["parameters"]) for item in value]


def _call(name: str, arguments) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=json.dumps(arguments)))
