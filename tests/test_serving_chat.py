"""POST /v1/chat/completions' own logic (verispec/entrypoints/openai/serving_chat.py), on the tiny
word-level tokenizer with a one-line chat template: message content parts, checks that name the
field, the prompt the template gives, logprobs placed at the sampled token's rank (or where the
client listed it), and forced tool calls turned into `tool_calls`."""

from __future__ import annotations

import pytest

from test_serving import make_ctx
from verispec.engine.core_protocol import LogprobRow
from verispec.entrypoints.openai.errors import RequestError
from verispec.entrypoints.openai.protocol import ChatCompletionRequest
from verispec.entrypoints.openai.serving_chat import _answer, _messages, chat_logprobs, prepare_chat
from verispec.models.tokenizer_cache import load_tokenizer

# Each message's content, then "t1" as the assistant's turn: the prompt's ids are easy to predict.
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t1{% endif %}"


@pytest.fixture(scope="module")
def ctx(tiny_with_tokenizer):
    tok = load_tokenizer(tiny_with_tokenizer)
    tok.chat_template = TEMPLATE
    return make_ctx(tok)


def chat(*contents, **kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": c} for c in contents], **kw})


def test_text_parts_are_joined_and_other_parts_refused():
    joined = chat([{"type": "text", "text": "t5 "}, {"type": "text", "text": "t6"}])
    assert _messages(joined) == [{"role": "user", "content": "t5 t6"}]
    with pytest.raises(RequestError, match=r"messages\[0\].content: only text parts are supported; got 'image_url'"):
        _messages(chat([{"type": "image_url"}]))


def test_the_prompt_is_the_templates_and_max_completion_tokens_wins(ctx):
    ids, params = prepare_chat(ctx, chat("t5 t6", "t7", max_tokens=3, max_completion_tokens=4))
    assert ids == [5, 6, 7, 1] and params.max_tokens == 4


@pytest.mark.parametrize("body, param", [
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs=true
    ({"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"model": "gpt-4"}, "model"),
    ({"max_tokens": 62}, "max_tokens"),  # 4 prompt tokens + 62 > 64
    ({"max_completion_tokens": 62}, "max_completion_tokens"),  # the field the client sent
])
def test_bad_requests_name_their_field(ctx, body, param):
    with pytest.raises(RequestError) as err:
        prepare_chat(ctx, chat("t5 t6", "t7", **body))
    assert err.value.param == param and (param in str(err.value) or param == "model")


def test_without_a_tokenizer_chat_is_refused():
    with pytest.raises(RequestError, match="no tokenizer and chat template"):
        prepare_chat(make_ctx(), chat("t5"))


def test_top_logprobs_put_the_sampled_token_at_its_rank(ctx):
    # The engine lists the sampled token first (rank 2 here), then the top alternatives.
    row = LogprobRow([7, 3, 7, 9], [-1.0, -0.5, -1.0, -2.0], [2, 1, 2, 3], ["t7", "t3", "t7", "t9"])
    [entry] = chat_logprobs(ctx, [row], k=2).content
    assert entry.token == "t7" and entry.bytes == list(b"t7")
    assert [(t.token, t.logprob) for t in entry.top_logprobs] == [("t3", -0.5), ("t7", -1.0)]


def test_custom_ids_are_listed_in_the_clients_order(ctx):
    row = LogprobRow([7, 9, 3], [-1.0, -2.0, -0.5], [2, 3, 1], [None, None, None])
    [entry] = chat_logprobs(ctx, [row], k=0, custom=[9, 7, 3]).content
    assert [t.token for t in entry.top_logprobs] == ["t9", "t7", "t3"]  # decoded by the context's tokenizer


def test_a_completed_forced_answer_becomes_tool_calls():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    req = chat("t5", tools=tools, tool_choice={"type": "function", "function": {"name": "f"}})
    message, reason = _answer(req, '{"a": 1}', "stop")
    assert reason == "tool_calls" and message.content is None and message.tool_calls[0].function.name == "f"
    cut, reason = _answer(req, '{"a": ', "length")  # cut short by max_tokens: the text, as it is
    assert (cut.content, cut.tool_calls, reason) == ('{"a": ', None, "length")


def test_the_answer_and_its_chunks_say_which_weights_made_it(tiny_with_tokenizer):
    import asyncio
    import json

    from test_serving import ScriptedClient
    from verispec.engine.core_protocol import CompletionDelta, RequestDelta
    from verispec.entrypoints.openai.serving_chat import create_chat, stream_chat

    tok = load_tokenizer(tiny_with_tokenizer)
    tok.chat_template = TEMPLATE
    deltas = [RequestDelta("x", [CompletionDelta(0, [7], "t7")], False, weight_version="v3"),
              RequestDelta("x", [CompletionDelta(0, [8], " t8", None, "length")], True, weight_version="v3")]
    ctx = make_ctx(tok, client=ScriptedClient(deltas))
    req = chat("t5", max_tokens=2)
    answer = asyncio.run(create_chat(ctx, req, prepare_chat(ctx, req)))
    assert answer.weight_version == "v3"

    async def chunks():
        return [c async for c in stream_chat(ctx, req, prepare_chat(ctx, req))]
    bodies = [json.loads(c[6:]) for c in asyncio.run(chunks()) if c.startswith("data: {")]
    from_engine = [b for b in bodies if b["choices"] and b["choices"][0]["delta"].get("content")]
    assert from_engine and all(b["weight_version"] == "v3" for b in from_engine)
