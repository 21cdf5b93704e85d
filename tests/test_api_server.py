"""The FastAPI app (verispec/entrypoints/openai/api_server.py) in-process, with no engine process:
`build_app` is served by Starlette's TestClient without its lifespan, and its serving context is
set by hand over the tiny word-level tokenizer and a scripted engine client (tests/test_serving.py).
Checked: the served model name, the API key, errors in OpenAI's shape naming the field, the body
limit, and a completion answered from the scripted deltas. The real server end to end is
test_server.py's."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from test_serving import ScriptedClient, make_ctx
from verispec.config import EngineConfig
from verispec.engine.core_protocol import CompletionDelta, RequestDelta
from verispec.entrypoints.openai.api_server import ServerConfig, build_app
from verispec.models.tokenizer_cache import load_tokenizer

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}


def server_config(model: str | None = None, **kw) -> ServerConfig:
    return ServerConfig(engine=EngineConfig.create(model=model), **kw)


@pytest.fixture(scope="module")
def http(tiny_with_tokenizer):
    app = build_app(server_config(tiny_with_tokenizer, api_key=KEY, max_request_bytes=2000, served_model_name="tiny"))
    deltas = [RequestDelta("x", [CompletionDelta(0, [7, 8], "t7 t8", None, "length")], True)]
    app.state.ctx = make_ctx(load_tokenizer(tiny_with_tokenizer), client=ScriptedClient(deltas), model_name="tiny")
    return TestClient(app)  # not entered: the lifespan (the engine processes) never runs


def test_the_served_name_is_the_given_one_or_the_files():
    assert server_config(served_model_name="mine").model_name() == "mine"
    assert server_config("/m/SmolLM2-135M-Instruct.Q4_1.gguf").model_name() == "SmolLM2-135M-Instruct"
    assert server_config("/models/tiny-llama").model_name() == "tiny-llama"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}])
def test_v1_routes_need_the_key(http, headers):
    r = http.post("/v1/completions", json={"prompt": "t5"}, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"


def test_a_completion_is_answered_from_the_engines_deltas(http):
    r = http.post("/v1/completions", json={"prompt": "t5 t6", "max_tokens": 2, "echo": True},
                  headers={"authorization": f"bearer {KEY}"})  # the scheme is case-insensitive
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "tiny" and body["choices"][0]["text"] == "t5 t6t7 t8"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


@pytest.mark.parametrize("body, param", [({"prompt": "t5", "max_tokens": "2"}, "max_tokens"),
                                         ({"prompt": "t5", "top_p": 3.0}, "top_p"),
                                         ({}, "prompt")])
def test_invalid_bodies_are_a_400_naming_the_field(http, body, param):
    r = http.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_malformed_json_is_a_400_saying_so(http):
    r = http.post("/v1/completions", content=b'{"prompt": ', headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_a_body_past_the_limit_is_a_413(http):
    r = http.post("/v1/completions", json={"prompt": "t5 " * 1000}, headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_models_lists_the_served_name(http):
    r = http.get("/v1/models", headers=AUTH)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["tiny"]
    assert http.get("/v1/nothing", headers=AUTH).json()["error"]["type"] == "NotFoundError"
