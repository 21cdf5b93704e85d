"""Continuous batching with chunked prefill and preemption by recompute.

There is no separate prefill or decode phase. Each step every running request asks for the
tokens it has not yet computed (the rest of its prompt, or its one new token), capped by the step's
token budget; waiting requests then fill what budget is left. When the pool runs short, the most
recently admitted running request is preempted: its blocks are freed and it goes back to the front
of the queue, to be recomputed from its prompt and the tokens it already produced. Sampling only
happens once a request's whole sequence is in the cache, so a preempted request resumes with
exactly the output it would have had.

With prefix caching a request is admitted with its longest cached prefix already computed (its
own blocks too, after a preemption), and each step caches the blocks its requests filled.

Admission is fair between groups (the client requests engine requests belong to, see waiting.py):
the next admitted is the head of the group with the fewest running sequences. When every slot is
taken and a waiting group runs nothing, the group holding the most gives up its latest admitted
sequence (a fair-share preemption), if it holds more than its share.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Protocol

from verispec.core.kv_cache import BlockPool
from verispec.core.prefix_cache import PrefixCache
from verispec.core.request import Request, RequestStatus
from verispec.core.step_types import AdaptivePlan, Drafts, RequestResult, ScheduledRequest, SchedulerOutput, StepResult
from verispec.core.waiting import WaitingQueue


class DraftDecider(Protocol):
    """What the scheduler asks of its draft policy (spec_decode/policy.py, `DraftPolicy`), the one
    owner of how many drafts each request carries."""

    def propose(self, running: list[Request]) -> None: ...

    def observe_cost(self, sched: SchedulerOutput, started: float, draft_seconds: float = 0.0,
                     catch_up_seconds: float = 0.0) -> None: ...

    def num_proposed(self, req: Request) -> int: ...

    def decide(self, scheduled: list[ScheduledRequest], reserved: list[int],
               allocate: Callable[[ScheduledRequest, int], bool]) -> tuple[list[Drafts], AdaptivePlan | None]: ...

    def observe(self, entry: ScheduledRequest, record: RequestResult) -> None: ...

    def preempted(self, req: Request) -> None: ...

    def finish(self, req: Request) -> None: ...


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 drafts: DraftDecider | None = None, prefix_cache: PrefixCache | None = None):
        self.pool = pool
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(pool, "", enabled=False)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.drafts = drafts  # decides each step's drafts and learns from their outcome; None: no speculation

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        running = Counter(r.group for r in self.running)  # running sequences per group
        self._preempt_for_starved(out, running)
        num_fair = len(out.preempted)
        budget = self.max_num_batched_tokens
        reserved = []  # budget for each entry's drafts, charged in the running order
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            # Drafts ride along only on a plain decode step, and only as far as the budget allows;
            # their tokens are charged here, and the draft policy decides them once the step is known.
            num_drafts = min(self.drafts.num_proposed(req), budget - num_new) if num_new == 1 and self.drafts else 0
            if not self._allocate_or_preempt(req, num_new, out):
                break  # req itself was preempted; everything after it already was
            out.scheduled.append(self._entry(req, num_new))
            reserved.append(num_drafts)
            budget -= num_new + num_drafts
            i += 1
        if len(out.preempted) == num_fair:  # a short pool admits nobody new this step
            self._admit(out, budget, running)
        if self.drafts is not None:
            self._decide_drafts(out, reserved + [0] * (len(out.scheduled) - len(reserved)))
        return out

    def _decide_drafts(self, out: SchedulerOutput, reserved: list[int]) -> None:
        """The draft policy's one decision on the step's entries, with the whole step in view."""
        def allocate(entry: ScheduledRequest, num_drafts: int) -> bool:
            req = entry.request
            return self.pool.allocate(req.request_id, req.num_computed_tokens + entry.num_new_tokens + num_drafts)

        drafts, out.plan = self.drafts.decide(out.scheduled, reserved, allocate)
        for s, d in zip(out.scheduled, drafts):  # the step's entries, still being built
            s.drafts = d

    def _preempt_for_starved(self, out: SchedulerOutput, running: Counter[str]) -> None:
        """Fair share: when every slot is taken, each waiting group that runs nothing gets one from
        the group holding the most (its latest admitted), while that group holds more than
        max_num_seqs // groups with work, and at least 2. One per starved group per step, and a
        victim's group still runs one, so it cannot thrash."""
        # O(running groups): the waiting groups are only counted, never listed.
        both = sum(1 for g in running if self.waiting.has_group(g))
        starved = self.waiting.num_groups - both
        short = starved - (self.max_num_seqs - len(self.running))
        if short <= 0 or not running:
            return
        share = self.max_num_seqs // (self.waiting.num_groups + len(running) - both)
        for _ in range(short):
            most = max(running.values())
            if most < 2 or most <= share:
                return
            victim = next(r for r in reversed(self.running) if running[r.group] == most)
            self.running.remove(victim)
            running[victim.group] -= 1
            self._preempt(victim)
            out.preempted.append(victim.request_id)

    def _admit(self, out: SchedulerOutput, budget: int, running: Counter[str]) -> None:
        """Admits waiting requests, fewest-running group first, while the budget, max_num_seqs and
        the pool allow."""
        held = []  # n > 1: siblings waiting for their leader's prompt to be cached, in queue order
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.pop_fairest(running)
            if self._waits_for_leader(req):
                held.append(req)
                continue
            hit = self.prefix_cache.find(req)
            num_new = min(req.num_tokens - hit.num_tokens, budget)
            self.pool.share(req.request_id, hit.blocks)
            if not self.pool.allocate(req.request_id, hit.num_tokens + num_new):
                self.pool.free(req.request_id)
                self.waiting.appendleft(req)
                break
            self.prefix_cache.admitted(req, hit)
            req.num_computed_tokens = hit.num_tokens  # what a preemption left is stale
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            running[req.group] += 1
            entry = self._entry(req, num_new)
            entry.cached_prompt_rows = hit.prompt_rows
            out.scheduled.append(entry)
            budget -= num_new
        self.waiting.extendleft(reversed(held))

    def _waits_for_leader(self, req: Request) -> bool:
        """A sibling (n > 1) is admitted once its leader has cached the shared prompt, to hit it
        rather than compute it again."""
        leader = req.prefill_leader
        return (self.prefix_cache.enabled and leader is not None and not leader.is_finished
                and leader.num_computed_tokens < leader.num_prompt_tokens)

    @staticmethod
    def _entry(req: Request, num_new: int) -> ScheduledRequest:
        return ScheduledRequest(req, num_new, req.num_computed_tokens + num_new == req.num_tokens)

    def _allocate_or_preempt(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.pool.allocate(req.request_id, req.num_computed_tokens + num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.pool.free(req.request_id)  # its cached blocks stay cached: it may hit them again
        if self.drafts is not None:
            self.drafts.preempted(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(self, sched: SchedulerOutput, result: StepResult, skip: set[str] = frozenset(),
                           started: float | None = None) -> None:
        """Applies one step's progress to its requests (except those in `skip`), once the output
        processor has appended their tokens: the cache now holds the new tokens and the accepted
        drafts, and blocks that held only rejected drafts go back; the draft policy learns the
        drafts' outcome; filled blocks and scored prompt rows are cached; finished requests leave.
        Then the draft policy proposes the next step's drafts and, given when the step `started`
        (None: a step that failed, not a measure), learns its cost."""
        for s in sched.scheduled:
            req = s.request
            if req.request_id in skip:
                continue
            record = result.get(req.request_id)
            req.num_computed_tokens += s.num_new_tokens
            if s.drafts:
                self.drafts.observe(s, record)
                req.num_computed_tokens += record.num_accepted
                self.pool.truncate(req.request_id, req.num_computed_tokens)
            for rows in (s.cached_prompt_rows, record.prompt_logprobs if record is not None else None):
                if rows is not None:  # prompt positions whose logprobs are done
                    req.num_prompt_logprob_rows = rows[0] + len(rows[1])
            # After the tokens: accepted drafts are computed, and now in token_ids too.
            self.prefix_cache.cache_computed(req)
            if record is not None and record.prompt_logprobs is not None:
                self.prefix_cache.cache_prompt_rows(req, *record.prompt_logprobs)
            if req.is_finished:
                self.finish(req)
        if self.drafts is not None:
            self.drafts.propose(self.running)
            if started is not None:
                self.drafts.observe_cost(sched, started, result.draft_seconds, result.catch_up_seconds)

    def finish(self, req: Request) -> None:
        """Removes a finished or aborted request, returns its blocks and tells the draft policy."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.pool.free(req.request_id)
        self.prefix_cache.finish(req.request_id)
        if self.drafts is not None:
            self.drafts.finish(req)
