"""Structured output over HTTP, through the official `openai` client: `response_format` (JSON schema
and JSON object), `structured_outputs` / `guided_*` choices and regexes, `tool_choice` named and
required (plain and streamed), and a 400 naming the field for every bad grammar. A real
`verispec serve` on SmolLM2 (exact tier), as in test_server.py."""

from __future__ import annotations

import json
import re

import pytest

from server_utils import ServerProcess
from test_server import MODEL, QUESTION

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--dtype", "float32", "--num-kv-blocks", "256")
    yield srv
    srv.stop()


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_response_format_and_structured_outputs_over_http(server):
    import jsonschema

    client = server.openai()
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=64,
        temperature=0.8, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)
    obj = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=48, temperature=0,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    colors = ["red", "green", "blue"]
    picked = client.completions.create(model=MODEL, prompt="My favourite color is", max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"choice": colors}})
    assert picked.choices[0].text in colors and picked.choices[0].finish_reason == "stop"
    phone = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=12, temperature=0,
                                      extra_body={"guided_regex": r" \d{3}-\d{4}"})
    assert re.fullmatch(r" \d{3}-\d{4}", phone.choices[0].text)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                                       "required": ["zone"], "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_named_and_required_give_valid_tool_calls(server, stream):
    """Through the official client: every call names a given tool and its arguments validate."""
    import jsonschema

    client = server.openai()
    ask = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        kw = dict(model=MODEL, messages=ask, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=96, temperature=0)
        if stream:
            calls, reasons = [], []
            for chunk in client.chat.completions.create(**kw, stream=True):
                for c in chunk.choices:
                    calls += c.delta.tool_calls or []
                    reasons += [c.finish_reason] if c.finish_reason else []
            assert reasons == ["tool_calls"]
        else:
            resp = client.chat.completions.create(**kw)
            assert resp.choices[0].finish_reason == "tool_calls" and resp.choices[0].message.content is None
            calls = resp.choices[0].message.tool_calls
        assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
        if choice != "required":
            assert [c.function.name for c in calls] == ["get_weather"]
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    bad = server.post("/v1/chat/completions", {"model": MODEL, "messages": ask, "tools": [WEATHER],
                                               "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
])
def test_a_bad_grammar_is_a_400_naming_its_field(server, body, param):
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


