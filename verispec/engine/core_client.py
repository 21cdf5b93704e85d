"""The frontend's handle on the engine-core process (asyncio + pyzmq).

One background task pulls `CoreOutputs` and routes each `RequestDelta` to the queue of its request;
a watchdog task notices a dead core and fails every waiting request instead of letting it hang.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from verispec.config import EngineConfig
from verispec.engine.core_protocol import (
    AbortRequests, AddRequest, AddRequests, ContinueGeneration, ControlReply, CoreFailed, CoreMessage, CoreOutputs,
    CoreReady, EngineStats, InitWeightsUpdateGroup, PauseGeneration, RequestDelta, ResetPrefixCache, Shutdown,
    UpdateWeightsFromDisk, UpdateWeightsFromDistributed, params_to_wire, split_encodable,
)
from verispec.sampling_params import SamplingParams

logger = logging.getLogger("verispec.client")

_WATCHDOG_S = 0.2


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; requests fail fast with 503."""


def _run_core(*args) -> None:
    """The core process's entry: the engine's modules (torch's among them) load there, not in the
    frontend, whose own start-up then runs beside the core's."""
    from verispec.engine.core_process import run_engine_core

    run_engine_core(*args)


class EngineStartError(RuntimeError):
    """The engine-core process could not load the model."""


class AsyncEngineClient:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.stats = EngineStats()
        self.ready: CoreReady | None = None
        self.dead = False
        self.dead_reason = ""
        self._failure = ""  # why the core said it stops, if it did
        self._queues: dict[str, asyncio.Queue] = {}
        self._tasks: list[asyncio.Task] = []
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._tmp = Path(tempfile.mkdtemp(prefix="verispec-"))
        self._ctx = zmq.asyncio.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._out = self._ctx.socket(zmq.PULL)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        self._stats_listeners: list = []
        self._pending_adds: list[AddRequest] = []
        self._calls: dict[int, asyncio.Future] = {}  # control inputs awaiting their ControlReply
        self._num_calls = 0

    # ------------------------------------------------------------------ lifecycle
    @property
    def core_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def launch(self) -> None:
        """Starts the core process (once): `verispec serve` calls it first thing, so the core loads
        while the frontend imports its web stack; `start` waits for it."""
        if self._proc is not None:
            return
        in_addr = f"ipc://{self._tmp}/input.sock"
        out_addr = f"ipc://{self._tmp}/output.sock"
        self._in.bind(in_addr)
        self._out.bind(out_addr)
        # spawn, not fork: a forked copy of a process that already touched torch threads or an
        # event loop is not safe.
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(
            target=_run_core, args=(self.config, in_addr, out_addr), name="verispec-core", daemon=True
        )
        self._proc.start()

    async def start(self, timeout_s: float = 900.0) -> None:
        self.launch()
        deadline = time.monotonic() + timeout_s
        while True:
            if await self._out.poll(200):
                msg = self._decoder.decode(await self._out.recv())
                if isinstance(msg, CoreFailed):
                    raise EngineStartError(msg.message)
                if isinstance(msg, CoreReady):
                    self.ready = msg
                    self.stats = msg.stats
                    break
            if not self._proc.is_alive():
                raise EngineStartError(f"the engine core exited with code {self._proc.exitcode} while loading")
            if time.monotonic() > deadline:
                raise EngineStartError(f"the engine core did not start within {timeout_s:.0f} s")
        self._tasks = [asyncio.create_task(self._output_loop()), asyncio.create_task(self._watchdog())]

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._proc is not None and self._proc.is_alive():
            try:
                await self._in.send(self._encoder.encode(Shutdown()))
            except zmq.ZMQError:
                pass
            await asyncio.to_thread(self._proc.join, 5)
            if self._proc.is_alive():
                self._proc.kill()
        self._in.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def add_stats_listener(self, fn) -> None:
        self._stats_listeners.append(fn)

    # ------------------------------------------------------------------ requests
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, group: str | None = None
    ) -> AsyncIterator[RequestDelta]:
        """Yields the request's deltas until it finishes. Leaving early (a disconnect, a cancelled
        task) aborts it in the core, which frees its KV blocks. `group`: the client request it
        belongs to (default: itself), between which the core shares its slots fairly."""
        if self.dead:
            raise EngineDeadError(self.dead_reason)
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already running")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            self._queue_add(AddRequest(request_id, prompt_token_ids, params_to_wire(params), group))
            while True:
                item = await queue.get()
                if isinstance(item, EngineDeadError):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort([request_id])

    def _queue_add(self, add: AddRequest) -> None:
        """Adds made in the same event-loop iteration (the prompts of one HTTP request, started as
        tasks together) go out as one message, so the core schedules them in the same step."""
        if not self._pending_adds:
            asyncio.get_running_loop().call_soon(self._flush_adds)
        self._pending_adds.append(add)

    def _flush_adds(self) -> None:
        adds, self._pending_adds = self._pending_adds, []
        if self.dead or not adds:
            return
        try:
            payload = self._encoder.encode(adds[0] if len(adds) == 1 else AddRequests(adds))
        except Exception:  # noqa: BLE001 - some add cannot be encoded: it fails alone, the rest go
            sendable, failed = split_encodable(self._encoder, adds)
            for add, exc in failed:
                self._fail(add.request_id, f"the request could not be sent to the engine: {exc}")
            if not sendable:
                return
            payload = self._encoder.encode(sendable[0] if len(sendable) == 1 else AddRequests(sendable))
        try:
            self._in.send(payload)
        except zmq.ZMQError as exc:  # the socket is closing at shutdown
            for add in adds:
                self._fail(add.request_id, f"the request could not be sent to the engine: {exc}")

    def _fail(self, request_id: str, message: str, kind: str = "internal") -> None:
        """Ends one waiting request with an error delta (a 500 with `message`)."""
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(RequestDelta(request_id, [], True, error=message, error_kind=kind))

    def abort(self, request_ids: list[str]) -> None:
        """Not a coroutine on purpose: it runs in the `finally` of a cancelled request, where any
        await would be cancelled again. pyzmq sends at once when the socket can take it."""
        if self.dead or not request_ids:
            return
        # A request cancelled before its add went out is simply never sent.
        gone = set(request_ids)
        self._pending_adds = [a for a in self._pending_adds if a.request_id not in gone]
        try:
            self._in.send(self._encoder.encode(AbortRequests(list(request_ids))))
        except zmq.ZMQError:  # the socket is closing at shutdown
            pass

    def reset_prefix_cache(self) -> None:
        """The core resets its cache before it reads any request sent after this call."""
        if self.dead:
            raise EngineDeadError(self.dead_reason)
        self._flush_adds()  # requests queued before the reset reach the core before it
        self._in.send(self._encoder.encode(ResetPrefixCache()))

    # ------------------------------------------------------------------ control (engine/pause.py)
    async def pause_generation(self, mode: str) -> ControlReply:
        return await self._control(lambda call: PauseGeneration(call, mode))

    async def continue_generation(self) -> ControlReply:
        return await self._control(ContinueGeneration)

    async def update_weights_from_disk(self, path: str, weight_version: int | str | None) -> ControlReply:
        return await self._control(lambda call: UpdateWeightsFromDisk(call, path, weight_version))

    async def init_weights_update_group(self, **spec) -> ControlReply:
        return await self._control(lambda call: InitWeightsUpdateGroup(call, **spec))

    async def update_weights_from_distributed(self, names, dtypes, shapes, weight_version) -> ControlReply:
        return await self._control(lambda call: UpdateWeightsFromDistributed(call, names, dtypes, shapes, weight_version))

    async def _control(self, make) -> ControlReply:
        """Sends a control input after every request queued before it; waits for its reply."""
        if self.dead:
            raise EngineDeadError(self.dead_reason)
        self._flush_adds()
        self._num_calls += 1
        future = asyncio.get_running_loop().create_future()
        self._calls[self._num_calls] = future
        self._in.send(self._encoder.encode(make(self._num_calls)))
        return await future

    # ------------------------------------------------------------------ background tasks
    async def _output_loop(self) -> None:
        while True:
            data = await self._out.recv()
            try:
                msg = self._decoder.decode(data)
            except msgspec.MsgspecError as exc:
                self._fail_undecodable(data, exc)
                continue
            if isinstance(msg, CoreFailed):  # the core is stopping; the watchdog reports this reason
                self._failure = msg.message
                continue
            if isinstance(msg, ControlReply):
                future = self._calls.pop(msg.call_id, None)
                if future is not None and not future.done():
                    future.set_result(msg)
                continue
            if not isinstance(msg, CoreOutputs):
                continue
            for delta in msg.deltas:
                queue = self._queues.get(delta.request_id)
                if queue is not None:  # a request aborted by its client may still emit once
                    queue.put_nowait(delta)
            self.stats = msg.stats
            for fn in self._stats_listeners:
                try:
                    fn(msg.stats)
                except Exception:  # noqa: BLE001 - a metrics hook must not stop the outputs
                    logger.exception("stats listener failed")

    def _fail_undecodable(self, data: bytes, exc: Exception) -> None:
        """An output message that does not decode fails the requests it names, or, when even
        those cannot be read from it, every waiting request: none is left waiting forever."""
        logger.error("undecodable message from the engine core: %s", exc)
        try:
            deltas = msgspec.msgpack.decode(data).get("deltas", [])
            ids = [d[0] for d in deltas if d and isinstance(d[0], str) and d[0] in self._queues]
        except Exception:  # noqa: BLE001
            ids = list(self._queues)
        for rid in ids:
            self._fail(rid, f"the engine's output for this request could not be read: {exc}")
        self.abort(ids)

    async def _watchdog(self) -> None:
        while self._proc.is_alive():
            await asyncio.sleep(_WATCHDOG_S)
        self.dead = True
        self.dead_reason = self._failure or f"the engine core process exited (code {self._proc.exitcode})"
        logger.error("%s; failing %d in-flight requests", self.dead_reason, len(self._queues))
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(self.dead_reason))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(self.dead_reason))
