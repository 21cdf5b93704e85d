"""Request limits answered around the app: body size (413, whether or not the length is declared) and
pending requests and sequences (503)."""

from __future__ import annotations

from verispec.entrypoints.openai.errors import RequestError
from verispec.entrypoints.openai.preprocess import SCOPE_KEY, PendingWork, Reservation


async def send_error(send, status: int, message: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    """An OpenAI-shaped error answered straight from ASGI middleware (before the app runs)."""
    body = RequestError(message, status=status).response_body().model_dump_json().encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class BodySizeLimit:
    """Pure ASGI middleware. It reads the body itself, at most `max_bytes` of it, and replays it to
    the app: a body without Content-Length (chunked) is held to the same limit, and the app never
    sees a half-read body."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the server would

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        await send_error(send, 413, f"the request body exceeds the server's limit of {self.max_bytes} bytes")


class ConcurrencyLimit:
    """At most `work.max_requests` generation requests (POST /v1/...) in flight; more get 503 with
    Retry-After. Counted around the whole ASGI call, so a streamed answer holds its slot until the
    stream ends or the client leaves, and no early exit can leak a slot; the sequences a request
    reserved (preprocess.PendingWork) are given back here too. With the body size limit this
    bounds the memory that waiting requests can take."""

    def __init__(self, app, work: PendingWork):
        self.app = app
        self.work = work

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        work = self.work
        if work.requests >= work.max_requests:
            message = f"the server is at its limit of {work.max_requests} pending requests; retry shortly"
            return await send_error(send, 503, message, [(b"retry-after", b"1")])
        work.requests += 1
        holder = scope[SCOPE_KEY] = Reservation()
        try:
            await self.app(scope, receive, send)
        finally:
            work.requests -= 1
            work.release(holder)
