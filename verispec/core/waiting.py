"""The scheduler's waiting queue: one FIFO per group, picked fairly between groups.

A group is the client request an engine request belongs to (`Request.group`): the 3,000 prompts of
one HTTP request are one group, and a later 2-token request is another. Admission takes the head of
the group with the fewest running sequences, the earliest arrival breaking ties, so a newcomer does
not wait behind every prompt queued before it.

A pick never looks at every waiting request, nor at every waiting group: the groups' heads sit in
a heap by arrival, and only the groups that already run something (at most max_num_seqs) are set
aside on the way to the earliest group that runs nothing. So a pick costs O(R log G) for R running
groups and G waiting ones; a thousand one-prompt groups (the default: a request is its own group)
cost no more than one group of a thousand.

It keeps the deque interface the engine and tests use (len, truth, `in`, iteration, append,
appendleft, extendleft, popleft, remove); with a single group it behaves exactly as one deque.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator, Mapping

from verispec.core.request import Request


class WaitingQueue:
    def __init__(self) -> None:
        # Only groups with waiting requests are keys.
        self._groups: dict[str, deque[Request]] = {}
        # (arrival of a group's head, group): an entry is stale once that request is no longer the
        # group's head; stale ones are dropped when they surface (or all at once, see _push).
        self._heads: list[tuple[int, str]] = []
        self._members: set[Request] = set()  # O(1) `in`; Requests hash by identity
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._members)

    def __bool__(self) -> bool:
        return bool(self._members)

    def __contains__(self, req: object) -> bool:
        return req in self._members

    def __iter__(self) -> Iterator[Request]:
        """In the order ties would admit them: the groups merged by their heads' arrival."""
        if len(self._groups) == 1:
            return iter(next(iter(self._groups.values())))
        return heapq.merge(*self._groups.values(), key=lambda r: r.arrival)

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def has_group(self, group: str) -> bool:
        return group in self._groups

    def append(self, req: Request) -> None:
        """A new request joins the back of its group."""
        self._stamp(req)
        q = self._groups.setdefault(req.group, deque())
        q.append(req)
        if len(q) == 1:
            self._push(req)
        self._members.add(req)

    def appendleft(self, req: Request) -> None:
        """A request that goes back (preempted, or not admitted after all) is its group's next."""
        self._stamp(req)
        self._groups.setdefault(req.group, deque()).appendleft(req)
        self._push(req)
        self._members.add(req)

    def extendleft(self, reqs: Iterable[Request]) -> None:
        for req in reqs:  # as deque.extendleft: the last one given ends up first
            self.appendleft(req)

    def popleft(self) -> Request:
        """The earliest-arrived group head (the fair pick when no group is running)."""
        return self.pop_fairest({})

    def pop_fairest(self, running: Mapping[str, int]) -> Request:
        """Removes and returns the head of the group with the fewest `running` sequences; ties go
        to the head that arrived first."""
        if not self._groups:
            raise IndexError("pop from an empty WaitingQueue")
        group = self._earliest_idle(running)
        if group is None:  # every waiting group runs something: only those R groups to compare
            group = min((g for g in running if g in self._groups),
                        key=lambda g: (running[g], self._groups[g][0].arrival))
        req = self._groups[group].popleft()
        self._left(req, was_head=True)
        return req

    def remove(self, req: Request) -> None:
        if req not in self._members:
            raise ValueError("request is not waiting")
        q = self._groups[req.group]
        was_head = q[0] is req
        q.remove(req)
        self._left(req, was_head)

    def _earliest_idle(self, running: Mapping[str, int]) -> str | None:
        """The group whose head arrived first among the groups running nothing, if any."""
        aside, found = [], None
        while self._heads:
            arrival, group = self._heads[0]
            q = self._groups.get(group)
            if q is None or q[0].arrival != arrival:
                heapq.heappop(self._heads)  # stale
            elif running.get(group, 0):
                aside.append(heapq.heappop(self._heads))
            else:
                found = group
                break
        for entry in aside:
            heapq.heappush(self._heads, entry)
        return found

    def _left(self, req: Request, was_head: bool) -> None:
        """`req` has left its group: drop an empty group, or put the group's new head on the heap."""
        q = self._groups[req.group]
        if not q:
            del self._groups[req.group]
        elif was_head:
            self._push(q[0])
        self._members.discard(req)

    def _push(self, head: Request) -> None:
        if len(self._heads) > 2 * len(self._groups) + 64:  # mostly stale: rebuild from the heads
            self._heads = [(q[0].arrival, g) for g, q in self._groups.items()]
            heapq.heapify(self._heads)
        heapq.heappush(self._heads, (head.arrival, head.group))

    def _stamp(self, req: Request) -> None:
        if req.arrival < 0:  # first time queued; a request that comes back keeps its place
            req.arrival = next(self._arrivals)
