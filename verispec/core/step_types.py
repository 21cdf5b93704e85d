"""One step's inputs and outputs: what the scheduler decided, and what the runner computed.

The scheduler builds a `SchedulerOutput` (which requests run, how many known tokens each feeds,
which drafts each verifies, and the adaptive plan for the device) and never changes it after
`schedule` returns. The runner reads it and returns a `StepResult`: one `RequestResult` per
request that produced something. The engine hands the result to the output processor (tokens,
logprobs, stops) and then back to the scheduler (cache progress, rollback, finishing).

This module imports no engine component, so the scheduler, the runner and the engine all import
it and nothing imports back.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verispec.core.request import Request
    from verispec.outputs import LogprobsLists


@dataclass(frozen=True, slots=True)
class Drafts:
    """A request's drafts: values, or PLACEHOLDERs (spec_decode/metadata.py) that a model drafter
    fills inside the step; and a host drafter's extras (suffix decoding): per draft, q as (token
    ids, probabilities) for a random request's rejection rule, and the confidence adaptive
    verification ranks the slot by."""

    token_ids: tuple[int, ...] = ()
    q: "tuple[tuple[list[int], list[float]], ...] | None" = None
    confidence: "tuple[float, ...] | None" = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def head(self, n: int) -> "Drafts":
        """The first n drafts (verification is always of a prefix)."""
        if n >= len(self.token_ids):
            return self
        return Drafts(self.token_ids[:n], None if self.q is None else self.q[:n],
                      None if self.confidence is None else self.confidence[:n])


NO_DRAFTS = Drafts()


@dataclass(frozen=True, slots=True)
class AdaptivePlan:
    """Adaptive verification with a model drafter: how many drafts the device admits, and the
    calibration it scores the slots with (spec_decode/adaptive.py)."""

    budget: int
    # [greedy/random][q-peak bucket] acceptance rates, a copy taken when the step was planned.
    calibration: tuple[tuple[float, ...], ...]


@dataclass(slots=True)
class ScheduledRequest:
    request: "Request"
    num_new_tokens: int  # known tokens fed to the model this step (chunk, or 1 decode token)
    # True when this step reaches the end of the request's known tokens: its last row is sampled.
    samples: bool
    # Drafts fed after the known ones, to be verified in this same forward, as the draft policy
    # decided them (every one of them runs through the forward).
    drafts: Drafts = NO_DRAFTS
    # (first position, rows): prompt logprobs of the positions a prefix hit skipped, from the cache.
    cached_prompt_rows: "tuple[int, LogprobsLists] | None" = None

    @property
    def draft_token_ids(self) -> tuple[int, ...]:
        return self.drafts.token_ids

    @property
    def num_scheduled_tokens(self) -> int:
        return self.num_new_tokens + len(self.drafts)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Adaptive verification with a model drafter. None: every scheduled draft is verified.
    plan: AdaptivePlan | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    def only(self, entry: ScheduledRequest) -> "SchedulerOutput":
        """The step cut down to one of its requests (crash isolation): the plan's budget capped at
        that request's drafts, so the device admits at most what it has."""
        plan = self.plan
        if plan is not None:
            plan = replace(plan, budget=min(plan.budget, len(entry.draft_token_ids)))
        return SchedulerOutput([entry], plan=plan)


@dataclass(slots=True)
class RequestResult:
    """What one step produced for one request, on the host."""

    sampled: list[int] = field(default_factory=list)  # emitted tokens: accepted drafts, then one more
    logprobs: "LogprobsLists | None" = None  # one row per emitted token, when the request asked
    # (first prompt position scored, rows predicting the following prompt tokens)
    prompt_logprobs: "tuple[int, LogprobsLists] | None" = None
    # Requests that carried drafts: how many were verified and accepted, and (adaptive
    # verification with a model drafter) q's peak at each draft.
    num_verified: int = 0
    num_accepted: int = 0
    draft_confidence: list[float] | None = None


@dataclass(slots=True)
class StepResult:
    """One step's results: a record per request id, and the host time a model drafter spent
    drafting inside the step (adaptive verification's cost model learns it)."""

    requests: dict[str, RequestResult] = field(default_factory=dict)
    draft_seconds: float = 0.0
    catch_up_seconds: float = 0.0  # of the drafting, a model drafter's catch-up after a pause

    def of(self, request_id: str) -> RequestResult:
        """The request's record, created empty on first use."""
        record = self.requests.get(request_id)
        if record is None:
            record = self.requests[request_id] = RequestResult()
        return record

    def get(self, request_id: str) -> RequestResult | None:
        return self.requests.get(request_id)

    def update(self, other: "StepResult") -> None:
        self.requests.update(other.requests)
