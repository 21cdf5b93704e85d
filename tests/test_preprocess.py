"""The frontend's bounds and worker pools (verispec/entrypoints/openai/preprocess.py): sequence
reservations (one request's share is a 400 naming the field, the server's total a 503 with
Retry-After, and release gives back exactly what was reserved) and the two thread pools (work runs
off the event loop; the grammar pool's time bound raises TimeoutError)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from verispec.entrypoints.openai.errors import RequestError
from verispec.entrypoints.openai.preprocess import SCOPE_KEY, PendingWork, Preprocessor, Reservation


def work() -> PendingWork:
    return PendingWork(max_requests=4, max_sequences=10, max_request_sequences=6)


def test_one_request_past_its_share_is_a_400_naming_the_field():
    with pytest.raises(RequestError, match="asks for 7 sequences") as err:
        work().reserve({SCOPE_KEY: Reservation()}, 7, "n")
    assert err.value.status == 400 and err.value.param == "n"


def test_past_the_servers_total_it_is_a_503_to_retry():
    w = work()
    w.reserve({SCOPE_KEY: Reservation()}, 6, "n")
    with pytest.raises(RequestError, match="limit of 10 pending sequences") as err:
        w.reserve({SCOPE_KEY: Reservation()}, 5, "prompt")
    assert err.value.status == 503 and err.value.headers == {"Retry-After": "1"}
    assert w.sequences == 6  # the refused request reserved nothing


def test_release_gives_back_what_the_holder_reserved():
    w, a, b = work(), Reservation(), Reservation()
    w.reserve({SCOPE_KEY: a}, 2, "n")
    w.reserve({SCOPE_KEY: a}, 1, "n")
    w.reserve({SCOPE_KEY: b}, 4, "n")
    w.release(a)
    assert (w.sequences, a.sequences, b.sequences) == (4, 0, 4)


def test_without_the_middleware_nothing_is_counted():
    w = work()
    w.reserve({}, 5, "n")  # no holder: nothing would ever give them back
    assert w.sequences == 0


def test_run_executes_in_a_worker_thread():
    pre = Preprocessor(workers=2)
    try:
        name = asyncio.run(pre.run(lambda: threading.current_thread().name))
    finally:
        pre.shutdown()
    assert name.startswith("verispec-prepare")


def test_within_raises_timeout_past_its_bound_and_returns_otherwise():
    pre = Preprocessor(workers=2)
    try:
        assert pre.within(5.0, lambda x: x + 1, 1) == 2
        with pytest.raises(TimeoutError):
            pre.within(0.05, time.sleep, 1.0)
    finally:
        pre.shutdown()
