"""Crash isolation (worker/isolation.py) over a stand-in runner: which requests fail, and that the
solo runs are the step's own requests with its own decisions."""

from __future__ import annotations

import pytest

from test_scheduler import make_request
from verispec.distributed.comm import WorkerDiedError
from verispec.worker.isolation import execute_isolating_failures
from verispec.core.step_types import AdaptivePlan, Drafts, RequestResult, ScheduledRequest, SchedulerOutput, StepResult
from verispec.sample.grammar import GrammarFailed


class StandIn:
    """Raises `errors[id]` for a step holding that request; else one token per request."""

    def __init__(self, errors: dict[str, Exception]):
        self.errors, self.calls = errors, []

    def execute(self, sched: SchedulerOutput) -> StepResult:
        self.calls.append(sched)
        for s in sched.scheduled:
            if s.request.request_id in self.errors:
                raise self.errors[s.request.request_id]
        return StepResult({s.request.request_id: RequestResult(sampled=[7]) for s in sched.scheduled})


def step(*ids: str, drafts: int = 2) -> SchedulerOutput:
    return SchedulerOutput([ScheduledRequest(make_request(i, 3), 1, True, Drafts((5,) * drafts)) for i in ids],
                           plan=AdaptivePlan(3, ((0.5,),)))


def test_a_clean_step_runs_once():
    runner = StandIn({})
    result, failed = execute_isolating_failures(runner, step("a", "b"))
    assert failed == {} and sorted(result.requests) == ["a", "b"] and len(runner.calls) == 1


def test_the_request_at_fault_fails_alone_and_the_others_keep_their_solo_results(caplog):
    sched = step("a", "bad", "grammar", "c")
    runner = StandIn({"bad": ValueError("boom"), "grammar": GrammarFailed("too deep")})
    result, failed = execute_isolating_failures(runner, sched)
    assert failed == {"bad": ("ValueError: boom", "internal"), "grammar": ("too deep", "invalid")}
    assert sorted(result.requests) == ["a", "c"]
    solos = runner.calls[1:]
    assert [s.scheduled[0] for s in solos] == sched.scheduled  # the step's own entries, in order
    assert all(s.plan.budget == 2 for s in solos) and sched.plan.budget == 3  # capped, the step's kept
    assert "retrying its 4 requests one by one" in caplog.text


def test_a_lone_request_is_not_run_twice_and_a_dead_worker_is_fatal():
    runner = StandIn({"a": ValueError("boom")})
    assert execute_isolating_failures(runner, step("a"))[1] == {"a": ("ValueError: boom", "internal")}
    assert len(runner.calls) == 1
    with pytest.raises(WorkerDiedError):
        execute_isolating_failures(StandIn({"a": WorkerDiedError("rank 1")}), step("a", "b"))
