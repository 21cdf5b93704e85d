"""The control routes (verispec/entrypoints/openai/admin.py) on a live server with the tiny model,
driven by the trainer's client (control_client.py): the API key, each pause mode's effect on a
running stream, requests that arrive while paused, a weight update from disk (refused while
requests are kept, a 400 naming model_path for a bad path), and the new weights' output, which
equals a fresh engine's on the same weights."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import pytest
import requests

from conftest import make_tiny_checkpoint
from server_utils import ServerProcess
from verispec import LLM, SamplingParams
from verispec.engine.core_protocol import ControlReply
from verispec.entrypoints.openai.admin import _answer
from verispec.entrypoints.openai.errors import RequestError
from verispec.entrypoints.openai.control_client import ControlError, ServerControl

KEY = "k"


@pytest.fixture(scope="module")
def weights_b(tiny_with_tokenizer, tmp_path_factory):
    """The tiny model's checkpoint with other weights (same config and tokenizer)."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("b") / "m", "llama", seed=2, max_position_embeddings=2048)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_with_tokenizer, name), path)
    return path


@pytest.fixture(scope="module")
def server(tiny_with_tokenizer):
    srv = ServerProcess("--model", tiny_with_tokenizer, "--dtype", "float32", "--enforce-eager", api_key=KEY)
    yield srv
    srv.stop()


def complete(server, prompt="t5 t6 t7", max_tokens=6, **kw) -> dict:
    r = server.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                        "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def long_stream(server) -> tuple[threading.Thread, list]:
    def run():
        r = server.post("/v1/completions", {"prompt": "t5", "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                                            "stream": True}, stream=True)
        reasons = [line for line in r.iter_lines() if b'"finish_reason":"' in line]
        return reasons[-1].decode() if reasons else ""
    t, out = in_thread(run)
    deadline = time.monotonic() + 30
    while server.metrics()["verispec:num_requests_running"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    return t, out


def test_a_refusal_is_a_409_for_the_engines_state_and_a_400_naming_the_field_for_the_input():
    with pytest.raises(RequestError) as err:
        _answer(ControlReply(1, False, "busy", "conflict"), "model_path")
    assert err.value.status == 409 and err.value.param is None
    with pytest.raises(RequestError) as err:
        _answer(ControlReply(1, False, "no such file", "invalid"), "model_path")
    assert err.value.status == 400 and err.value.param == "model_path"
    ok = _answer(ControlReply(1, True, "done", result={"weight_version": 2, "num_tensors": 5, "seconds": 0.1}), None)
    assert ok.success and ok.weight_version == 2 and ok.mode is None


def test_the_routes_need_the_key(server):
    for path in ("/pause_generation", "/continue_generation", "/update_weights_from_disk"):
        assert requests.post(server.url + path, json={}, timeout=30).status_code == 401
    with pytest.raises(ControlError) as err:
        ServerControl(server.url, api_key="wrong").pause()
    assert err.value.status == 401


def test_pause_update_continue(server, weights_b, tiny_with_tokenizer):
    control = ServerControl(server.url, api_key=KEY)
    before = complete(server)
    stream, finish = long_stream(server)
    paused = control.pause("abort")
    stream.join(30)
    assert paused["num_aborted"] == 1 and '"finish_reason":"abort"' in finish[0]
    waiting, answer = in_thread(lambda: complete(server))  # arrives while paused: waits, not refused
    time.sleep(0.5)
    assert waiting.is_alive()
    with pytest.raises(ControlError) as err:
        control.update_weights_from_disk("/nonexistent/weights")
    assert err.value.status == 400
    done = control.update_weights_from_disk(weights_b, weight_version="b")
    assert done["weight_version"] == "b" and done["num_tensors"] > 0
    assert control.resume()["num_joined"] == 1
    waiting.join(30)
    fresh = LLM(weights_b, dtype="float32", enforce_eager=True).generate(
        ["t5 t6 t7"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert answer[0]["text"] == fresh.outputs[0].text != before["text"]
    assert 'weight_version="b"' in server.get("/metrics").text
    # Every answer says which weights made it (an extension field), streamed or not.
    r = server.post("/v1/completions", {"prompt": "t5", "max_tokens": 2})
    assert r.json()["weight_version"] == "b"
    r = server.post("/v1/completions", {"prompt": "t5", "max_tokens": 2, "stream": True}, stream=True)
    chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: {")]
    assert chunks and all(c["weight_version"] == "b" for c in chunks)
    control.update_weights_from_disk(tiny_with_tokenizer, weight_version="a")  # as the other tests expect


def test_kept_requests_block_an_update_and_then_finish(server, tiny_with_tokenizer):
    control = ServerControl(server.url, api_key=KEY)
    stream, finish = long_stream(server)
    assert control.pause("keep")["num_kept"] == 1
    with pytest.raises(ControlError) as err:
        control.update_weights_from_disk(tiny_with_tokenizer)
    assert err.value.status == 409 and "keep" in err.value.message
    control.resume()
    stream.join(120)
    assert '"finish_reason":"length"' in finish[0]


def test_wait_returns_once_the_running_request_finished(server):
    control = ServerControl(server.url, api_key=KEY)
    stream, finish = long_stream(server)
    control.pause("wait")
    assert not stream.is_alive() or (stream.join(5) or not stream.is_alive())
    assert '"finish_reason":"length"' in finish[0]
    assert server.metrics()["verispec:num_requests_running"] == 0
    control.resume()


def test_a_trainer_pushes_weights_through_its_process_group(server, weights_b, tiny_with_tokenizer):
    """The trainer (here a thread, rank 0 of a gloo group) joins with the server's engine (rank 1)
    and broadcasts checkpoint B while /update_weights_from_distributed announces it."""
    from safetensors.torch import load_file

    from server_utils import free_port
    from verispec.distributed.weight_group import broadcast_weights, trainer_weight_group

    control = ServerControl(server.url, api_key=KEY)
    tensors = sorted(load_file(os.path.join(weights_b, "model.safetensors")).items())
    port = free_port()
    joined, group = in_thread(lambda: trainer_weight_group("127.0.0.1", port, 2))
    assert "joined" in control.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2)["message"]
    joined.join(30)
    pushing, _ = in_thread(lambda: broadcast_weights(group[0], tensors))
    done = control.update_weights_from_distributed([n for n, _ in tensors], [str(t.dtype)[6:] for _, t in tensors],
                                                   [list(t.shape) for _, t in tensors], weight_version="dist")
    pushing.join(30)
    assert done["weight_version"] == "dist" and done["num_tensors"] == len(tensors)
    fresh = LLM(weights_b, dtype="float32", enforce_eager=True).generate(
        ["t5 t6 t7"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert complete(server)["text"] == fresh.outputs[0].text
    control.update_weights_from_disk(tiny_with_tokenizer, weight_version="a")
