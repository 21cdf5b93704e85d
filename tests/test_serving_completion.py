"""POST /v1/completions' own logic (verispec/entrypoints/openai/serving_completion.py), on the tiny
word-level tokenizer and a scripted engine client: the four prompt shapes, checks that name the
field, max_tokens=0 scoring the prompt only, and the lm-eval contract of echo + logprobs (the
prompt's first token has a null logprob, and every token's logprob equals its `top_logprobs` entry)."""

from __future__ import annotations

import asyncio

import pytest

from test_serving import ScriptedClient, make_ctx
from verispec.engine.core_protocol import CompletionDelta, LogprobRow, RequestDelta
from verispec.entrypoints.openai.errors import RequestError
from verispec.entrypoints.openai.protocol import CompletionRequest
from verispec.entrypoints.openai.serving_completion import create_completion, prepare_completion, prompt_list
from verispec.models.tokenizer_cache import load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_with_tokenizer):
    return load_tokenizer(tiny_with_tokenizer)


def completion(**kw) -> CompletionRequest:
    return CompletionRequest.model_validate(kw)


@pytest.mark.parametrize("prompt, prompts", [
    ("t5", ["t5"]), (["t5", "t6"], ["t5", "t6"]), ([5, 6], [[5, 6]]), ([[5], [6, 7]], [[5], [6, 7]]),
])
def test_the_four_prompt_shapes(prompt, prompts):
    assert prompt_list(prompt) == prompts


def test_text_and_token_prompts_become_ids(tok):
    prompts, params, prompt_only = prepare_completion(make_ctx(tok), completion(prompt=["t5 t6", "t9"], max_tokens=2))
    assert prompts == [("t5 t6", [5, 6]), ("t9", [9])] and params.max_tokens == 2 and not prompt_only
    assert prepare_completion(make_ctx(tok), completion(prompt=[[7, 8], [3]]))[0] == [(None, [7, 8]), (None, [3])]


@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": [5, 600]}, "prompt"),  # outside the vocabulary
    ({"prompt": "t5", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "t5", "max_tokens": 0, "min_tokens": 1}, "min_tokens"),
    ({"prompt": "t5", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt": "t5", "max_tokens": 64}, "max_tokens"),
])
def test_bad_requests_name_their_field(tok, body, param):
    with pytest.raises(RequestError) as err:
        prepare_completion(make_ctx(tok), completion(**body))
    assert err.value.param == param


def test_text_without_a_tokenizer_is_refused_but_ids_are_served():
    with pytest.raises(RequestError, match="no tokenizer: send prompt as token ids"):
        prepare_completion(make_ctx(), completion(prompt="t5"))
    assert prepare_completion(make_ctx(), completion(prompt=[5]))[0] == [(None, [5])]


def test_max_tokens_zero_runs_one_token_and_echo_asks_for_prompt_logprobs(tok):
    _, params, prompt_only = prepare_completion(make_ctx(tok), completion(prompt=[5, 6], max_tokens=0, echo=True,
                                                                          logprobs=1))
    assert prompt_only and params.max_tokens == 1 and params.prompt_logprobs == 1


def test_echo_with_logprobs_follows_lm_evals_contract(tok):
    prompt_rows = [None, LogprobRow([6, 9], [-1.5, -0.2], [2, 1], [None, None])]
    deltas = [RequestDelta("x", [CompletionDelta(0, [7], " t7", [LogprobRow([7, 7], [-0.3, -0.3], [1, 1], ["t7", "t7"])],
                                                 "length")], True, prompt_rows)]
    ctx = make_ctx(tok, client=ScriptedClient(deltas))
    req = completion(prompt=[5, 6], max_tokens=1, echo=True, logprobs=1)
    resp = asyncio.run(create_completion(ctx, req, prepare_completion(ctx, req)))
    [choice] = resp.choices
    lp = choice.logprobs
    assert choice.text == "t5 t6 t7" and lp.tokens == ["t5", "t6", "t7"]
    assert lp.token_logprobs == [None, -1.5, -0.3] and lp.text_offset == [0, 2, 4]
    assert lp.top_logprobs[0] is None
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == value  # lm-eval compares these with ==
    assert resp.usage.completion_tokens == 1


def test_prompt_only_answers_no_text_and_no_completion_tokens(tok):
    deltas = [RequestDelta("x", [CompletionDelta(0, [7], "t7", None, "length")], True)]
    ctx = make_ctx(tok, client=ScriptedClient(deltas))
    req = completion(prompt=[5, 6], max_tokens=0)
    resp = asyncio.run(create_completion(ctx, req, prepare_completion(ctx, req)))
    assert resp.choices[0].text == "" and resp.choices[0].finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (2, 0)
