"""The frontend <-> engine-core hand-off: one request that cannot cross fails alone, at once.

The core runs in a thread of this process (`EngineCore.run` over real pyzmq sockets) on a tiny
model, and the frontend is a real `AsyncEngineClient` without its child process.
"""

from __future__ import annotations

import asyncio
import threading

import msgspec
import pytest
import zmq

from verispec import LLM, SamplingParams
from verispec.engine.core_process import EngineCore
from verispec.engine.core_client import AsyncEngineClient
from verispec.engine.core_protocol import Shutdown

GOOD = dict(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture
def wired(tiny_llama):
    """(client, out_address): a client whose core is a thread of this process."""
    llm = LLM(tiny_llama)
    client = AsyncEngineClient(llm.engine.config)
    in_addr, out_addr = f"ipc://{client._tmp}/input.sock", f"ipc://{client._tmp}/output.sock"
    client._in.bind(in_addr)
    client._out.bind(out_addr)
    ctx = zmq.Context()
    core_in, core_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    core_in.connect(in_addr)
    core_out.connect(out_addr)
    thread = threading.Thread(target=EngineCore(llm.engine, core_in, core_out).run, daemon=True)
    thread.start()
    yield client, out_addr

    async def stop_core():
        await client._in.send(client._encoder.encode(Shutdown()))

    asyncio.run(stop_core())
    thread.join(10)
    core_in.close(linger=0)
    core_out.close(linger=0)
    ctx.term()
    asyncio.run(client.shutdown())


async def _collect(client: AsyncEngineClient, rid: str, params: SamplingParams, group: str | None = None) -> list:
    return [delta async for delta in client.generate(rid, [5, 6, 7], params, group=group)]


def test_a_request_that_cannot_be_encoded_fails_alone(wired, monkeypatch):
    client, _ = wired
    flushed = []
    original = client._flush_adds
    monkeypatch.setattr(client, "_flush_adds", lambda: (flushed.append(len(client._pending_adds)), original()))
    poisoned = SamplingParams(**GOOD)
    object.__setattr__(poisoned, "seed", 2**70)  # past validation (frozen: forced): msgpack cannot encode it

    async def scenario():
        client._tasks = [asyncio.create_task(client._output_loop())]
        tasks = [asyncio.create_task(_collect(client, f"r{i}", poisoned if i == 1 else SamplingParams(**GOOD)))
                 for i in range(4)]
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    results = asyncio.run(scenario())
    assert flushed == [4]  # one event-loop iteration, one message
    bad = results[1]
    assert len(bad) == 1 and bad[0].finished and "could not be sent to the engine" in bad[0].error
    for i in (0, 2, 3):
        assert results[i][-1].finished and results[i][-1].error is None
        assert sum(len(c.token_ids) for d in results[i] for c in d.completions) == 3


def test_an_unreadable_output_fails_the_request_it_names_alone(wired):
    client, out_addr = wired

    async def scenario():
        client._tasks = [asyncio.create_task(client._output_loop())]
        stream = client.generate("long", [5, 6, 7], SamplingParams(**{**GOOD, "max_tokens": 400}))
        first = await stream.__anext__()  # "long" runs now, with hundreds of steps to go (no fixed sleep)
        assert not first.finished

        async def rest():
            return [first] + [delta async for delta in stream]

        long = asyncio.create_task(rest())
        short = asyncio.create_task(_collect(client, "short", SamplingParams(**GOOD)))
        # A second pusher on the frontend's output socket: a delta for "long" whose fields are wrong.
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(out_addr)
        push.send(msgspec.msgpack.encode({"type": "outputs", "deltas": [["long", "not a list", "no"]], "stats": {}}))
        push.close(linger=1000)
        ctx.term()
        return await asyncio.wait_for(asyncio.gather(long, short), 60)

    long, short = asyncio.run(scenario())
    assert long[-1].finished and "could not be read" in long[-1].error
    assert short[-1].error is None and sum(len(c.token_ids) for d in short for c in d.completions) == 3


def test_a_group_travels_from_the_client_to_the_core(wired, monkeypatch):
    client, _ = wired
    sent = []
    original = client._queue_add
    monkeypatch.setattr(client, "_queue_add", lambda add: (sent.append((add.request_id, add.group)), original(add)))

    async def scenario():
        client._tasks = [asyncio.create_task(client._output_loop())]
        tasks = [asyncio.create_task(_collect(client, "a", SamplingParams(**GOOD), group="http-1")),
                 asyncio.create_task(_collect(client, "b", SamplingParams(**GOOD)))]
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    for deltas in asyncio.run(scenario()):
        assert deltas[-1].finished and deltas[-1].error is None
    assert sent == [("a", "http-1"), ("b", None)]
