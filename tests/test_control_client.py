"""The trainer's client (verispec/entrypoints/openai/control_client.py) against a stub HTTP server
that records what it is sent: bodies and key, errors read from the OpenAI shape, and
`push_weights`' sequence (the weights saved once, pause, update, continue even when the update
fails). The real routes are test_admin.py's."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch
from safetensors.torch import load_file

from verispec.entrypoints.openai.control_client import ControlError, ServerControl


@pytest.fixture
def stub():
    """(url, the requests it got, the replies to give per path: (status, body))."""
    calls, replies = [], {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            calls.append((self.path, body, self.headers.get("Authorization")))
            status, answer = replies.get(self.path, (200, {"success": True}))
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", calls, replies
    server.shutdown()


def test_calls_send_their_body_and_the_key(stub):
    url, calls, _ = stub
    client = ServerControl(url + "/", api_key="secret")
    client.pause("keep")
    client.update_weights_from_disk("/w", weight_version=3)
    client.resume()
    assert calls == [("/pause_generation", {"mode": "keep"}, "Bearer secret"),
                     ("/update_weights_from_disk", {"model_path": "/w", "weight_version": 3}, "Bearer secret"),
                     ("/continue_generation", {}, "Bearer secret")]


def test_an_error_carries_the_servers_status_and_message(stub):
    url, _, replies = stub
    replies["/update_weights_from_disk"] = (409, {"error": {"message": "1 request(s) unfinished", "code": 409}})
    replies["/pause_generation"] = (502, "not the OpenAI shape")
    client = ServerControl(url)
    with pytest.raises(ControlError) as err:
        client.update_weights_from_disk("/w")
    assert err.value.status == 409 and err.value.message == "1 request(s) unfinished"
    with pytest.raises(ControlError) as err:
        client.pause()
    assert err.value.status == 502


def test_push_weights_saves_once_and_always_continues(stub, tmp_path):
    url, calls, replies = stub
    embed = torch.randn(8, 4)
    state = {"model.embed_tokens.weight": embed, "lm_head.weight": embed, "model.norm.weight": torch.ones(4)}
    replies["/update_weights_from_disk"] = (400, {"error": {"message": "bad tensor"}})
    with pytest.raises(ControlError, match="bad tensor"):
        ServerControl(url).push_weights(state, tmp_path / "step-1", weight_version=1, mode="abort")
    assert [c[0] for c in calls] == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
    assert calls[0][1] == {"mode": "abort"} and calls[1][1]["model_path"] == str(tmp_path / "step-1")
    saved = load_file(tmp_path / "step-1" / "model.safetensors")
    assert sorted(saved) == ["model.embed_tokens.weight", "model.norm.weight"]  # the tied head once
    assert torch.equal(saved["model.embed_tokens.weight"], embed)
