"""Forced tool calls (verispec/entrypoints/openai/tools.py): the JSON schema a `tool_choice` imposes,
the errors that name `tool_choice`, and the parsing of the forced answer into OpenAI tool calls,
each against schemas and answers written by hand."""

from __future__ import annotations

import json

import pytest

from verispec.entrypoints.openai.errors import RequestError
from verispec.entrypoints.openai.protocol import ChatCompletionRequest
from verispec.entrypoints.openai.tools import ANY_OBJECT, forces_tools, tool_calls, tool_schema

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


@pytest.mark.parametrize("choice", [None, "none", "auto"])
def test_none_auto_and_absent_force_nothing(choice):
    req = chat(tools=TOOLS, tool_choice=choice)
    assert not forces_tools(req) and tool_schema(req) is None


def test_a_named_function_forces_its_parameters_or_any_object():
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}})
    assert forces_tools(named) and tool_schema(named) == WEATHER
    no_params = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})
    assert tool_schema(no_params) == ANY_OBJECT


def test_required_is_a_non_empty_array_of_one_of_the_tools():
    schema = tool_schema(chat(tools=TOOLS, tool_choice="required"))
    assert schema["type"] == "array" and schema["minItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["weather"], ["now"]]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER


def test_errors_name_tool_choice():
    with pytest.raises(RequestError, match="tool_choice needs tools") as no_tools:
        tool_schema(chat(tool_choice="required"))
    assert no_tools.value.param == "tool_choice"
    with pytest.raises(RequestError, match="names function 'rain', which is not in tools") as unknown:
        tool_schema(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "rain"}}))
    assert unknown.value.param == "tool_choice"


def test_the_forced_answer_becomes_tool_calls():
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}})
    [call] = tool_calls(named, '{"city": "Paris"}')
    assert call.function.name == "weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    required = chat(tools=TOOLS, tool_choice="required")
    calls = tool_calls(required, '[{"name": "now", "parameters": {}}, {"name": "weather", "parameters": {"city": "Oslo"}}]')
    assert [c.function.name for c in calls] == ["now", "weather"]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_an_answer_cut_short_is_no_tool_call():
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}})
    assert tool_calls(named, '{"city": "Par') is None
