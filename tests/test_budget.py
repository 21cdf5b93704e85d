"""Adaptive verification's budget: the tokens/sec objective for requests alone (every budget at
once, as one at a time), and what drafts are worth to a group of samples: the expected minimum of
its laggards' acceptances (against enumeration), a row for a member ahead, a request alone as
before; and the plan that follows from it."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from adaptive_entries import entry, plan_counts_of, uniform_history
from verispec.spec_decode.adaptive import AdaptiveController
from verispec.spec_decode.admission import admission_order
from verispec.spec_decode.cost import CostModel
from verispec.spec_decode.budget import Groups, best_prefix, completion_gains


# ------------------------------------------------------------------------------ requests alone
def choose_budget(scores: list[float], num_emitting: int, base: int, cost: CostModel) -> int:
    """The budget of requests alone: each slot gains its score, best first."""
    return best_prefix(sorted(scores, reverse=True), num_emitting, base, cost)


def objective(scores, b, num_emitting, base, cost) -> float:
    return (num_emitting + sum(sorted(scores, reverse=True)[:b])) / cost(base + b)


def test_choose_budget_on_a_hand_made_table():
    cost = CostModel([1, 2, 3, 4, 5], [1.0, 1.1, 1.2, 3.0, 3.1])
    # 1 emitting request: B=0 -> 1/1.0, B=1 -> 1.9/1.1 = 1.73, B=2 -> 2.7/1.2 = 2.25,
    # B=3 -> 3.2/3.0 = 1.07, B=4 -> 3.3/3.1 = 1.06: the third token makes the step 2.5x dearer.
    assert choose_budget([0.5, 0.9, 0.1, 0.8], 1, 1, cost) == 2
    # Nothing worth verifying: worthless drafts still cost a little.
    assert choose_budget([0.0, 0.0], 4, 4, CostModel([1, 100], [1.0, 2.0])) == 0
    # A free forward: verify every draft with any chance.
    assert choose_budget([0.3, 0.2, 0.1], 1, 1, CostModel([1, 100], [1.0, 1.0])) == 3


@settings(max_examples=examples(200), deadline=None)
@given(
    scores=st.lists(st.floats(0, 1), max_size=12),
    num_emitting=st.integers(1, 6),
    base=st.integers(1, 20),
    costs=st.lists(st.floats(0.01, 10), min_size=2, max_size=6),
)
def test_choose_budget_maximises_the_objective(scores, num_emitting, base, costs):
    cost = CostModel([1 + 7 * i for i in range(len(costs))], costs)
    b = choose_budget(scores, num_emitting, base, cost)
    best = max(objective(scores, x, num_emitting, base, cost) for x in range(len(scores) + 1))
    assert 0 <= b <= len(scores)
    assert objective(scores, b, num_emitting, base, cost) >= best * (1 - 1e-9)


def budget_by_budget(scores, num_emitting, base, cost) -> int:
    """choose_budget's rule with one cost lookup per budget: the reference for the vectorized one."""
    best_b, best, gain = 0, num_emitting / cost(base), float(num_emitting)
    for b, s in enumerate(sorted(scores, reverse=True), start=1):
        gain += s
        if gain / cost(base + b) > best * (1 + 1e-12):
            best_b, best = b, gain / cost(base + b)
    return best_b


@settings(max_examples=examples(200), deadline=None)
@given(
    scores=st.lists(st.sampled_from([0.0, 0.25, 0.5, 0.8, 1.0]) | st.floats(0, 1), max_size=40),
    num_emitting=st.integers(1, 32),
    base=st.integers(1, 40),
    costs=st.lists(st.floats(0.001, 10), min_size=1, max_size=6),
    overhead=st.floats(-0.0005, 0.01),
)
def test_all_budgets_at_once_choose_as_one_at_a_time(scores, num_emitting, base, costs, overhead):
    """The costs of every budget in one array are the scalar costs to the bit (interpolated and
    extrapolated past the table, plus the learnt overhead), so the choice is the same, ties too."""
    cost = CostModel([1 + 5 * i for i in range(len(costs))], costs, overhead=overhead)
    ns = list(range(1, base + len(scores) + 40))
    assert cost.many(ns).tolist() == [cost(n) for n in ns]
    assert choose_budget(scores, num_emitting, base, cost) == budget_by_budget(scores, num_emitting, base, cost)


# ------------------------------------------------------------------------------ groups of samples
def groups(members: list[tuple[int, bool]], num_laggards: list[int]) -> Groups:
    return Groups([g for g, _ in members], [lag for _, lag in members], num_laggards, len(num_laggards))


def expected_min(survivals: list[list[float]]) -> float:
    """E[min_l A_l] by enumerating every acceptance count: P(A = a) = s_a - s_(a+1), s_0 = 1."""
    pmfs = []
    for s in survivals:
        tail = [1.0, *s, 0.0]
        pmfs.append([tail[a] - tail[a + 1] for a in range(len(s) + 1)])
    return sum(min(counts) * math.prod(p[a] for p, a in zip(pmfs, counts))
               for counts in itertools.product(*(range(len(p)) for p in pmfs)))


@pytest.mark.parametrize("seed", range(8))
def test_a_groups_laggards_gain_the_expected_minimum_of_their_acceptances(seed):
    """Once every laggard's drafts are all admitted, the gains add up to E[min_l A_l], enumerated."""
    rng = random.Random(seed)
    survivals = []
    for _ in range(rng.randint(1, 4)):
        s, row = 1.0, []
        for _ in range(rng.randint(1, 4)):
            s *= rng.uniform(0.2, 1.0)
            row.append(s)
        survivals.append(row)
    order = admission_order(survivals)
    gains = completion_gains(survivals, order, groups([(0, True)] * len(survivals), [len(survivals)]), 0.0)
    assert sum(gains) == pytest.approx(expected_min(survivals), rel=1e-12)
    assert all(g >= 0 for g in gains)


def test_a_group_moves_only_when_every_laggard_has_the_slot():
    scores = [[0.9, 0.8], [0.5], [0.7, 0.6]]  # requests 0 and 1 are laggards; 2 is ahead of them
    order = admission_order(scores)
    assert order == [0, 0, 2, 2, 1]
    gains = completion_gains(scores, order, groups([(0, True), (0, True), (0, False)], [2]), row_weight=0.1)
    # Request 0's slots wait for request 1's first; the leader's count a row each.
    assert gains == pytest.approx([0.0, 0.0, 0.07, 0.06, 0.9 * 0.5])
    # A laggard that drafts nothing holds the group where it is.
    assert completion_gains(scores, order, groups([(0, True), (0, True), (0, False)], [3]), 0.0) == [0.0] * 5


@settings(max_examples=examples(100), deadline=None)
@given(scores=st.lists(st.lists(st.floats(0, 1), min_size=1, max_size=5), min_size=1, max_size=6))
def test_requests_alone_gain_their_scores_as_the_tokens_per_second_objective(scores):
    scores = [sorted(row, reverse=True) for row in scores]  # survivals never rise along a draft
    order = admission_order(scores)
    gains = completion_gains(scores, order, groups([(i, True) for i in range(len(scores))], [1] * len(scores)), 0.5)
    depth = [0] * len(scores)
    expected = []
    for i in order:
        expected.append(scores[i][depth[i]])
        depth[i] += 1
    assert gains == expected


def plan_counts(entries, score: float, cost: CostModel) -> list[int]:
    ctl = AdaptiveController(4, cost, exact_host_scores=True)
    for e in entries:
        uniform_history(ctl, e, score)
    return plan_counts_of(ctl, entries)


def test_rollouts_of_one_prompt_verify_what_moves_their_slowest_and_requests_alone_what_pays_each():
    """Eight samples of one request at a coin-flip acceptance verify nothing where eight requests
    alone with the same scores verify drafts; samples that nearly always agree verify theirs; a
    sample ahead of its siblings drafts only what its row is worth."""
    cost = CostModel([8, 16, 40], [1.0, 1.05, 2.0])  # draft rows cheap up to 16 tokens
    alone = plan_counts([entry(f"r{i}", [1, 2, 3, 4]) for i in range(8)], 0.5, cost)
    assert sum(alone) > 0
    assert plan_counts([entry("rollout", [1, 2, 3, 4]) for _ in range(8)], 0.5, cost) == [0] * 8
    assert plan_counts([entry("rollout", [1, 2, 3, 4]) for _ in range(8)], 0.99, cost) == [4] * 8
    ahead = [entry("rollout", [1, 2, 3, 4], written=5)] + [entry("rollout", [1, 2, 3, 4]) for _ in range(7)]
    assert plan_counts(ahead, 0.99, cost)[0] == 0 and sum(plan_counts(ahead, 0.99, cost)[1:]) >= 7
