"""The engine core process: runs `LLMEngine` in a loop, fed and drained over pyzmq.

The server's HTTP event loop never waits on a model step: it pushes `AddRequest` / `AbortRequests`
to this process and pulls `CoreOutputs` (deltas plus engine stats) back. Detokenization and stop
strings stay here, next to the engine, so a request that hits a stop string stops in the same step
instead of one step later.
"""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass, fields

import msgspec
import zmq

from verispec.config import EngineConfig
from verispec.distributed.comm import WorkerDiedError
from verispec.engine.core_protocol import (
    AbortRequests, AddRequest, AddRequests, CompletionDelta, ContinueGeneration, ControlReply, CoreFailed, CoreInput,
    CoreOutputs, CoreReady, InitWeightsUpdateGroup, LogprobRow, PauseGeneration, RequestDelta, ResetPrefixCache,
    Shutdown, UpdateWeightsFromDisk, UpdateWeightsFromDistributed, split_encodable,
)
from verispec.engine.pause import GenerationGate
from verispec.outputs import Logprob, RequestOutput
from verispec.sampling_params import SamplingParams

logger = logging.getLogger("verispec.core")

# How long an idle core blocks on its input before checking that the frontend is still alive.
_IDLE_POLL_MS = 500


def logprob_row(entry: dict[int, Logprob] | None) -> LogprobRow | None:
    if entry is None:
        return None
    items = list(entry.items())
    return LogprobRow(
        token_ids=[t for t, _ in items],
        logprobs=[lp.logprob for _, lp in items],
        ranks=[lp.rank for _, lp in items],
        tokens=[lp.decoded_token for _, lp in items],
    )


@dataclass(slots=True)
class _Progress:
    """How much of each completion has already been sent."""

    tokens: list[int]
    chars: list[int]
    finished: list[bool]
    # Text that could still turn out to be the start of a stop string is held back while the
    # request runs: a stop string must never reach a streaming client.
    hold: int
    prompt_sent: bool = False


class DeltaTracker:
    """Turns the engine's cumulative RequestOutputs into deltas."""

    def __init__(self) -> None:
        self._progress: dict[str, _Progress] = {}

    def start(self, request_id: str, params: SamplingParams) -> None:
        n = params.n
        hold = max((len(s) for s in params.stop or ()), default=1) - 1
        self._progress[request_id] = _Progress([0] * n, [0] * n, [False] * n, hold)

    def forget(self, request_id: str) -> None:
        self._progress.pop(request_id, None)

    def delta(self, out: RequestOutput) -> RequestDelta:
        prog = self._progress[out.request_id]
        hold = prog.hold
        completions = []
        for comp in out.outputs:
            i = comp.index
            if prog.finished[i]:
                continue
            done = comp.finish_reason is not None
            sent = prog.tokens[i]
            safe = len(comp.text) if done else max(prog.chars[i], len(comp.text) - hold)
            new_ids = comp.token_ids[sent:]
            if not new_ids and not done and safe == prog.chars[i]:
                continue
            rows = sources = None
            if comp.logprobs is not None:
                rows = [logprob_row(e) for e in comp.logprobs[sent : len(comp.token_ids)]]
            if comp.token_sources is not None:
                sources = [(s.kind, s.step, s.drafts) for s in comp.token_sources[sent : len(comp.token_ids)]]
            completions.append(CompletionDelta(i, new_ids, comp.text[prog.chars[i] : safe], rows, comp.finish_reason,
                                               comp.stop_reason, sources))
            prog.tokens[i] = len(comp.token_ids)
            prog.chars[i] = max(prog.chars[i], safe)
            prog.finished[i] = done
        prompt = None
        if not prog.prompt_sent and out.prompt_logprobs is not None:
            prompt = [logprob_row(e) for e in out.prompt_logprobs]
        prog.prompt_sent = True
        if out.finished:
            self.forget(out.request_id)
        if out.error is not None:
            return RequestDelta(out.request_id, completions, True, prompt, error=out.error,
                                error_kind=out.error_kind or "internal", weight_version=out.weight_version)
        return RequestDelta(out.request_id, completions, out.finished, prompt, weight_version=out.weight_version)


class EngineCore:
    """The loop inside the core process. Separate from the process entry point so tests can
    drive it in-process."""

    def __init__(self, engine, in_sock: zmq.Socket, out_sock: zmq.Socket):
        self.engine = engine
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.tracker = DeltaTracker()
        self.gate = GenerationGate(engine)
        self.replies: list[ControlReply] = []  # sent after the outputs of the same iteration
        self.decoder = msgspec.msgpack.Decoder(CoreInput)
        self.encoder = msgspec.msgpack.Encoder()
        self._parent_pid = os.getppid()

    def send(self, deltas: list[RequestDelta]) -> None:
        stats = self.engine.engine_stats()
        try:
            payload = self.encoder.encode(CoreOutputs(deltas, stats))
        except Exception:  # noqa: BLE001 - a delta that cannot be encoded fails its request alone
            deltas, failed = split_encodable(self.encoder, deltas)
            for delta, exc in failed:
                logger.error("output of %s cannot be encoded: %s", delta.request_id, exc)
                if not delta.finished:
                    self.engine.abort_request(delta.request_id)
                    self.tracker.forget(delta.request_id)
                deltas.append(RequestDelta(delta.request_id, [], True, error=f"the output could not be sent: {exc}",
                                           error_kind="internal"))
            payload = self.encoder.encode(CoreOutputs(deltas, stats))
        self.out_sock.send(payload, copy=False)
        replies, self.replies = self.replies, []
        for reply in replies:
            self.out_sock.send(self.encoder.encode(reply))

    def receive(self, data: bytes) -> tuple[list[RequestDelta], bool]:
        """Decodes and applies one input. An input that does not decode refuses the requests it
        names (each with its own error), never the core or the other requests."""
        try:
            return self.handle(self.decoder.decode(data))
        except msgspec.MsgspecError as exc:
            logger.error("undecodable input: %s", exc)
        try:
            raw = msgspec.msgpack.decode(data)
        except msgspec.MsgspecError:  # nothing readable: nothing to answer
            return [], True
        deltas: list[RequestDelta] = []
        for add in raw.get("requests", [raw]) if isinstance(raw, dict) else []:
            try:
                deltas.extend(self.handle(msgspec.convert(add, AddRequest))[0])
            except msgspec.MsgspecError as exc:
                rid = add.get("request_id") if isinstance(add, dict) else None
                if isinstance(rid, str):
                    deltas.append(RequestDelta(rid, [], True, error=f"invalid request: {exc}", error_kind="invalid"))
        return deltas, True

    def handle(self, msg) -> tuple[list[RequestDelta], bool]:
        """Applies one input; returns refusals to send and whether to keep running."""
        if isinstance(msg, AddRequests):
            refused = [d for add in msg.requests for d in self.handle(add)[0]]
            return refused, True
        if isinstance(msg, AddRequest):
            if self.gate.hold(msg):
                return [], True
            try:
                params = SamplingParams(**msg.params)
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, params, group=msg.group)
            except (ValueError, TypeError) as exc:
                return [RequestDelta(msg.request_id, [], True, error=str(exc), error_kind="invalid")], True
            self.tracker.start(msg.request_id, params)
            return [], True
        if isinstance(msg, AbortRequests):
            self.gate.forget(msg.request_ids)
            for rid in msg.request_ids:
                self.engine.abort_request(rid)
                self.tracker.forget(rid)
            return [], True
        if isinstance(msg, ResetPrefixCache):
            self.engine.reset_prefix_cache()
            return [], True
        return self.control(msg)

    def control(self, msg) -> tuple[list[RequestDelta], bool]:
        """Pause, continue, weight update (engine/pause.py); Shutdown stops the loop."""
        deltas: list[RequestDelta] = []
        if isinstance(msg, PauseGeneration):
            aborted, replies = self.gate.pause(msg)
            deltas = [self.tracker.delta(out) for out in aborted]
            self.replies += replies
        elif isinstance(msg, ContinueGeneration):
            backlog, replies = self.gate.resume(msg)
            deltas = [d for add in backlog for d in self.handle(add)[0]]
            self.replies += replies
        elif isinstance(msg, (UpdateWeightsFromDisk, UpdateWeightsFromDistributed)):
            self.replies.append(self.gate.update(msg))
        elif isinstance(msg, InitWeightsUpdateGroup):
            self.replies.append(self.gate.join_group(msg))
        return deltas, not isinstance(msg, Shutdown)

    def run(self) -> None:
        running = True
        while running:
            busy = self.gate.steps and self.engine.has_unfinished_requests()
            deltas: list[RequestDelta] = []
            touched = False
            if not busy and not self.in_sock.poll(_IDLE_POLL_MS):
                if os.getppid() != self._parent_pid:  # the frontend is gone: so is our purpose
                    return
                self.engine.check_workers()  # a dead tensor-parallel worker stops the core while idle too
                continue
            while running and self.in_sock.poll(0):
                refused, running = self.receive(self.in_sock.recv())
                deltas.extend(refused)
                touched = True
            if running and self.gate.steps and self.engine.has_unfinished_requests():
                deltas.extend(self.step())
                touched = True
            self.replies += self.gate.drained()
            if touched or self.replies:
                self.send(deltas)

    def step(self) -> list[RequestDelta]:
        try:
            outputs = self.engine.step()
        except WorkerDiedError:  # fatal: the core exits and the frontend answers 503 from then on
            raise
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the server
            logger.error("engine step failed:\n%s", traceback.format_exc())
            return self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
        return [self.tracker.delta(out) for out in outputs]

    def _fail_all(self, message: str) -> list[RequestDelta]:
        failed = []
        for rid in list(self.engine.request_ids()):
            self.engine.abort_request(rid)
            self.tracker.forget(rid)
            failed.append(RequestDelta(rid, [], True, error=message, error_kind="internal"))
        return failed


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str) -> None:
    """Entry point of the core process."""
    from verispec.engine.llm_engine import LLMEngine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s core %(levelname)s %(message)s")
    ctx = zmq.Context()
    in_sock = ctx.socket(zmq.PULL)
    in_sock.connect(input_addr)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    try:
        engine = LLMEngine(config)
    except Exception as exc:  # noqa: BLE001 - reported to the frontend, which exits with it
        out_sock.send(encoder.encode(CoreFailed(f"{type(exc).__name__}: {exc}")))
        out_sock.close(linger=2000)
        ctx.term()
        return
    ready = CoreReady(
        pid=os.getpid(),
        vocab_size=engine.vocab_size,
        max_model_len=engine.max_model_len,
        max_logprobs=config.max_logprobs,
        stats=engine.engine_stats(),
        eos_token_ids=sorted(engine.eos_token_ids),
        runtime=engine.runtime.labels(),
        runtime_line=engine.runtime.line(),
    )
    out_sock.send(encoder.encode(ready))
    try:
        EngineCore(engine, in_sock, out_sock).run()
    except WorkerDiedError as exc:  # the frontend says why before it sees the process exit
        logger.error("engine core stops: %s", exc)
        out_sock.send(encoder.encode(CoreFailed(str(exc))))
        raise
    finally:
        in_sock.close(linger=0)
        out_sock.close(linger=500)
        ctx.term()
