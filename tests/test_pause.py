"""The engine core's generation gate (verispec/engine/pause.py) over a real engine on the tiny
model: what each pause mode does to unfinished requests, the backlog of requests that arrive
while paused, when a `wait` pause is answered, and when a weight update is refused."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest

from conftest import make_tiny_checkpoint
from verispec.config import EngineConfig
from verispec.engine.core_protocol import AddRequest, ContinueGeneration, PauseGeneration, UpdateWeightsFromDisk
from verispec.engine.llm_engine import LLMEngine
from verispec.engine.pause import GenerationGate
from verispec.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def engine(tiny_llama):
    return LLMEngine(EngineConfig.create(model=tiny_llama, dtype="float32", enforce_eager=True))


def running(engine, *ids):
    for rid in ids:
        engine.add_request(rid, [5, 6, 7], PARAMS)
    engine.step()


def test_abort_ends_every_request_with_its_tokens_so_far(engine):
    running(engine, "a", "b")
    gate = GenerationGate(engine)
    aborted, replies = gate.pause(PauseGeneration(1, "abort"))
    assert sorted(o.request_id for o in aborted) == ["a", "b"]
    assert all(o.finished and o.outputs[0].finish_reason == "abort" and o.outputs[0].token_ids for o in aborted)
    assert not engine.has_unfinished_requests()
    assert replies[0].ok and replies[0].result == {"mode": "abort", "num_aborted": 2, "num_kept": 0}


def test_wait_is_answered_once_the_requests_finish(engine):
    running(engine, "a")
    gate = GenerationGate(engine)
    aborted, replies = gate.pause(PauseGeneration(7, "wait"))
    assert aborted == [] and replies == [] and gate.steps
    while engine.has_unfinished_requests():
        assert gate.drained() == []
        engine.step()
    (reply,) = gate.drained()
    assert reply.call_id == 7 and reply.ok and gate.drained() == []


def test_keep_holds_requests_and_an_update_is_refused_meanwhile(engine, tmp_path):
    running(engine, "a")
    gate = GenerationGate(engine)
    _, (reply,) = gate.pause(PauseGeneration(1, "keep"))
    assert not gate.steps and reply.result["num_kept"] == 1
    refused = gate.update(UpdateWeightsFromDisk(2, str(tmp_path)))
    assert not refused.ok and refused.error_kind == "conflict" and "keep" in refused.message


def test_requests_arriving_while_paused_wait_and_join_on_continue(engine):
    gate = GenerationGate(engine)
    add = AddRequest("late", [5, 6], {"max_tokens": 2})
    assert not gate.hold(add)  # generating: straight to the engine
    gate.pause(PauseGeneration(1, "abort"))
    assert gate.hold(add) and gate.hold(AddRequest("gone", [5], {}))
    gate.forget(["gone"])  # its client went away while it waited
    backlog, (reply,) = gate.resume(ContinueGeneration(2))
    assert [a.request_id for a in backlog] == ["late"] and reply.result == {"num_joined": 1}
    assert gate.mode is None and gate.backlog == []


def test_a_bad_mode_and_a_bad_path_are_the_callers_errors(engine, tmp_path):
    gate = GenerationGate(engine)
    _, (reply,) = gate.pause(PauseGeneration(1, "later"))
    assert not reply.ok and reply.error_kind == "invalid" and gate.mode is None
    bad = gate.update(UpdateWeightsFromDisk(2, str(tmp_path / "missing")))
    assert not bad.ok and bad.error_kind == "invalid" and "missing" in bad.message


def test_an_update_on_an_empty_engine_is_versioned(engine, tmp_path):
    other = make_tiny_checkpoint(tmp_path / "b", "llama", seed=2)
    reply = GenerationGate(engine).update(UpdateWeightsFromDisk(3, other, "v9"))
    assert reply.ok and reply.result["weight_version"] == "v9" and reply.result["num_tensors"] > 0


def test_a_bad_weight_group_is_the_callers_error(engine):
    from verispec.engine.core_protocol import InitWeightsUpdateGroup, UpdateWeightsFromDistributed

    gate = GenerationGate(engine)
    reply = gate.join_group(InitWeightsUpdateGroup(1, "127.0.0.1", 1, rank_offset=0, world_size=2))
    assert not reply.ok and reply.error_kind == "invalid" and "rank_offset" in reply.message
    reply = gate.update(UpdateWeightsFromDistributed(2, ["model.norm.weight"], ["float32"], [[64]]))
    assert not reply.ok and "init_weights_update_group" in reply.message
