"""The engine's per-request state (verispec/request.py): token bookkeeping derived from `token_ids`,
the group a request defaults to, which statuses count as finished, and identity (not field)
equality, which the scheduler's list lookups rely on."""

from __future__ import annotations

from verispec.config import LogprobsMode
from verispec.core.request import Request, RequestStatus
from verispec.sample.noise import RequestNoise
from verispec.sampling_params import SamplingParams


def make(rid: str = "r", prompt=(5, 6, 7), **kw) -> Request:
    return Request(rid, None, list(prompt), SamplingParams(), LogprobsMode.RAW_LOGPROBS, RequestNoise(0),
                   frozenset({2}), 10, **kw)


def test_a_new_request_holds_its_prompt_and_no_output():
    req = make()
    assert req.token_ids == [5, 6, 7] and req.token_ids is not req.prompt_token_ids  # a copy, appended to later
    assert (req.num_prompt_tokens, req.num_tokens, req.num_output_tokens, req.output_token_ids) == (3, 3, 0, [])


def test_output_counts_follow_appended_tokens():
    req = make()
    req.token_ids += [8, 9]
    assert req.num_tokens == 5 and req.num_output_tokens == 2 and req.output_token_ids == [8, 9]
    assert req.prompt_token_ids == [5, 6, 7]


def test_the_group_defaults_to_the_request_itself():
    assert make("a").group == "a"
    assert make("a#1", group="http-7").group == "http-7"


def test_only_stop_length_and_abort_are_finished():
    finished = {s for s in RequestStatus if s.finished}
    assert finished == {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
    req = make()
    assert not req.is_finished
    req.status = RequestStatus.FINISHED_LENGTH
    assert req.is_finished and req.status.value == "length"  # the value is the finish reason


def test_requests_compare_by_identity():
    a, b = make("same"), make("same")
    assert a != b and [a, b].index(b) == 1
