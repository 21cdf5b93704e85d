"""Adaptive verification's budget: what a step's drafts are worth to the clients that wait on
them, and the B that pays most per second.

A client request completes when its last sequence does: a request alone, or all n samples of an
n > 1 request (one `Request.group`). For a request alone an accepted draft takes one step off its
completion, so a step that verifies B drafts advances the clients by R + (expected accepted
drafts): the tokens/sec objective. For a group the completion is set by its laggards, the members
with the most tokens still to write (`max_tokens` less their output): it moves only when every
laggard accepts, so drafts of j tokens each take E[min_l A_l] = sum_j prod_l P(A_l >= j) steps
off it (independent acceptances; P(A_l >= j) is slot j's survival score). A member already ahead
of its laggards saves only its own row in a later step: c' (the cost table's slope here) for every
waiting client, c' / T of a step each. This is the step's own effect, a lower bound: leads won
now also shorten later steps' waits once the laggards catch up, so a group of moderate acceptance
may verify less than would pay over its whole run. RL rollouts are such groups: 8 siblings at temperature 0.8 each land a suffix draft about half the
time, so a draft for each moves their completion by 0.5^8 of a step; counted as 8 requests alone
they looked worth verifying, and those steps cost more than they saved (docs/adaptive.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class Groups:
    """The scheduled requests' clients: which drafting request belongs to which group, which of
    them are their group's laggards, and how many laggards each group has (drafting or not: a
    laggard that drafts nothing holds its group's completion where it is)."""

    group: list[int]  # per drafting request
    laggard: list[bool]  # per drafting request
    num_laggards: list[int]  # per group
    num_waiting: int  # groups with a request that samples this step: the objective's unit

    @classmethod
    def of(cls, scheduled, drafting) -> "Groups":
        """From the step's scheduled entries (all of them) and the drafting subset."""
        remaining: dict[str, list[int]] = {}
        for s in scheduled:
            req = s.request
            remaining.setdefault(req.group, []).append(req.max_tokens - req.num_output_tokens)
        index = {g: i for i, g in enumerate(remaining)}
        most = {g: max(r) for g, r in remaining.items()}
        return cls(
            group=[index[s.request.group] for s in drafting],
            laggard=[s.request.max_tokens - s.request.num_output_tokens == most[s.request.group] for s in drafting],
            num_laggards=[r.count(most[g]) for g, r in remaining.items()],
            num_waiting=len({s.request.group for s in scheduled if s.samples}),
        )


def completion_gains(scores: Sequence[Sequence[float]], order: Sequence[int], groups: Groups,
                     row_weight: float) -> list[float]:
    """What each admitted slot adds to the clients' advance, in admission order (`order`: the
    drafting request of each slot, best first; a request's slots come in draft order). Steps taken
    off a group's completion for its laggards' slots, `row_weight` times the score for a member
    ahead of them."""
    depth = [0] * len(scores)
    level = [0] * len(groups.num_laggards)  # drafts that every laggard of the group has admitted
    reached = [0] * len(groups.num_laggards)  # laggards admitted past `level`
    members = [[i for i in range(len(scores)) if groups.laggard[i] and groups.group[i] == g]
               for g in range(len(groups.num_laggards))]
    gains = []
    for i in order:
        g, j = groups.group[i], depth[i]
        depth[i] += 1
        if not groups.laggard[i]:
            gains.append(row_weight * scores[i][j])
            continue
        gain = 0.0
        reached[g] += j == level[g]
        while reached[g] == groups.num_laggards[g]:  # every laggard has slot `level`: the group moves
            gain += math.prod(scores[m][level[g]] for m in members[g])
            level[g] += 1
            reached[g] = sum(depth[m] > level[g] for m in members[g])
        gains.append(gain)
    return gains


def best_prefix(gains: list[float], num_waiting: float, base_tokens: int, cost,
                slot_requests: Sequence[int] | None = None) -> int:
    """The B maximising (num_waiting + the first B gains) / (the step's cost with B draft rows +
    the drafting of the requests among those B slots): the clients' expected advance per second,
    `gains` as `completion_gains` gives them, `slot_requests` the request of each slot in the same
    order (None: one drafting cost for every B but 0); `cost` is the step's CostModel. The drafting
    is charged where it is paid: a DSpark block forward costs a third of a one-row step on one
    CPU thread, so a request's first slot must repay it and its later slots need not. Drafts that
    cannot repay it are refused, and a refused request drafts only when probed (drafting_gate.py).
    Ties go to the smaller B."""
    # Every B's gain (a running sum, in admission order) and cost at once: a batch of 32 requests
    # with 6 drafts each weighs 193 budgets a step, and one cost lookup each took a millisecond.
    totals = np.cumsum([float(num_waiting), *gains])
    budgets = np.arange(len(totals))
    if slot_requests is None:
        drafting = np.minimum(budgets, 1)
    else:
        seen: set[int] = set()
        firsts = [not (i in seen or seen.add(i)) for i in slot_requests]
        drafting = np.cumsum([0, *firsts])
    seconds = cost.step_costs(base_tokens, budgets) + cost.drafting_costs(drafting)
    values = (totals / seconds).tolist()
    best_b, best = 0, values[0]
    for b in range(1, len(values)):
        if values[b] > best * (1 + 1e-12):
            best_b, best = b, values[b]
    return best_b
