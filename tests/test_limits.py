"""The ASGI limits around the app (verispec/entrypoints/openai/limits.py), driven by hand-made ASGI
calls with no server: the body size limit refuses declared and undeclared (chunked) bodies past it
with a 413 and replays a body within it whole; the concurrency limit answers 503 with Retry-After
past its requests and gives back every slot and reserved sequence, whatever way the app exits."""

from __future__ import annotations

import asyncio
import json

import pytest

from verispec.entrypoints.openai.limits import BodySizeLimit, ConcurrencyLimit
from verispec.entrypoints.openai.preprocess import PendingWork


def http(method="POST", path="/v1/completions", headers=()):
    return {"type": "http", "method": method, "path": path, "headers": list(headers)}


def call(app, scope, chunks=(b"",)):
    """Runs one ASGI call; returns (status or None, JSON body or None, what the app received)."""
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next((m for m in sent if m["type"] == "http.response.start"), None)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return (start["status"] if start else None), (json.loads(body) if body else None), start


class Echo:
    """An app that reads its whole body and records it."""

    def __init__(self):
        self.bodies = []

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        self.bodies.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def test_a_declared_length_past_the_limit_is_a_413_before_reading():
    app = Echo()
    status, body, _ = call(BodySizeLimit(app, 10), http(headers=[(b"content-length", b"11")]), [b"x" * 11])
    assert status == 413 and "limit of 10 bytes" in body["error"]["message"] and app.bodies == []


def test_an_undeclared_body_is_held_to_the_same_limit():
    app = Echo()
    status, body, _ = call(BodySizeLimit(app, 10), http(), [b"x" * 6, b"y" * 6])
    assert status == 413 and body["error"]["type"] == "RequestTooLargeError" and app.bodies == []


def test_a_body_within_the_limit_reaches_the_app_whole():
    app = Echo()
    status, _, _ = call(BodySizeLimit(app, 10), http(), [b"abc", b"defg"])
    assert status == 200 and app.bodies == [b"abcdefg"]


def test_get_requests_pass_untouched():
    app = Echo()
    assert call(BodySizeLimit(app, 1), http("GET", "/health"), [b"xx"])[0] == 200


def test_past_the_pending_requests_it_is_a_503_with_retry_after():
    work = PendingWork(max_requests=1, max_sequences=8, max_request_sequences=8)
    work.requests = 1
    status, body, start = call(ConcurrencyLimit(Echo(), work), http())
    assert status == 503 and "limit of 1 pending requests" in body["error"]["message"]
    assert (b"retry-after", b"1") in start["headers"]


def test_slots_and_sequences_are_given_back_even_when_the_app_fails():
    work = PendingWork(max_requests=2, max_sequences=8, max_request_sequences=8)

    async def failing(scope, receive, send):
        work.reserve(scope, 3, "n")  # the route reserves its sequences, then fails
        assert work.requests == 1 and work.sequences == 3
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        call(ConcurrencyLimit(failing, work), http())
    assert work.requests == 0 and work.sequences == 0


def test_only_v1_posts_are_counted():
    work = PendingWork(max_requests=0, max_sequences=8, max_request_sequences=8)  # would refuse any counted call
    assert call(ConcurrencyLimit(Echo(), work), http("POST", "/tokenize"))[0] == 200
    assert call(ConcurrencyLimit(Echo(), work), http("GET", "/v1/models"))[0] == 200
