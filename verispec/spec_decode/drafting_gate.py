"""Whether a refused request drafts again: probes paid from a bounded share of the engine's time.

Adaptive verification's budget (budget.py) charges a request's drafting to its first slot, so a
request whose drafts do not pay is refused and drafts nothing: a model drafter runs only for the
requests whose slots were kept. But its estimate is then frozen. A model drafter's survival
scores come from its last drafting step and prompt lookup's from its last verified drafts, so a
request refused once would stay refused after its text turned to copying, where drafts land.

So refused requests are probed: the step verifies the first draft of one whatever its estimate,
and the outcome and the fresh confidences (a model drafter's, copied back with the step) renew
it; if they say that drafting pays, the next step's budget admits it on its merit. A probe costs
what it adds to the step: one more draft row and, for a request not yet drafting, its drafting
(both from the step's cost model: costs at this step's size, measured). Every measured step
earns PROBE_SHARE of its seconds as credit and a probe spends its cost, so probes take at most
that share of the engine's time, however many requests wait. The request refused the longest
goes first. On SmolLM2-135M (two CPU threads, batch 1) a DSpark probe costs about 7 ms (3.8 ms
of drafting, 3.3 ms for the row) against a 14 ms step: one probe every 25 steps, within the 32
tokens a copying turn should take to be noticed. Whether a request is probed depends on earlier
steps and on costs, never on the value of its drafts, so verification stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The share of the engine's measured step time that probes of refused requests may take.
PROBE_SHARE = 0.02
# The least a probe is counted to cost, as a share of its step's own cost.
PROBE_FLOOR = 0.05
# Credit saved while nothing needs probing covers at most this many probes at once.
MAX_SAVED_PROBES = 2


@dataclass(slots=True)
class ProbeCredit:
    """Seconds of probing the engine has earned and not spent."""

    credit: float = 0.0
    last_cost: float = 0.0  # the last probe's estimated cost: below it, no probe is weighed

    def may_afford(self) -> bool:
        return self.credit >= self.last_cost

    def earn(self, step_seconds: float) -> None:
        self.credit += PROBE_SHARE * max(step_seconds, 0.0)

    def choose(self, candidates: list[int], waited: list[int], base: int, budget: int, num_drafting: int,
               cost) -> list[int]:
        """The candidates probed this step (indices into `candidates`, the drafting requests the
        budget refused), longest refused first, while the credit covers each one's cost: its row
        on top of the step's `budget` rows and its drafting on top of `num_drafting` requests'."""
        if not candidates:
            return []
        chosen: list[int] = []
        rows = cost.step_costs(base, np.arange(budget, budget + len(candidates) + 1))
        drafting = cost.drafting_costs(np.arange(num_drafting, num_drafting + len(candidates) + 1))
        # A probe costs at least PROBE_FLOOR of the step: a measured extra that noise put near 0
        # must not make every step a probe.
        each = np.maximum(np.diff(rows) + np.diff(drafting), PROBE_FLOOR * rows[0])
        self.last_cost = float(each[0])
        # Credit beyond a few probes is not kept: a long stretch with nothing to probe must not
        # become a burst of probes on one step.
        self.credit = min(self.credit, MAX_SAVED_PROBES * float(each[0]))
        for n, i in enumerate(sorted(range(len(candidates)), key=lambda i: -waited[i])):
            if self.credit < each[n]:
                break
            self.credit -= float(each[n])
            chosen.append(i)
        return chosen
