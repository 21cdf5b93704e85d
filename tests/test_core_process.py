"""The engine core's loop body (verispec/engine/core_process.py), driven in-process without sockets: inputs
that cannot be decoded or encoded fail only the request they name, groups reach every child, and
`DeltaTracker` turns cumulative outputs into deltas that hold back a possible stop string's start
(checked against hand-built `RequestOutput`s)."""

from __future__ import annotations

import msgspec

from test_core_client import GOOD
from verispec import LLM, SamplingParams
from verispec.engine.core_process import DeltaTracker, EngineCore, logprob_row
from verispec.engine.core_protocol import params_to_wire
from verispec.engine.core_protocol import AddRequest, AddRequests, CompletionDelta, CoreOutputs, RequestDelta
from verispec.outputs import CompletionOutput, Logprob, RequestOutput


def test_the_core_refuses_an_undecodable_add_alone(tiny_llama):
    engine = LLM(tiny_llama).engine
    core = EngineCore(engine, None, None)
    good = [msgspec.to_builtins(AddRequest(rid, [5, 6, 7], params_to_wire(SamplingParams(**GOOD)))) for rid in "ac"]
    bad = {"type": "add", "request_id": "b", "prompt_token_ids": ["x"], "params": {}}
    refused, running = core.receive(msgspec.msgpack.encode({"type": "add_many", "requests": [good[0], bad, good[1]]}))
    assert running
    assert [(d.request_id, d.error_kind) for d in refused] == [("b", "invalid")]
    assert sorted(engine.request_ids()) == ["a", "c"]
    # Nothing readable at all: nothing to answer, and the core keeps running.
    assert core.receive(b"\xc1") == ([], True)



def test_the_core_fails_an_unencodable_output_alone(tiny_llama):
    class Sink:
        def send(self, payload, copy=True):
            sent.append(bytes(payload))

    sent: list[bytes] = []
    core = EngineCore(LLM(tiny_llama).engine, None, Sink())
    ok = RequestDelta("ok", [CompletionDelta(0, [7], "x")], False)
    bad = RequestDelta("bad", [CompletionDelta(0, [2**70], "y")], True)  # msgpack has no such integer
    core.send([ok, bad])
    msg = msgspec.msgpack.Decoder(CoreOutputs).decode(sent[0])
    by_id = {d.request_id: d for d in msg.deltas}
    assert by_id["ok"] == ok
    assert by_id["bad"].finished and "could not be sent" in by_id["bad"].error



def test_the_core_gives_the_group_to_every_child(tiny_llama):
    engine = LLM(tiny_llama).engine
    core = EngineCore(engine, None, None)
    two, one = params_to_wire(SamplingParams(**GOOD, n=2)), params_to_wire(SamplingParams(**GOOD))
    adds = AddRequests([AddRequest("a", [5, 6, 7], two, group="http-1"), AddRequest("b", [5, 6, 7], one)])
    assert core.receive(msgspec.msgpack.encode(adds)) == ([], True)
    assert {r.request_id: r.group for r in engine.scheduler.waiting} == {"a#0": "http-1", "a#1": "http-1", "b": "b"}



def output(rid: str, text: str, ids: list[int], finish: str | None = None, logprobs=None) -> RequestOutput:
    comp = CompletionOutput(0, text, ids, None, logprobs, finish_reason=finish)
    return RequestOutput(rid, None, [5], None, [comp], finished=finish is not None)


def test_params_travel_as_plain_data_and_come_back_equal():
    params = SamplingParams(temperature=0.5, top_k=7, stop=["x"], seed=3, logprobs_mode="raw_logits")
    wire = params_to_wire(params)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(wire)) == wire  # nothing but plain data
    assert params_to_wire(SamplingParams(**wire)) == wire


def test_deltas_hold_back_what_could_start_a_stop_string():
    tracker = DeltaTracker()
    tracker.start("r", SamplingParams(stop=["END"]))  # 3 characters: hold back the last 2
    first = tracker.delta(output("r", "abcde", [1, 2]))
    assert first.completions[0].text == "abc" and first.completions[0].token_ids == [1, 2]
    # No new token, but the text the hold covered is released once the request finishes.
    last = tracker.delta(output("r", "abcdef", [1, 2, 3], finish="length"))
    assert last.completions[0].text == "def" and last.completions[0].token_ids == [3] and last.finished


def test_a_finished_completion_sends_nothing_more_and_is_forgotten():
    tracker = DeltaTracker()
    tracker.start("r", SamplingParams())
    tracker.delta(output("r", "ab", [1, 2], finish="stop"))
    assert "r" not in tracker._progress  # the request's bookkeeping is gone with it


def test_logprob_rows_keep_the_entries_order():
    row = logprob_row({7: Logprob(-0.5, 2, "a"), 3: Logprob(-0.1, 1, "b")})
    assert (row.token_ids, row.logprobs, row.ranks, row.tokens) == ([7, 3], [-0.5, -0.1], [2, 1], ["a", "b"])
    assert logprob_row(None) is None


def test_an_engine_error_finishes_the_request_with_its_kind():
    tracker = DeltaTracker()
    tracker.start("r", SamplingParams())
    out = output("r", "", [])
    out.error, out.finished = "boom", True
    delta = tracker.delta(out)
    assert delta.finished and delta.error == "boom" and delta.error_kind == "internal"
