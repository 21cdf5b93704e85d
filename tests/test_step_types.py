"""A step's I/O records (core/step_types.py)."""

from __future__ import annotations

from test_scheduler import make_request
from verispec.core.step_types import AdaptivePlan, Drafts, RequestResult, ScheduledRequest, SchedulerOutput, StepResult


def test_a_step_cut_to_one_request_keeps_its_decisions_and_caps_the_budget():
    a, b = make_request("a", 3), make_request("b", 3)
    sa, sb = ScheduledRequest(a, 1, True, Drafts((5, 6, 7))), ScheduledRequest(b, 1, True, Drafts((8,)))
    plan = AdaptivePlan(3, ((0.5,), (0.5,)))
    out = SchedulerOutput([sa, sb], plan=plan)
    assert out.num_tokens == 6
    solo = out.only(sb)
    assert solo.scheduled == [sb] and solo.plan.budget == 1 and solo.plan.calibration == plan.calibration
    assert out.only(sa).plan.budget == 3 and plan.budget == 3  # the step's own plan is untouched
    assert SchedulerOutput([sa]).only(sa).plan is None


def test_a_step_result_holds_one_record_per_request():
    result = StepResult()
    result.of("a").sampled = [1, 2]
    result.of("a").num_accepted = 1
    assert result.get("a") == RequestResult(sampled=[1, 2], num_accepted=1) and result.get("b") is None
    other = StepResult({"b": RequestResult(sampled=[3])})
    result.update(other)
    assert sorted(result.requests) == ["a", "b"]
