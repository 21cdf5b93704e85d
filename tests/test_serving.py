"""What both generation routes share (verispec/entrypoints/openai/serving.py), on a `ServingContext`
over the tiny word-level tokenizer ("t0" .. "t511") and a scripted engine client: request fields ->
SamplingParams with errors naming the client's field, the one-grammar rule, the prompt-length checks,
and collecting deltas (engine errors mapped to HTTP statuses, -inf mapped to JSON's -9999)."""

from __future__ import annotations

import asyncio
import math

import pytest

from verispec import SamplingParams
from verispec.engine.core_protocol import CompletionDelta, LogprobRow, RequestDelta
from verispec.entrypoints.openai.errors import RequestError
from verispec.entrypoints.openai.metrics import ServerMetrics
from verispec.entrypoints.openai.preprocess import PendingWork
from verispec.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from verispec.entrypoints.openai.serving import (
    NEG_INF_JSON, ServingContext, collect, error_json, grammar_field, json_float,
    prompt_logprobs_json, sampling_params, structured_outputs, usage,
)
from verispec.models.tokenizer_cache import load_tokenizer
from verispec.tokenization import text_encoder


class ScriptedClient:
    """An engine client that answers every request with the given deltas."""

    def __init__(self, deltas: list[RequestDelta], dead: bool = False):
        self.deltas, self.dead, self.dead_reason = deltas, dead, "it exited"

    async def generate(self, request_id, prompt_ids, params, group=None):
        for d in self.deltas:
            yield d


def make_ctx(tokenizer=None, client=None, **kw) -> ServingContext:
    fields = dict(client=client, tokenizer=tokenizer, model_name="tiny", model_aliases=frozenset({"tiny"}),
                  metrics=ServerMetrics("tiny"), max_model_len=64, vocab_size=512, max_logprobs=20,
                  pending=PendingWork(8, 64, 32), encoder=text_encoder(tokenizer) if tokenizer is not None else None)
    return ServingContext(**{**fields, **kw})


@pytest.fixture(scope="module")
def tok(tiny_with_tokenizer):
    return load_tokenizer(tiny_with_tokenizer)


def completion(**kw) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "t5 t6", **kw})


def params_of(ctx, req, **kw):
    return sampling_params(ctx, req, **{"max_tokens": req.max_tokens, "logprobs": None, "prompt_logprobs": None, **kw})


def test_fields_the_client_sets_reach_sampling_params():
    req = completion(temperature=0.3, top_k=5, stop=["t9"], seed=7, logit_bias={"4": 1.5})
    params = params_of(make_ctx(), req)
    assert (params.temperature, params.top_k, params.stop, params.seed) == (0.3, 5, ["t9"], 7)
    assert params.max_tokens == 16 and params.logit_bias == {4: 1.5}


def test_a_bad_value_is_a_400_naming_the_clients_field():
    with pytest.raises(RequestError, match="top_p") as err:
        params_of(make_ctx(), completion(top_p=1.5))
    assert err.value.param == "top_p" and err.value.status == 400


def test_a_renamed_field_is_reported_by_the_routes_own_name():
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 30,
                                                "logprobs": True})
    with pytest.raises(RequestError) as err:
        sampling_params(make_ctx(), req, max_tokens=None, logprobs=30, prompt_logprobs=None,
                        renames={"logprobs": "top_logprobs"})
    assert err.value.param == "top_logprobs" and err.value.message.startswith("top_logprobs")


def test_n_is_capped_by_the_server():
    with pytest.raises(RequestError, match="n must be at most 2; got 3") as err:
        params_of(make_ctx(max_n=2), completion(n=3))
    assert err.value.param == "n"


def test_a_request_takes_one_grammar():
    assert structured_outputs(completion()) is None
    assert structured_outputs(completion(guided_regex="t[0-9]")) == ("guided_regex", {"regex": "t[0-9]"})
    assert grammar_field(completion(response_format={"type": "json_object"})) == "response_format"
    with pytest.raises(RequestError, match="guided_choice cannot be combined with structured_outputs") as err:
        structured_outputs(completion(structured_outputs={"regex": "a"}, guided_choice=["a"]))
    assert err.value.param == "guided_choice"
    with pytest.raises(RequestError, match="json_schema.schema is required"):
        structured_outputs(completion(response_format={"type": "json_schema"}))


def test_prompt_length_checks_name_what_to_change():
    ctx = make_ctx()
    with pytest.raises(RequestError, match="must not be empty"):
        ctx.check_prompt_len(0, None, "prompt")
    with pytest.raises(RequestError, match="maximum context length is 64 tokens, but the prompt has 64"):
        ctx.check_prompt_len(64, None, "prompt")
    with pytest.raises(RequestError, match="60 prompt tokens plus max_tokens=5 need 65") as err:
        ctx.check_prompt_len(60, 5, "prompt")
    assert err.value.param == "max_tokens"
    ctx.check_prompt_len(60, 4, "prompt")  # exactly the context: accepted
    with pytest.raises(RequestError, match="accepts at most 10"):
        make_ctx(max_prompt_tokens=10).check_prompt_len(11, None, "prompt")


def test_token_ids_and_model_names_are_checked():
    ctx = make_ctx()
    with pytest.raises(RequestError, match="token id 512, outside the vocabulary"):
        ctx.check_token_ids([5, 512], "prompt")
    with pytest.raises(RequestError, match="model 'other' is not served here") as err:
        ctx.check_model("other")
    assert err.value.param == "model"
    ctx.check_model(None)
    ctx.check_model("tiny")


def test_a_text_too_long_to_fit_is_refused_by_its_length(tok):
    ctx = make_ctx(tok)
    limit_chars = ctx.encoder.max_chars(ctx.prompt_token_limit)
    ctx.check_chars(limit_chars, "prompt")
    with pytest.raises(RequestError, match=f"{limit_chars + 1} characters, more than 63 tokens"):
        ctx.check_chars(limit_chars + 1, "prompt")


def test_collect_adds_up_the_deltas_per_choice():
    row = LogprobRow([7], [-0.5], [1], ["t7"])
    deltas = [RequestDelta("r", [CompletionDelta(0, [7], "t7", [row]), CompletionDelta(1, [8], "t8")], False),
              RequestDelta("r", [CompletionDelta(0, [9], " t9", None, "stop", "t10")], True)]
    ctx = make_ctx(client=ScriptedClient(deltas))
    result = asyncio.run(collect(ctx, "r", [5, 6], SamplingParams(n=2)))
    first, second = result.choices
    assert (first.token_ids, first.text, first.finish_reason, first.stop_reason) == ([7, 9], "t7 t9", "stop", "t10")
    assert first.rows == [row] and second.token_ids == [8] and second.finish_reason is None
    assert usage([result]).model_dump() == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


@pytest.mark.parametrize("kind, status, param", [("invalid", 400, "guided_regex"), ("internal", 500, None)])
def test_an_engine_error_becomes_an_http_error(kind, status, param):
    ctx = make_ctx(client=ScriptedClient([RequestDelta("r", [], True, error="bad", error_kind=kind)]))
    with pytest.raises(RequestError, match="bad") as err:
        asyncio.run(collect(ctx, "r", [5], SamplingParams(), grammar_param="guided_regex"))
    assert (err.value.status, err.value.param) == (status, param)


def test_a_dead_engine_is_a_503():
    with pytest.raises(RequestError, match="engine is not running: it exited") as err:
        asyncio.run(collect(make_ctx(client=ScriptedClient([], dead=True)), "r", [5], SamplingParams()))
    assert err.value.status == 503


def test_json_has_no_minus_infinity():
    assert json_float(-math.inf) == NEG_INF_JSON and json_float(-1.5) == -1.5
    rows = prompt_logprobs_json([None, LogprobRow([3, 4], [-0.1, -math.inf], [1, 2], ["a", "b"])])
    assert rows[0] is None and rows[1]["4"].logprob == NEG_INF_JSON and rows[1]["3"].decoded_token == "a"


def test_any_exception_becomes_an_openai_error_body():
    assert '"code":500' in error_json(KeyError("x")) and "internal error: KeyError" in error_json(KeyError("x"))
    assert '"param":"n"' in error_json(RequestError("m", "n"))
