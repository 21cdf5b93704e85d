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
from typing import TYPE_CHECKING

from verispec.engine.kv_cache import BlockPool
from verispec.engine.prefix_cache import PrefixCache
from verispec.engine.step import ScheduledRequest, SchedulerOutput, StepResult
from verispec.engine.waiting import WaitingQueue
from verispec.request import Request, RequestStatus
from verispec.spec_decode.metrics import SpecDecodeMetrics

if TYPE_CHECKING:
    from verispec.spec_decode.adaptive import AdaptiveController


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 spec_metrics: SpecDecodeMetrics | None = None, adaptive: "AdaptiveController | None" = None,
                 prefix_cache: PrefixCache | None = None):
        self.pool = pool
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(pool, "", enabled=False)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.spec_metrics = spec_metrics if spec_metrics is not None else SpecDecodeMetrics(0)
        self.adaptive = adaptive  # decides each step's drafts, and learns from their outcome

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
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            # Drafts ride along only on a plain decode step, and only as far as the budget allows;
            # their tokens are charged here, their blocks come once the drafts are decided.
            spec = req.draft_token_ids[: budget - num_new] if num_new == 1 else []
            if not self._allocate_or_preempt(req, num_new, out):
                break  # req itself was preempted; everything after it already was
            entry = self._entry(req, num_new)
            entry.draft_token_ids = spec
            out.scheduled.append(entry)
            budget -= num_new + len(spec)
            i += 1
        if len(out.preempted) == num_fair:  # a short pool admits nobody new this step
            self._admit(out, budget, running)
        self._decide_drafts(out)
        return out

    def _decide_drafts(self, out: SchedulerOutput) -> None:
        """The step's one draft decision, on the scheduler's own entries: the adaptive plan trims
        the drafts to the ones worth verifying, with the whole step in view; then each kept draft
        gets its block. Drafts never preempt: a request whose drafts do not fit in the pool
        verifies none this step."""
        if self.adaptive is not None:
            out.plan = self.adaptive.plan(out.scheduled)
        for s in out.scheduled:
            req = s.request
            if s.draft_token_ids and not self.pool.allocate(req.request_id, req.num_computed_tokens + s.num_scheduled_tokens):
                s.draft_token_ids = []
        if out.plan is not None:  # the device admits at most what is left
            out.plan.budget = min(out.plan.budget, sum(len(s.draft_token_ids) for s in out.scheduled))

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
        req.clear_drafts()
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(self, sched: SchedulerOutput, result: StepResult, skip: set[str] = frozenset()) -> None:
        """Applies one step's progress to its requests (except those in `skip`), once the output
        processor has appended their tokens: the cache now holds the new tokens and the accepted
        drafts, and blocks that held only rejected drafts go back; the counters and the adaptive
        controller learn the drafts' outcome; filled blocks and scored prompt rows are cached;
        finished requests leave."""
        for s in sched.scheduled:
            req = s.request
            if req.request_id in skip:
                continue
            record = result.get(req.request_id)
            req.num_computed_tokens += s.num_new_tokens
            if s.draft_token_ids:
                verified, accepted = record.num_verified, record.num_accepted
                self.spec_metrics.observe(verified, accepted)
                if self.adaptive is not None:
                    # q peaks: a model drafter's come back with the step; a host drafter's are known.
                    peaks = record.draft_confidence if record.draft_confidence is not None else req.draft_confidence
                    self.adaptive.observe(req, verified, accepted, peaks)
                req.num_computed_tokens += accepted
                self.pool.truncate(req.request_id, req.num_computed_tokens)
            req.clear_drafts()
            # After the tokens: accepted drafts are computed, and now in token_ids too.
            self.prefix_cache.cache_computed(req)
            if record is not None and record.prompt_logprobs is not None:
                self.prefix_cache.cache_prompt_rows(req, *record.prompt_logprobs)
            if req.is_finished:
                self.finish(req)

    def finish(self, req: Request) -> None:
        """Removes a finished or aborted request and returns its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.pool.free(req.request_id)
