"""What the frontend does before a request reaches the engine core, kept off the event loop and bounded.

Tokenizing, rendering the chat template and compiling a grammar each cost time that grows with the
request. They run in worker threads (`Preprocessor`), so the event loop, and with it `/health`,
never waits on them. Before any of that, the cheap bounds are checked on the loop: the sequences
(prompts x n) the request would hold, alone and with all others pending, and each text's character count, since a
text longer than `TextEncoder.max_chars(limit)` cannot fit `limit` tokens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
import os
from dataclasses import dataclass, field

from verispec.entrypoints.openai.errors import RequestError

# The ASGI scope key under which a request's reserved sequences are kept (entrypoints/openai/limits.py).
SCOPE_KEY = "verispec.reserved"


@dataclass(slots=True)
class Reservation:
    sequences: int = 0


@dataclass(slots=True)
class PendingWork:
    """Generation work admitted and not finished. Requests are counted by the ASGI middleware
    around the whole call; sequences (prompts x n) are reserved once the body is parsed and given
    back by the same middleware, so no exit path can leak them."""

    max_requests: int
    max_sequences: int
    max_request_sequences: int  # one request's share: the others keep room beside it
    requests: int = 0
    sequences: int = 0

    def reserve(self, scope: dict, num: int, param: str) -> None:
        if num > self.max_request_sequences:
            raise RequestError(f"this request asks for {num} sequences (prompts x n); this server takes at most "
                               f"{self.max_request_sequences} per request (--max-request-sequences)", param)
        if self.sequences + num > self.max_sequences:
            raise RequestError(f"the server is at its limit of {self.max_sequences} pending sequences; retry shortly",
                               status=503, headers={"Retry-After": "1"})
        holder = scope.get(SCOPE_KEY)
        if holder is None:  # not under the middleware (a test app): nothing would give them back
            return
        self.sequences += num
        holder.sequences += num

    def release(self, holder: Reservation) -> None:
        self.sequences -= holder.sequences
        holder.sequences = 0


@dataclass(slots=True)
class Preprocessor:
    """Worker threads for request preparation, and a separate pool for grammars, whose compile
    time has its own bound (a preparing thread waits on it, so the two must not share a pool)."""

    workers: int = field(default_factory=lambda: max(2, os.cpu_count() or 2))
    _prepare: cf.ThreadPoolExecutor | None = None
    _grammars: cf.ThreadPoolExecutor | None = None

    async def run(self, fn, *args):
        if self._prepare is None:
            self._prepare = cf.ThreadPoolExecutor(self.workers, thread_name_prefix="verispec-prepare")
        return await asyncio.get_running_loop().run_in_executor(self._prepare, functools.partial(fn, *args))

    def within(self, timeout_s: float, fn, *args):
        """fn(*args) in the grammar pool; TimeoutError past `timeout_s` (the work runs on, bounded
        by the grammar's parser limits, and its result is cached for the next request)."""
        if self._grammars is None:
            self._grammars = cf.ThreadPoolExecutor(self.workers, thread_name_prefix="verispec-grammar")
        return self._grammars.submit(fn, *args).result(timeout=timeout_s)

    def shutdown(self) -> None:
        for pool in (self._prepare, self._grammars):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

