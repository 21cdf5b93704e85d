"""The waiting queue (core/waiting.py) against a plain reference: per-group FIFOs, the fairest
head picked by (running sequences, arrival), requests that go back keeping their place."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from test_scheduler import make_request
from verispec.core.waiting import WaitingQueue

GROUPS = ("a", "b", "c", "d")


class Reference:
    """The same queue as lists, every pick by a full scan."""

    def __init__(self) -> None:
        self.groups: dict[str, list] = {}

    def append(self, req) -> None:
        self.groups.setdefault(req.group, []).append(req)

    def appendleft(self, req) -> None:
        self.groups.setdefault(req.group, []).insert(0, req)

    def remove(self, req) -> None:
        self.groups[req.group].remove(req)
        if not self.groups[req.group]:
            del self.groups[req.group]

    def pop_fairest(self, running: dict[str, int]):
        group = min(self.groups, key=lambda g: (running.get(g, 0), self.groups[g][0].arrival))
        req = self.groups[group].pop(0)
        if not self.groups[group]:
            del self.groups[group]
        return req

    def __len__(self) -> int:
        return sum(map(len, self.groups.values()))


ops = st.lists(st.tuples(st.sampled_from(["add", "pop", "back", "remove"]), st.sampled_from(GROUPS),
                         st.lists(st.integers(0, 3), min_size=len(GROUPS), max_size=len(GROUPS))), max_size=60)


@settings(max_examples=examples(200), deadline=None)
@given(ops)
def test_the_queue_picks_as_a_full_scan_would(steps):
    queue, ref, popped, n = WaitingQueue(), Reference(), [], 0
    for op, group, counts in steps:
        running = dict(zip(GROUPS, counts))
        if op == "add":
            req = make_request(f"r{n}", 2, group)
            n += 1
            queue.append(req)
            ref.append(req)
        elif op == "pop" and len(ref):
            got = queue.pop_fairest(running)
            assert got is ref.pop_fairest(running)
            popped.append(got)
        elif op == "back" and popped:  # a preempted request returns first in its group, its arrival kept
            req = popped.pop()
            queue.appendleft(req)
            ref.appendleft(req)
        elif op == "remove" and len(ref):
            req = next(iter(queue))
            queue.remove(req)
            ref.remove(req)
        assert len(queue) == len(ref) and bool(queue) == bool(len(ref))
        assert queue.num_groups == len(ref.groups)
        assert all(r in queue for g in ref.groups.values() for r in g)


def test_one_group_is_a_plain_deque_and_misuse_is_refused():
    queue = WaitingQueue()
    reqs = [make_request(f"r{i}", 2, "g") for i in range(3)]
    for r in reqs:
        queue.append(r)
    queue.extendleft([queue.popleft(), queue.popleft()])  # as deque.extendleft: the last given first
    assert list(queue) == [reqs[1], reqs[0], reqs[2]]
    with pytest.raises(ValueError, match="not waiting"):
        queue.remove(make_request("x", 2, "g"))
    while queue:
        queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()
