"""The draft policy (spec_decode/policy.py): each request's room, the proposal within it, the one
decision of a step's drafts (reserved budget, adaptive plan, pool), and state dropped when a
request leaves."""

from __future__ import annotations

from test_drafter import decoding
from test_scheduler import BLOCK, drafting, offer, run_step
from verispec.config import SpeculativeConfig
from verispec.core.kv_cache import BlockPool
from verispec.core.step_types import Drafts, ScheduledRequest, SchedulerOutput
from verispec.spec_decode.adaptive import AdaptiveController
from verispec.spec_decode.cost import CostModel
from verispec.spec_decode.drafter import NgramDrafter
from verispec.spec_decode.policy import SPACED_SHARE, DraftPolicy, draft_room


def test_draft_room_is_what_the_request_can_still_emit():
    req = decoding("a", [1, 2, 3, 1, 2, 3], max_tokens=3)
    assert draft_room(req, 5, max_model_len=100) == 2  # 3 tokens at most, 1 already out
    assert draft_room(req, 5, max_model_len=9) == 2 and draft_room(req, 5, max_model_len=8) == 1
    req.num_computed_tokens = 3  # still prefilling: nothing to speculate on
    assert draft_room(req, 5, max_model_len=100) == 0


def ngram_policy(k: int = 3, adaptive=None, max_model_len: int = 100) -> DraftPolicy:
    return DraftPolicy(NgramDrafter(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1)), k,
                       max_model_len, adaptive)


def test_proposals_are_within_each_requests_room():
    policy = ngram_policy(k=3)
    near_end = decoding("e", [4, 5, 6, 7, 4, 5, 6, 7], pending=4, max_tokens=2)
    repeat = decoding("r", [4, 5, 6, 7, 4, 5, 6, 7], pending=4)
    prefill = decoding("p", [4, 5, 6, 7, 4, 5, 6, 7], pending=4)
    prefill.num_computed_tokens = 2
    policy.propose([near_end, repeat, prefill])
    assert [policy.num_proposed(r) for r in (near_end, repeat, prefill)] == [1, 3, 0]


def test_decide_takes_the_reserved_budget_then_the_pool():
    policy = ngram_policy(k=4)
    a, b = decoding("a", [1, 2]), decoding("b", [1, 2])
    for r, ids in ((a, (7, 8, 9)), (b, (5, 6))):
        policy._proposed[r.request_id] = Drafts(ids)
    entries = [ScheduledRequest(a, 1, True), ScheduledRequest(b, 1, True)]
    asked = []
    kept, plan = policy.decide(entries, [2, 2], lambda e, n: asked.append((e.request.request_id, n)) or e.request is a)
    assert [d.token_ids for d in kept] == [(7, 8), ()] and plan is None
    assert asked == [("a", 2), ("b", 2)]  # b's blocks do not fit: its drafts wait
    assert policy.num_proposed(a) == policy.num_proposed(b) == 0  # used up


def test_with_adaptive_verification_proposals_pause_while_drafts_are_refused():
    from verispec.spec_decode.adaptive import REFUSAL_STREAK

    adaptive = AdaptiveController(3, CostModel([1, 8], [1.0, 8.0]), exact_host_scores=True)
    policy = ngram_policy(k=3, adaptive=adaptive)
    repeat = decoding("r", [4, 5, 6, 7, 4, 5, 6, 7], pending=4)
    adaptive.refused = REFUSAL_STREAK  # every other step would propose
    proposed = []
    for _ in range(4):
        policy._proposed.clear()
        policy.propose([repeat])
        proposed.append(policy.num_proposed(repeat))
    assert proposed == [3, 3, 3, 3]  # proposals that cost nothing are never spaced
    policy._propose_share = 2 * SPACED_SHARE  # proposals that take a share of the step are
    proposed = []
    for _ in range(4):
        policy._proposed.clear()
        policy.propose([repeat])
        proposed.append(policy.num_proposed(repeat))
    assert proposed == [0, 3, 0, 3]


def test_a_finished_request_leaves_no_state_behind():
    adaptive = AdaptiveController(3, CostModel([1, 8], [1.0, 8.0]), exact_host_scores=True)
    sched = drafting(BlockPool(64, BLOCK), max_num_seqs=8, max_num_batched_tokens=100, adaptive=adaptive, k=3)
    from test_scheduler import finish, make_request

    a = make_request("a", 6)
    sched.add(a)
    run_step(sched)
    offer(sched, a, [1, 2])
    adaptive.history("a")
    finish(sched, a)
    assert sched.drafts.num_proposed(a) == 0 and adaptive._history == {}


def test_the_step_cost_is_learnt_with_its_drafting_apart():
    """The drafting a step paid (a host drafter's proposal, a model drafter's time inside the
    step) goes to the cost model's `drafting`, the rest to its overhead."""
    import time

    class Slow(NgramDrafter):
        def propose(self, running, rooms):
            time.sleep(0.02)
            return super().propose(running, rooms)

    adaptive = AdaptiveController(3, CostModel([1, 8], [0.001, 0.002], learn=True), exact_host_scores=True)
    policy = DraftPolicy(Slow(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)), 3, 100, adaptive)
    started = time.perf_counter()
    req = decoding("r", [4, 5, 6, 7, 4, 5, 6, 7], pending=4)
    policy.propose([req])
    step = SchedulerOutput([ScheduledRequest(req, 1, True, drafts=Drafts((4, 5)))])
    policy.observe_cost(step, started, draft_seconds=0.01)
    assert 0.03 <= adaptive.cost.drafting < 0.05  # the 20 ms proposal and the 10 ms in the step
    assert 0.03 <= float(adaptive.cost.drafting_costs([1])[0]) < 0.05  # learnt for one drafting request
    assert adaptive.cost.overhead < 0.005
    assert adaptive.probe_credit.credit > 0  # the step earned its probes' share
