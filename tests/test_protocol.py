"""The API's pydantic models (verispec/entrypoints/openai/protocol.py), validated as the server
validates a body: unknown fields ignored, known fields strict (no bool for an int, no string for a
number), lone surrogates refused anywhere in a request, aliases and defaults as OpenAI's, and the
response models' fixed `object` names."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from verispec.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, CompletionResponse, ErrorResponse, ResponseFormat, UsageInfo,
)


def error_field(exc: ValidationError) -> str:
    return str(exc.errors()[0]["loc"][0])


def test_unknown_fields_are_ignored():
    req = CompletionRequest.model_validate({"prompt": "hi", "some_future_field": {"x": 1}})
    assert req.prompt == "hi" and not hasattr(req, "some_future_field")


@pytest.mark.parametrize("body, field", [
    ({"prompt": "hi", "max_tokens": True}, "max_tokens"),  # true is no integer
    ({"prompt": "hi", "temperature": "0.5"}, "temperature"),  # "0.5" is no number
    ({"prompt": "hi", "n": 1.0}, "n"),
    ({"prompt": 5}, "prompt"),
])
def test_known_fields_are_strict_and_the_error_names_the_field(body, field):
    with pytest.raises(ValidationError) as err:
        CompletionRequest.model_validate(body)
    assert error_field(err.value) == field


@pytest.mark.parametrize("body, field", [
    ({"prompt": "a\ud800b"}, "prompt"),
    ({"prompt": "hi", "stop": ["ok", "\udfff"]}, "stop"),  # inside a list
    ({"prompt": "hi", "structured_outputs": {"json": {"\ud800": 1}}}, "structured_outputs"),  # a dict key
])
def test_a_lone_surrogate_is_refused_wherever_it_is(body, field):
    with pytest.raises(ValidationError, match="lone surrogate") as err:
        CompletionRequest.model_validate(body)
    assert error_field(err.value) == field


def test_every_prompt_shape_is_accepted():
    for prompt in ("a", ["a", "b"], [1, 2], [[1], [2, 3]]):
        assert CompletionRequest.model_validate({"prompt": prompt}).prompt == prompt


def test_openai_defaults():
    completion = CompletionRequest.model_validate({"prompt": "x"})
    assert (completion.max_tokens, completion.n, completion.echo, completion.stream) == (16, 1, False, False)
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert chat.max_tokens is None and chat.logprobs is False and chat.add_generation_prompt is True


def test_chat_roles_and_tool_choice_are_checked():
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate({"messages": [{"role": "robot", "content": "x"}]})
    assert error_field(err.value) == "messages"
    named = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                  "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert named.tool_choice.function.name == "f"
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": [], "tool_choice": "sometimes"})


def test_json_schema_is_read_from_its_openai_name():
    fmt = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})
    assert fmt.json_schema.schema_ == {"type": "object"}


def test_responses_carry_openais_object_names():
    resp = CompletionResponse(id="c", model="m", choices=[], usage=UsageInfo(prompt_tokens=1, completion_tokens=2,
                                                                            total_tokens=3))
    dumped = resp.model_dump()
    assert dumped["object"] == "text_completion" and isinstance(dumped["created"], int)
    err = ErrorResponse.model_validate({"error": {"message": "m", "type": "BadRequestError"}})
    assert err.error.param is None and err.error.code is None
