"""The draft policy: the one owner of how many drafts each request carries, step by step.

The scheduler owns it and asks it three things:
- `propose` after a step: for each running request that decodes, the room it has (never more
  drafts than `num_speculative_tokens`, nor than the request could still emit, nor any for a
  request that opted out), and, unless adaptive verification has learnt that drafts are being
  refused, the drafter's proposal within that room;
- `decide` while scheduling: of each request's proposal, the drafts that ride in the step: as many
  as the token budget the scheduler reserved for them, then the adaptive plan's share, then only
  if their KV blocks fit (drafts never preempt). The decision lands in the step's
  `ScheduledRequest.drafts` and `SchedulerOutput.plan`; nothing downstream trims them;
- `observe` for each request that verified drafts: the counters and the adaptive controller learn
  the outcome.

Every piece of drafting state (proposals, adaptive estimates, the drafter's own) is keyed by request
id and dropped when the scheduler says a request finished or was preempted.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from verispec.core.request import Request
from verispec.core.step_types import NO_DRAFTS, AdaptivePlan, Drafts, RequestResult, ScheduledRequest, SchedulerOutput
from verispec.spec_decode.adaptive import AdaptiveController
from verispec.spec_decode.drafter import Drafter
from verispec.spec_decode.metrics import SpecDecodeMetrics


# A host drafter whose proposals take more than this share of a step is asked less often while
# its drafts are refused.
SPACED_SHARE = 0.01


def draft_room(req: Request, k: int, max_model_len: int) -> int:
    """Drafts a decoding request may carry: never more than it could still emit."""
    if req.num_tokens - req.num_computed_tokens != 1 or not req.params.speculative:
        return 0  # still prefilling (nothing to speculate on yet), or the request opted out
    return max(0, min(req.max_tokens - req.num_output_tokens, max_model_len - req.num_tokens, k))


class DraftPolicy:
    def __init__(self, drafter: Drafter, num_speculative_tokens: int, max_model_len: int,
                 adaptive: AdaptiveController | None = None):
        self.drafter = drafter
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.adaptive = adaptive
        self.metrics = SpecDecodeMetrics(num_speculative_tokens)
        self._proposed: dict[str, Drafts] = {}
        self._propose_seconds = 0.0  # the last `propose`'s host time
        self._propose_share = 0.0  # proposals' share of a step's time (an average)

    # ------------------------------------------------------------------ after a step
    def propose(self, running: list[Request]) -> None:
        """The drafts each running request may carry next step."""
        self._propose_seconds = 0.0
        # A model drafter's proposals are placeholders, free until the plan keeps them. A host
        # drafter's cost its host time: spaced out while every draft is refused, where that time
        # is a noticeable share of the step (suffix decoding's trees: 0.5 ms of a 22 ms step at 16
        # rollouts). Prompt lookup's (0.03 ms of 13) are not: a refused draft, checked against the
        # token written, is its free outcome (AdaptiveController.check_shadow).
        if (self.adaptive is not None and not self.drafter.drafts_in_step and self._propose_share > SPACED_SHARE
                and not self.adaptive.should_draft()):
            return
        began = time.perf_counter()
        rooms = [draft_room(req, self.k, self.max_model_len) for req in running]
        for req, room in zip(running, rooms):
            if room:
                self._proposed.pop(req.request_id, None)
        self._proposed.update(self.drafter.propose(running, rooms))
        self._propose_seconds = time.perf_counter() - began

    def observe_cost(self, sched: SchedulerOutput, started: float, draft_seconds: float = 0.0,
                     catch_up_seconds: float = 0.0) -> None:
        """The step's measured cost (everything since `started`), for the adaptive budget's cost
        model: its tokens, its draft rows and its drafting requests, and of its time the drafting
        (a model drafter's `draft_seconds` in the step, a host drafter's proposal for the next
        one) apart, and of that a model drafter's catch-up after a pause (`catch_up_seconds`)."""
        if self.adaptive is not None:
            drafting = draft_seconds + self._propose_seconds
            seconds = time.perf_counter() - started
            if self._propose_seconds:
                self._propose_share += 0.2 * (self._propose_seconds / seconds - self._propose_share)
            num_drafts = sum(len(s.drafts) for s in sched.scheduled)
            num_drafting = sum(1 for s in sched.scheduled if s.drafts)
            self.adaptive.observe_step(sched.num_tokens, seconds, drafting, num_drafts,
                                       num_drafting, catch_up_seconds)

    # ------------------------------------------------------------------ while scheduling
    def num_proposed(self, req: Request) -> int:
        """How many drafts the request has on offer: the most the scheduler reserves budget for."""
        drafts = self._proposed.get(req.request_id)
        return len(drafts) if drafts is not None else 0

    def decide(self, scheduled: list[ScheduledRequest], reserved: list[int],
               allocate: Callable[[ScheduledRequest, int], bool]) -> tuple[list[Drafts], AdaptivePlan | None]:
        """Each entry's drafts for this step and the device's plan. `reserved`: the budget the
        scheduler reserved for each entry's drafts; `allocate(entry, n)`: gives the entry blocks
        for its known tokens plus n drafts, False when the pool has none (the drafts then wait).
        The proposals of scheduled requests are used up."""
        offered = [self._proposed.pop(s.request.request_id, NO_DRAFTS).head(r) for s, r in zip(scheduled, reserved)]
        plan = None
        if self.adaptive is not None:
            counts, plan = self.adaptive.plan(scheduled, offered)
            offered = [d.head(n) for d, n in zip(offered, counts)]
        kept = [d if d and allocate(s, len(d)) else NO_DRAFTS for s, d in zip(scheduled, offered)]
        if plan is not None:  # the device admits at most what is left
            plan = AdaptivePlan(min(plan.budget, sum(len(d) for d in kept)), plan.calibration)
        return kept, plan

    # ------------------------------------------------------------------ outcomes
    def observe(self, entry: ScheduledRequest, record: RequestResult) -> None:
        """A request's verified drafts: how many were verified, how many accepted."""
        verified, accepted = record.num_verified, record.num_accepted
        self.metrics.observe(verified, accepted)
        if self.adaptive is not None:
            # q peaks: a model drafter's come back with the step; a host drafter's are known.
            peaks = record.draft_confidence if record.draft_confidence is not None else entry.drafts.confidence
            self.adaptive.observe(entry.request, verified, accepted, None if peaks is None else list(peaks))

    def preempted(self, req: Request) -> None:
        self._proposed.pop(req.request_id, None)

    def finish(self, req: Request) -> None:
        self._proposed.pop(req.request_id, None)
        self.drafter.finish(req.request_id)
        if self.adaptive is not None:
            self.adaptive.finish(req.request_id)
