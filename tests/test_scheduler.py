"""The scheduler on its own: token budget, chunked prefill, admission cap, drafts, preemption, and
fairness between groups (the client requests engine requests belong to)."""

from __future__ import annotations

from verispec import SamplingParams
from verispec.config import LogprobsMode, SpeculativeConfig
from verispec.core.kv_cache import BlockPool
from verispec.core.request import Request, RequestStatus
from verispec.core.scheduler import Scheduler
from verispec.core.step_types import Drafts, RequestResult, SchedulerOutput, StepResult
from verispec.sample.noise import RequestNoise
from verispec.spec_decode.drafter import NgramDrafter
from verispec.spec_decode.policy import DraftPolicy

BLOCK = 4


def drafting(pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int, adaptive=None, k: int = 5) -> Scheduler:
    """A scheduler with a draft policy whose proposals the test sets (`offer`)."""
    policy = DraftPolicy(NgramDrafter(SpeculativeConfig(num_speculative_tokens=k)), k, 1000, adaptive)
    return Scheduler(pool, max_num_seqs, max_num_batched_tokens, policy)


def offer(sched: Scheduler, req: Request, ids: list[int]) -> None:
    """The drafts the request has on offer for the next step, as a drafter would have proposed."""
    sched.drafts._proposed[req.request_id] = Drafts(tuple(ids))


def make_request(rid: str, prompt_len: int, group: str | None = None) -> Request:
    return Request(request_id=rid, prompt=None, prompt_token_ids=list(range(3, 3 + prompt_len)),
                   params=SamplingParams(), logprobs_mode=LogprobsMode.RAW_LOGPROBS, noise=RequestNoise(0),
                   stop_ids=frozenset(), max_tokens=100, group=group or "")


def run_step(sched: Scheduler) -> dict[str, tuple[int, bool, list[int]]]:
    """Schedules one step and applies it as the engine would (computed tokens advance; a sampled
    request gets one new token). Returns rid -> (new tokens, samples, drafts)."""
    return scheduled(apply(sched.schedule()))


def apply(out: SchedulerOutput) -> SchedulerOutput:
    for s in out.scheduled:
        s.request.num_computed_tokens += s.num_new_tokens
        if s.samples:
            s.request.token_ids.append(1)
    return out


def scheduled(out: SchedulerOutput) -> dict[str, tuple[int, bool, list[int]]]:
    """rid -> (new tokens, samples, drafts), in the order the step scheduled them."""
    return {s.request.request_id: (s.num_new_tokens, s.samples, list(s.draft_token_ids)) for s in out.scheduled}


def finish(sched: Scheduler, req: Request) -> None:
    req.status = RequestStatus.FINISHED_STOPPED
    sched.finish(req)


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
    sched = drafting(BlockPool(64, BLOCK), max_num_seqs=8, max_num_batched_tokens=4)
    a = make_request("a", 6)
    offer(sched, a, [9, 9, 9])
    sched.add(a)
    assert run_step(sched)["a"] == (4, False, [])  # prefill: no drafts
    assert run_step(sched)["a"] == (2, True, [])
    offer(sched, a, [7, 8, 9, 10, 11])
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
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # b goes first when room comes back
    assert pool.table("b") == [] and sched.num_preemptions == 1
    sched.finish(a)
    assert pool.num_free_blocks == pool.num_blocks


def test_drafts_never_preempt_a_request_that_fits_without_them():
    pool = BlockPool(6, BLOCK)  # 24 token slots
    sched = drafting(pool, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_request("a", 8), make_request("b", 8)
    for r in (a, b):
        sched.add(r)
    run_step(sched)  # 2 blocks each; their 9th tokens take the last two free blocks
    offer(sched, a, [5, 6, 7, 8])  # 9 + 4 tokens: a fourth block, which only b's could give
    out = sched.schedule()
    assert out.preempted == [] and scheduled(out) == {"a": (1, True, []), "b": (1, True, [])}
    assert pool.num_free_blocks == 0 and len(pool.table("a")) == len(pool.table("b")) == 3
    # With room, the same drafts get their blocks in the same schedule.
    sched.finish(b)
    apply(out)
    offer(sched, a, [5, 6, 7, 8])
    assert scheduled(sched.schedule())["a"] == (1, True, [5, 6, 7, 8]) and len(pool.table("a")) == 4


def step_result(rid: str, **fields) -> StepResult:
    return StepResult({rid: RequestResult(**fields)})


def test_update_from_output_keeps_the_accepted_drafts_and_gives_back_the_rest():
    from verispec.engine.output_processor import OutputProcessor

    pool = BlockPool(16, BLOCK)
    sched = drafting(pool, max_num_seqs=8, max_num_batched_tokens=100, k=3)
    output = OutputProcessor(None, max_model_len=1000)
    a = make_request("a", 6)
    output.add(a)
    sched.add(a)

    def step_through(step, result, skip=frozenset()):  # the engine order: output first, then the scheduler
        emitted = output.process_step(step, result, skip)
        sched.update_from_output(step, result, skip)
        return emitted

    step = sched.schedule()
    assert step_through(step, step_result("a", sampled=[50])) == [a]
    assert a.num_computed_tokens == 6 and a.output_token_ids == [50]
    offer(sched, a, [60, 61, 62])
    step = sched.schedule()  # 1 new token + 3 drafts: 10 tokens, 3 blocks
    assert len(pool.table("a")) == 3
    step_through(step, step_result("a", sampled=[60, 70], num_verified=3, num_accepted=1))
    # The cache keeps 6 + 1 + the accepted draft; the block that held only rejected drafts goes back.
    assert a.num_computed_tokens == 8 and len(pool.table("a")) == 2
    assert a.output_token_ids == [50, 60, 70]
    metrics = sched.drafts.metrics
    assert metrics.accepted_per_position == [1, 0, 0] and (metrics.num_drafts, metrics.num_draft_tokens) == (1, 3)
    skipped = sched.schedule()
    assert step_through(skipped, step_result("a", sampled=[80]), skip={"a"}) == []
    assert a.output_token_ids == [50, 60, 70]  # a skipped request takes nothing from the step


def test_the_adaptive_plan_is_made_in_schedule_and_decides_the_steps_drafts():
    """The one draft decision of a step: made once, while scheduling, before the runner sees it."""
    from verispec.spec_decode.adaptive import AdaptiveController
    from verispec.spec_decode.cost import CostModel

    pool = BlockPool(64, BLOCK)
    # A cost table where a verify row costs as much as a token it may save: a draft at a
    # confidence below 1 never pays, so the plan keeps none of them.
    adaptive = AdaptiveController(3, CostModel([1, 8], [1.0, 8.0]), exact_host_scores=True)
    sched = drafting(pool, max_num_seqs=8, max_num_batched_tokens=100, adaptive=adaptive, k=3)
    a = make_request("a", 6)
    sched.add(a)
    sched.update_from_output(sched.schedule(), StepResult())
    a.token_ids.append(50)
    offer(sched, a, [60, 61, 62])
    step = sched.schedule()
    assert step.plan is None  # prompt lookup: the trim is the admission, nothing for the device
    assert step.scheduled[0].draft_token_ids == ()
    assert step.num_tokens == 1 and adaptive.stats.num_steps == 1
    assert sched.drafts.num_proposed(a) == 0  # a scheduled request's proposal is used up


def test_the_draft_policy_hears_of_every_request_that_leaves():
    sched = drafting(BlockPool(64, BLOCK), max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_request("a", 6), make_request("b", 6)
    for r in (a, b):
        sched.add(r)
    run_step(sched)
    offer(sched, a, [1, 2])
    offer(sched, b, [3])
    finish(sched, a)
    sched._preempt(sched.running.pop())  # b
    assert sched.drafts.num_proposed(a) == sched.drafts.num_proposed(b) == 0


# ------------------------------------------------------------------ fairness between groups
def add_group(sched: Scheduler, group: str, n: int, prompt_len: int = 2) -> list[Request]:
    reqs = [make_request(f"{group}-{i}", prompt_len, group) for i in range(n)]
    for r in reqs:
        sched.add(r)
    return reqs


def test_a_later_group_takes_the_first_free_room_before_the_rest_of_an_earlier_one():
    # Room by the token budget: each 10-token prompt of "big" fills a step's budget alone.
    sched = Scheduler(BlockPool(256, BLOCK), max_num_seqs=8, max_num_batched_tokens=10)
    add_group(sched, "big", 20, prompt_len=10)
    assert list(run_step(sched)) == ["big-0"]
    add_group(sched, "small", 1)
    # big-0 decodes; of the 9 tokens left, small (no running sequence) goes before big-1.
    # FIFO would give all 9 to big-1 and leave small behind the other 19.
    assert run_step(sched) == {"big-0": (1, True, []), "small-0": (2, True, []), "big-1": (7, False, [])}
    assert [r.request_id for r in sched.waiting] == [f"big-{i}" for i in range(2, 20)]

    # Room by max_num_seqs: a slot frees as the newcomer arrives; it gets it, not big-4.
    sched = Scheduler(BlockPool(256, BLOCK), max_num_seqs=4, max_num_batched_tokens=100)
    big = add_group(sched, "big", 20)
    assert list(run_step(sched)) == ["big-0", "big-1", "big-2", "big-3"]
    add_group(sched, "small", 1)
    finish(sched, big[0])
    out = apply(sched.schedule())
    assert list(scheduled(out)) == ["big-1", "big-2", "big-3", "small-0"] and out.preempted == []
    assert [r.request_id for r in sched.waiting] == [f"big-{i}" for i in range(4, 20)]


def test_a_starved_group_gets_a_slot_by_preempting_the_big_groups_latest():
    sched = Scheduler(BlockPool(64, BLOCK), max_num_seqs=4, max_num_batched_tokens=100)
    big = add_group(sched, "big", 6, prompt_len=3)
    assert list(run_step(sched)) == ["big-0", "big-1", "big-2", "big-3"]
    run_step(sched)  # all four decode
    (new,) = add_group(sched, "new", 1)
    out = apply(sched.schedule())
    # big holds 4 slots, more than its share (4 // 2 groups): its latest admitted makes room.
    assert out.preempted == ["big-3"] and list(scheduled(out)) == ["big-0", "big-1", "big-2", "new-0"]
    victim = big[3]
    assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert sched.num_preemptions == 1
    assert sched.pool.table("big-3") == []
    assert [r.request_id for r in sched.waiting] == ["big-3", "big-4", "big-5"]  # back first in its group
    # Two each now: no more preemptions while the share holds.
    assert apply(sched.schedule()).preempted == []
    finish(sched, new)
    step = run_step(sched)
    assert step["big-3"] == (5, True, [])  # recomputes its prompt and the 2 tokens it had
    assert victim.status == RequestStatus.RUNNING and sched.num_preemptions == 1


def test_equal_groups_alternate_admission():
    sched = Scheduler(BlockPool(64, BLOCK), max_num_seqs=8, max_num_batched_tokens=100)
    add_group(sched, "a", 4)
    add_group(sched, "b", 4)
    assert list(run_step(sched)) == ["a-0", "b-0", "a-1", "b-1", "a-2", "b-2", "a-3", "b-3"]

    sched = Scheduler(BlockPool(64, BLOCK), max_num_seqs=2, max_num_batched_tokens=100)
    a, b = add_group(sched, "a", 3), add_group(sched, "b", 3)
    assert list(run_step(sched)) == ["a-0", "b-0"]
    for i in (1, 2):  # each finishing pair lets the next of each group in
        finish(sched, a[i - 1])
        finish(sched, b[i - 1])
        assert list(run_step(sched)) == [f"a-{i}", f"b-{i}"]


def test_a_single_group_stays_fifo_and_a_preempted_request_goes_back_first():
    pool = BlockPool(5, BLOCK)  # 20 token slots
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_request("a", 8, "g"), make_request("b", 8, "g")
    c, d = make_request("c", 2, "g"), make_request("d", 2, "g")
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.add(c)
    sched.add(d)
    out = apply(sched.schedule())  # as test_a_short_pool_...: b is preempted for a's next block
    assert out.preempted == ["b"] and list(scheduled(out)) == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b", "c", "d"]
    assert (b.arrival, c.arrival) == (1, 2)  # b keeps its place from its first arrival
    finish(sched, a)
    assert list(run_step(sched)) == ["b", "c", "d"]
    assert [r.group for r in sched.running] == ["g", "g", "g"]


def test_no_preemption_while_each_group_holds_its_share():
    sched = Scheduler(BlockPool(64, BLOCK), max_num_seqs=4, max_num_batched_tokens=100)
    add_group(sched, "a", 4)
    add_group(sched, "b", 2)
    assert list(run_step(sched)) == ["a-0", "b-0", "a-1", "b-1"]  # two each: FIFO would run a-0..a-3
    for _ in range(3):  # a still waits for more, but holds its share (4 // 2) and is not starved
        out = apply(sched.schedule())
        assert out.preempted == [] and len(out.scheduled) == 4
    assert [r.request_id for r in sched.waiting] == ["a-2", "a-3"]
    # Single sequences are never preempted for fairness: a newcomer waits for a free slot.
    sched = Scheduler(BlockPool(64, BLOCK), max_num_seqs=2, max_num_batched_tokens=100)
    x, y, z = make_request("x", 2), make_request("y", 2), make_request("z", 2, "late")
    for r in (x, y, z):
        sched.add(r)
    run_step(sched)
    assert apply(sched.schedule()).preempted == [] and z.group == "late" and x.group == "x"
    assert sched.num_preemptions == 0
