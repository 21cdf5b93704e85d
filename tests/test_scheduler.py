"""The scheduler on its own: token budget, chunked prefill, admission cap, drafts, preemption."""

from __future__ import annotations

from verispec import SamplingParams
from verispec.config import LogprobsMode
from verispec.engine.kv_cache import BlockPool
from verispec.engine.request import Request, RequestStatus
from verispec.engine.scheduler import Scheduler
from verispec.sample.noise import RequestNoise

BLOCK = 4


def make_request(rid: str, prompt_len: int) -> Request:
    return Request(request_id=rid, prompt=None, prompt_token_ids=list(range(3, 3 + prompt_len)),
                   params=SamplingParams(), logprobs_mode=LogprobsMode.RAW_LOGPROBS, noise=RequestNoise(0),
                   stop_ids=frozenset(), max_tokens=100)


def run_step(sched: Scheduler) -> dict[str, tuple[int, bool, list[int]]]:
    """Schedules one step and applies it as the engine would (computed tokens advance; a sampled
    request gets one new token). Returns rid -> (new tokens, samples, drafts)."""
    out = sched.schedule()
    for s in out.scheduled:
        s.request.num_computed_tokens += s.num_new_tokens
        if s.samples:
            s.request.token_ids.append(1)
    return {s.request.request_id: (s.num_new_tokens, s.samples, s.draft_token_ids) for s in out.scheduled}


def test_chunked_prefill_within_the_budget_running_first():
    sched = Scheduler(BlockPool(64, BLOCK), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = make_request("a", 25), make_request("b", 3)
    sched.add(a)
    sched.add(b)
    assert run_step(sched) == {"a": (10, False, [])}  # a takes the whole budget
    assert run_step(sched) == {"a": (10, False, [])}
    assert run_step(sched) == {"a": (5, True, []), "b": (3, True, [])}  # a's last chunk samples; b fills up
    assert run_step(sched) == {"a": (1, True, []), "b": (1, True, [])}  # decode: one token each


def test_admission_stops_at_max_num_seqs():
    sched = Scheduler(BlockPool(64, BLOCK), max_num_seqs=2, max_num_batched_tokens=100)
    for rid in "abc":
        sched.add(make_request(rid, 2))
    assert set(run_step(sched)) == {"a", "b"}
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_drafts_ride_on_decode_steps_only_and_within_the_budget():
    sched = Scheduler(BlockPool(64, BLOCK), max_num_seqs=8, max_num_batched_tokens=4)
    a = make_request("a", 6)
    a.draft_token_ids = [9, 9, 9]
    sched.add(a)
    assert run_step(sched)["a"] == (4, False, [])  # prefill: no drafts
    assert run_step(sched)["a"] == (2, True, [])
    a.draft_token_ids = [7, 8, 9, 10, 11]
    assert run_step(sched)["a"] == (1, True, [7, 8, 9])  # 1 + 3 drafts fill the budget of 4


def test_a_short_pool_preempts_the_latest_admitted_and_admits_nobody():
    pool = BlockPool(5, BLOCK)  # 20 token slots
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=100)
    a, b, c = make_request("a", 8), make_request("b", 8), make_request("c", 2)
    for r in (a, b):
        sched.add(r)
    run_step(sched)  # a and b prefill 8 tokens (2 blocks each) and sample their 9th
    sched.add(c)
    # a takes the last free block for its 9th token; b then needs one too: b, the later admitted,
    # is preempted, and c is not admitted in a step that preempted.
    out = sched.schedule()
    assert out.preempted == ["b"] and [s.request.request_id for s in out.scheduled] == ["a"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # b goes first when room comes back
    assert pool.table("b") == [] and sched.num_preemptions == 1
    sched.finish(a)
    assert pool.num_free_blocks == pool.num_blocks


def test_update_from_output_keeps_the_accepted_drafts_and_gives_back_the_rest():
    from verispec.engine.output_processor import OutputProcessor
    from verispec.engine.runner import StepResult
    from verispec.spec_decode.metrics import SpecDecodeMetrics

    pool = BlockPool(16, BLOCK)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=100, spec_metrics=SpecDecodeMetrics(3))
    output = OutputProcessor(None, max_model_len=1000)
    a = make_request("a", 6)
    sched.add(a)
    step = sched.schedule()
    assert sched.update_from_output(step, StepResult(sampled={"a": [50]}), output) == [a]
    assert a.num_computed_tokens == 6 and a.output_token_ids == [50]
    a.draft_token_ids = [60, 61, 62]
    step = sched.schedule()  # 1 new token + 3 drafts: 10 tokens, 3 blocks
    assert len(pool.table("a")) == 3
    result = StepResult(sampled={"a": [60, 70]}, num_verified={"a": 3}, num_accepted={"a": 1})
    sched.update_from_output(step, result, output)
    # The cache keeps 6 + 1 + the accepted draft; the block that held only rejected drafts goes back.
    assert a.num_computed_tokens == 8 and len(pool.table("a")) == 2
    assert a.output_token_ids == [50, 60, 70] and a.draft_token_ids == []
    assert sched.spec_metrics.as_dict()["accepted_per_position"] == [1, 0, 0]
    assert (sched.spec_metrics.num_drafts, sched.spec_metrics.num_draft_tokens) == (1, 3)
    skipped = sched.schedule()
    assert sched.update_from_output(skipped, StepResult(sampled={"a": [80]}), output, skip={"a"}) == []
    assert a.output_token_ids == [50, 60, 70]  # a skipped request takes nothing from the step
