"""Pausing generation and updating weights in the engine core (the server's
`/pause_generation`, `/continue_generation` and `/update_weights_from_disk`).

One `GenerationGate` per core decides, for each loop iteration, whether the engine steps and
where a new request goes; every control input gets one `ControlReply`. While paused, new
requests wait in the gate's backlog (none is refused, none is lost) and join on continue. A
weight update runs only with no request unfinished, so each request keeps one weight version:
`abort` and `wait` empty the engine first; `keep` holds requests under the old weights, so an
update then is refused (409) until they are aborted, finished or resumed."""

from __future__ import annotations

import logging

from verispec.distributed.weight_group import WeightGroupSpec
from verispec.engine.core_protocol import (PAUSE_MODES, AddRequest, ContinueGeneration, ControlReply,
                                           InitWeightsUpdateGroup, PauseGeneration, UpdateWeightsFromDisk,
                                           UpdateWeightsFromDistributed)
from verispec.worker.weight_sync import UpdateWhileRunning
from verispec.outputs import RequestOutput

logger = logging.getLogger("verispec.core")


class GenerationGate:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.mode: str | None = None  # None: generating
        self.backlog: list[AddRequest] = []  # requests that arrived while paused
        self._drain_call: int | None = None  # a `wait` pause, answered once the engine is empty

    @property
    def steps(self) -> bool:
        """Whether the engine steps now: not while requests are kept."""
        return self.mode != "keep"

    def hold(self, add: AddRequest) -> bool:
        """True if the request waits in the backlog (generation is paused)."""
        if self.mode is None:
            return False
        self.backlog.append(add)
        return True

    def forget(self, request_ids: list[str]) -> None:
        """Requests their clients aborted while they waited in the backlog."""
        gone = set(request_ids)
        self.backlog = [add for add in self.backlog if add.request_id not in gone]

    def pause(self, msg: PauseGeneration) -> tuple[list[RequestOutput], list[ControlReply]]:
        """(the aborted requests' last outputs, the replies now)."""
        if msg.mode not in PAUSE_MODES:
            return [], [ControlReply(msg.call_id, False, f"mode must be one of {', '.join(PAUSE_MODES)}; got {msg.mode!r}",
                                     "invalid")]
        replies = self._answer_drain(False, "paused again before the requests finished")
        self.mode = msg.mode
        aborted = []
        if msg.mode == "abort":
            aborted = [out for rid in self.engine.request_ids() if (out := self.engine.abort_request(rid)) is not None]
        if msg.mode == "wait" and self.engine.has_unfinished_requests():
            self._drain_call = msg.call_id
        else:
            replies.append(self._paused_reply(msg.call_id, len(aborted)))
        logger.info("generation paused (%s): %d aborted, %d unfinished", msg.mode, len(aborted), len(self.engine.request_ids()))
        return aborted, replies

    def resume(self, msg: ContinueGeneration) -> tuple[list[AddRequest], list[ControlReply]]:
        """(the backlog to add now, the replies)."""
        replies = self._answer_drain(False, "generation continued before the requests finished")
        backlog, self.backlog, self.mode = self.backlog, [], None
        replies.append(ControlReply(msg.call_id, True, f"generation continues; {len(backlog)} waiting request(s) join",
                                    result={"num_joined": len(backlog)}))
        return backlog, replies

    def drained(self) -> list[ControlReply]:
        """After a step: the `wait` pause's answer once its requests have finished."""
        if self._drain_call is None or self.engine.has_unfinished_requests():
            return []
        call, self._drain_call = self._drain_call, None
        return [self._paused_reply(call, 0)]

    def join_group(self, msg: InitWeightsUpdateGroup) -> ControlReply:
        try:
            spec = WeightGroupSpec(msg.master_address, msg.master_port, msg.rank_offset, msg.world_size,
                                   msg.group_name, msg.backend)
            self.engine.init_weights_update_group(spec)
        except (ValueError, RuntimeError) as exc:  # a bad spec, or the rendezvous failed (timeout)
            return ControlReply(msg.call_id, False, f"{type(exc).__name__}: {exc}", "invalid")
        return ControlReply(msg.call_id, True, f"joined {msg.group_name!r} as rank {msg.rank_offset}")

    def update(self, msg: UpdateWeightsFromDisk | UpdateWeightsFromDistributed) -> ControlReply:
        try:
            if isinstance(msg, UpdateWeightsFromDisk):
                done = self.engine.update_weights(msg.path, msg.weight_version)
            else:
                done = self.engine.update_weights_from_distributed(msg.names, msg.dtypes, msg.shapes,
                                                                   msg.weight_version)
        except UpdateWhileRunning as exc:
            kept = " (kept by a pause in mode 'keep')" if self.mode == "keep" else ""
            return ControlReply(msg.call_id, False, f"{exc}{kept}", "conflict")
        except (ValueError, OSError) as exc:
            return ControlReply(msg.call_id, False, f"{type(exc).__name__}: {exc}", "invalid")
        logger.info("weights updated (%d tensors) in %.2f s: version %s", done.num_tensors, done.seconds,
                    done.weight_version)
        return ControlReply(msg.call_id, True, f"updated {done.num_tensors} tensors in {done.seconds:.2f} s",
                            result={"weight_version": done.weight_version, "num_tensors": done.num_tensors,
                                    "seconds": done.seconds})

    def _paused_reply(self, call_id: int, aborted: int) -> ControlReply:
        return ControlReply(call_id, True, f"generation paused (mode {self.mode})",
                            result={"mode": self.mode, "num_aborted": aborted,
                                    "num_kept": len(self.engine.request_ids())})

    def _answer_drain(self, ok: bool, message: str) -> list[ControlReply]:
        if self._drain_call is None:
            return []
        call, self._drain_call = self._drain_call, None
        return [ControlReply(call, ok, message, "conflict")]
