"""Adaptive verification: how many draft tokens a step verifies, and whose (docs/adaptive.md).

Every drafted slot (request i, position j) gets a survival score s_ij = c_i1 * ... * c_ij, the
chance that drafts 1..j are all accepted; c is the slot's confidence:

- model drafters (layer_skip, draft_model): a calibrated function of max_x q_j(x), the peak of the
  drafter's distribution at position j, known only on the device. For a greedy request the draft
  is that argmax, so this is q(x_j). For a random request it must not be q(x_j): verification is
  exact only if whether slot j is verified does not depend on x_j itself (it may depend on
  x_1..x_{j-1}); admitting high-q(x_j) drafts would skew the output toward the drafter's
  favourites. The peak is a function of q_j, hence of the earlier drafts only. q alone is a poor
  acceptance estimate (a greedy request accepts when the argmaxes agree, however flat q is), so
  it is bucketed and each bucket holds the engine's running acceptance rate for drafts with such
  a peak; the table goes to the device each step and the lookup happens there;
- ngram: a per-request exponential moving average of past accept/reject outcomes at position j,
  a host value;
- suffix: the calibrated chance that the text continues with the branch's most frequent token
  (the tree's counts; 1 inside a run), a host value that, like q's peak, depends only on the
  drafts before the slot.

A step that verifies B drafts for R sampling requests emits R + (expected accepted drafts) tokens
and costs about cost(base_tokens + B) where the cost is the target's forward time profiled at
start-up; for the n samples of one request only what moves their slowest counts (budget.py).
The host picks B from the scores it already has (ngram: this step's; model drafters: each
request's survivals from its previous step, copied back with the step's one D2H copy), so it
never waits for the device. It also trims each request's drafts to the host's own top slots (plus
a little slack for model drafters, whose true scores it does not know yet; at B = 0 none, but
on a probing step: `kept_slots`): those tokens run through the forward. For ngram the host's
scores are this step's own, so that trim is the admission and every draft left is verified.
For model drafters the device then admits the B highest-scoring slots by this step's scores:
per-request capacities, always a prefix of each request's drafts, whose boundaries
(`cu_num_logits`) exist only on the device. Only admitted rows and one bonus row per request get
logits and verification.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from verispec.core.step_types import AdaptivePlan
from verispec.device_copy import to_device
from verispec.spec_decode.admission import admission_order, slot_counts
from verispec.spec_decode.budget import Groups, best_prefix, completion_gains
from verispec.spec_decode.cost import CostModel
from verispec.spec_decode.drafting_gate import ProbeCredit

# Per-request EMA weight of the newest accept/reject outcome (ngram confidences).
REQUEST_EMA = 0.3
# Engine-wide EMA weight: the starting confidence of a request with no history of its own.
GLOBAL_EMA = 0.05
# A confidence never observed starts optimistic: a slot thought good gets verified and learnt
# about, while one thought bad never would be.
PRIOR_CONFIDENCE = 0.8
# A calibration bucket averages its first outcomes with the prior counted as this many outcomes
# (step 1 / (n + 1 + PRIOR_WEIGHT)) until the step falls to GLOBAL_EMA. With the EMA alone the
# prior faded over about 50 outcomes: suffix drafts at temperature 0.8 were admitted at an
# estimated 0.54-0.64 while 0.24-0.50 of them landed, and a rollout of 16 requests was over first.
PRIOR_WEIGHT = 2
# After this many planned steps in a row that verified no draft, the drafter proposes only every
# other step, after as many more every 4th, then every 8th, up to every MAX_DRAFT_INTERVAL-th: its
# host work (0.5 ms of a 22 ms step at 16 rollouts) buys nothing while every draft is refused.
# Spacing by +1 instead of doubling still drafted on 31 of a 129-step rollout batch's steps.
REFUSAL_STREAK = 4
MAX_DRAFT_INTERVAL = 16
# A refused request whose estimate has not moved (no outcome since) is weighed on its merits again
# every this many steps only; probes renew it in between (drafting_gate.py).
REWEIGH_EVERY = 8
# Left edges of the q-peak buckets of the calibration table.
Q_BUCKET_EDGES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98)
_EDGES = np.asarray(Q_BUCKET_EDGES)  # numpy converts a tuple on every call
_MIDDLES = [(lo + hi) / 2 for lo, hi in zip(Q_BUCKET_EDGES, Q_BUCKET_EDGES[1:] + (1.0,))]


def mode_row(greedy: bool) -> int:
    """The row of the per-mode tables (calibration, new requests' prior): greedy requests' drafts
    land far more often than sampled ones'."""
    return 0 if greedy else 1


def q_bucket(q: float) -> int:
    """The calibration bucket of a q peak."""
    return int(np.searchsorted(_EDGES, q, side="right")) - 1


def _learn(values: list[float], counts: list[int], i: int, outcome: float) -> None:
    """values[i] toward one more outcome: averaged with its prior, counted as PRIOR_WEIGHT
    outcomes, while young; then an EMA at GLOBAL_EMA."""
    counts[i] += 1
    values[i] += max(GLOBAL_EMA, 1.0 / (counts[i] + PRIOR_WEIGHT)) * (outcome - values[i])


@dataclass(slots=True)
class RequestHistory:
    """One request's estimates, kept across its steps (AdaptiveController, by request id)."""

    confidence: list[float]  # per-position acceptance EMA
    survival: list[float] | None = None  # the survival of the drafts it verified last (model drafters)
    waited: int = 0  # planned steps since it last had a draft verified (drafting_gate.py)
    renewed: bool = False  # an outcome came in since it was last planned
    # A refused one-hot host draft (prompt lookup; suffix decoding's greedy drafts): where it
    # started, its tokens and their confidences (suffix), checked against what the request then
    # wrote (`AdaptiveController.check_shadow`).
    shadow: tuple[int, tuple[int, ...], tuple[float, ...] | None] | None = None


def survival_scores(plan: AdaptivePlan, reqs, num_drafts: list[int], confidence: list[torch.Tensor | None],
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, K] survival scores on the device (-inf past each request's drafts) from the plan's
    calibration, and the raw q peaks [R, K] (zeros past the drafts), which go back to the host."""
    k = max(num_drafts)
    edges = to_device(Q_BUCKET_EDGES, dtype=torch.float32, device=device)
    table = to_device(plan.calibration, dtype=torch.float32, device=device)
    raw = torch.zeros(len(reqs), k, device=device)
    for i, c in enumerate(confidence):
        if c is not None:
            raw[i, : c.shape[0]] = c.float()
    mode = to_device([mode_row(r.params.greedy) for r in reqs], dtype=torch.long, device=device)
    scores = table[mode[:, None], torch.searchsorted(edges, raw, right=True) - 1].cumprod(dim=1)
    drafted = torch.arange(k, device=device)[None, :] < to_device(num_drafts, device=device)[:, None]
    return scores.masked_fill(~drafted, float("-inf")), raw


@dataclass(slots=True)
class AdaptiveStats:
    """Cumulative counters for `LLM.stats()["adaptive"]`."""

    num_steps: int = 0
    budget_total: int = 0  # sum over steps of B
    drafting_steps: int = 0  # planned steps that ran a draft through the forward
    probes: int = 0  # refused requests' drafts verified to renew their estimate (drafting_gate.py)
    drafted_total: int = 0  # drafts run through the forward (after the host's trim)
    admitted_total: int = 0  # drafts that got logits and verification
    capacity_histogram: list[int] = field(default_factory=list)  # [c] = requests verified with c drafts
    # Per tenth of raw confidence (q peak, or a confidence head's chance): [drafts tested, their
    # confidences' sum, how many were accepted]; a draft is tested when every draft before it was
    # accepted. Predicted against observed: the drafter's calibration.
    calibration: list[list[float]] = field(default_factory=lambda: [[0, 0.0, 0] for _ in range(10)])


class AdaptiveController:
    """Host side of adaptive verification: confidences, the budget, the trim, the statistics."""

    def __init__(self, k: int, cost: CostModel, exact_host_scores: bool, calibrated: bool = False):
        """calibrated: the confidences are chances already (DSpark's head): buckets start at their middles."""
        self.cost = cost
        # ngram: the host's scores are this step's own, so the trim is exact and needs no slack.
        self.exact_host_scores = exact_host_scores
        # A new request's per-position confidences, one list for greedy requests and one for random
        # ones: an engine that had answered greedy chat started its T = 0.8 requests at the greedy
        # rates, and prompt lookup drafted on 59 % of a batch of 16's steps at 0.93x plain.
        self.global_confidence = [[PRIOR_CONFIDENCE] * k for _ in range(2)]
        self.global_counts = [[0] * k for _ in range(2)]
        # q peak -> acceptance rate, one table for greedy requests and one for random ones, and
        # how many outcomes each bucket has seen.
        start = (_MIDDLES if calibrated
                 else [PRIOR_CONFIDENCE] * len(Q_BUCKET_EDGES))
        self.calibration = [list(start) for _ in range(2)]
        self.calibration_counts = [[0] * len(Q_BUCKET_EDGES) for _ in range(2)]
        self.stats = AdaptiveStats(capacity_histogram=[0] * (k + 1))
        self.refused = 0  # planned steps in a row whose budget was 0
        # A model drafter's host estimate is its previous step's survivals: by the bucket of its
        # first slot's, how often the next verified first draft landed (a prior of PRIOR_WEIGHT
        # outcomes at the bucket's middle, then an EMA, as the calibration).
        self.persistence = list(_MIDDLES)
        self.persistence_counts = [0] * len(Q_BUCKET_EDGES)
        self.probe_credit = ProbeCredit()
        self._since_draft = 0  # steps since the drafter last proposed
        self._history: dict[str, RequestHistory] = {}

    def should_draft(self) -> bool:
        """Whether the drafter proposes for the next step (asked once a step). Always, until
        REFUSAL_STREAK steps in a row verified no draft; then every n-th step, n growing with the
        streak; the first step that verifies a draft ends the streak. The answer depends on
        earlier steps only, never on a draft's value, so verification stays exact."""
        interval = min(MAX_DRAFT_INTERVAL, 2 ** min(8, self.refused // REFUSAL_STREAK))
        self._since_draft += 1
        if self._since_draft < interval:
            return False
        self._since_draft = 0
        return True

    def calibrated_survival(self, peaks, greedy: bool) -> list[float]:
        """The running product of the peaks' calibrated rates: one lookup for the whole draft (a
        lookup per draft took 0.3 ms of a 20 ms step at 16 rollouts)."""
        table = np.asarray(self.calibration[mode_row(greedy)])
        return np.cumprod(table[np.searchsorted(_EDGES, peaks, side="right") - 1]).tolist()

    # ------------------------------------------------------------------ scores on the host
    def history(self, request_id: str, greedy: bool = True) -> RequestHistory:
        history = self._history.get(request_id)
        if history is None:
            prior = self.global_confidence[mode_row(greedy)]
            history = self._history[request_id] = RequestHistory(confidence=list(prior))
        return history

    def finish(self, request_id: str) -> None:
        """A request that left: its estimates go."""
        self._history.pop(request_id, None)

    def host_scores(self, req, drafts) -> list[float]:
        """The survival estimate of each of the request's slots (`drafts`: a `Drafts`), from host
        values only."""
        num_drafts = len(drafts)
        history = self.history(req.request_id, req.params.greedy)
        if not self.exact_host_scores and history.survival:
            # Last step's survivals, scaled to what a first slot with such a stale estimate landed.
            first = history.survival[0]
            trust = min(1.0, self.persistence[q_bucket(first)] / first) if first > 0 else 0.0
            prev = [x * trust for x in history.survival[:num_drafts]]
            conf = self.global_confidence[mode_row(req.params.greedy)]
            while len(prev) < num_drafts:  # a longer draft than last time: extend by the prior
                prev.append(prev[-1] * conf[len(prev)])
            return prev
        if drafts.confidence is not None:  # a host drafter's q peaks (suffix), calibrated
            return self.calibrated_survival(list(drafts.confidence[:num_drafts]), req.params.greedy)
        return list(np.cumprod(history.confidence[:num_drafts]))

    # ------------------------------------------------------------------ the plan
    def plan(self, scheduled, drafts: list) -> tuple[list[int], AdaptivePlan | None]:
        """This step's budget B, and how many of each entry's `drafts` (one `Drafts` per scheduled
        entry) run through the forward. The plan for the device is None when it has nothing to
        admit: no request drafts, or the host's scores are this step's own (ngram), so the trim
        keeps exactly the B best slots and every draft left is verified. Host values only: it
        never waits for the device."""
        if self.exact_host_scores:
            for entry in scheduled:
                self.check_shadow(entry.request)
        drafting = [i for i, d in enumerate(drafts) if len(d)]
        counts = [0] * len(scheduled)
        if not drafting:
            return counts, None
        histories = [self.history(scheduled[i].request.request_id, scheduled[i].request.params.greedy)
                     for i in drafting]
        base = sum(s.num_new_tokens for s in scheduled)
        # A refused request whose estimate has not moved is weighed again only now and then: the
        # plan costs the host 0.5 ms a step, 4 % of a one-request step.
        weigh = [n for n, (i, h) in enumerate(zip(drafting, histories))
                 if not h.waited or h.renewed or h.waited % REWEIGH_EVERY == 0 or drafts[i].confidence is not None]
        kept, budget, keep = [0] * len(drafting), 0, 0
        if weigh:
            merit, budget, keep = self._merit(scheduled, [drafting[n] for n in weigh], drafts, base)
            for n, k in zip(weigh, merit):
                kept[n] = k
        self.refused = self.refused + 1 if budget == 0 else 0
        for n in self._probes(histories, kept, base, budget):
            kept[n], budget, keep = 1, budget + 1, keep + 1
        for i, n, history in zip(drafting, kept, histories):
            counts[i] = n
            history.waited, history.renewed = 0 if n else history.waited + 1, False
            if not n and self.exact_host_scores and drafts[i].q is None:
                history.shadow = (scheduled[i].request.num_tokens, drafts[i].token_ids, drafts[i].confidence)
        self.stats.num_steps += 1
        self.stats.budget_total += budget
        self.stats.drafted_total += keep
        self.stats.drafting_steps += keep > 0
        if self.exact_host_scores or keep == 0:
            return counts, None
        return counts, AdaptivePlan(budget, tuple(tuple(row) for row in self.calibration))

    def _merit(self, scheduled, drafting: list[int], drafts: list, base: int) -> tuple[list[int], int, int]:
        """The budget on the merits of the `drafting` entries' slots: how many of each one's drafts
        run through the forward, B, and the slots kept in all."""
        scores = [self.host_scores(scheduled[i].request, drafts[i]) for i in drafting]
        groups = Groups.of(scheduled, [scheduled[i] for i in drafting])
        # Laggards' slots rank first: a member ahead of them is worth a row at most, and the
        # budget is a prefix of this order (its status depends on emitted tokens, not drafts).
        ranked = admission_order(scores)
        order = [i for i in ranked if groups.laggard[i]] + [i for i in ranked if not groups.laggard[i]]
        # A member ahead of its group's laggards saves a row of a later step (the table's slope
        # here) for every waiting client: c' / T of a step each.
        row_weight = groups.num_waiting * (self.cost.table(base) - self.cost.table(base - 1)) / self.cost(base)
        gains = completion_gains(scores, order, groups, row_weight)
        budget = best_prefix(gains, groups.num_waiting, base, self.cost, order)
        keep = self.kept_slots(budget, len(order))
        return slot_counts(order, len(drafting), keep), budget, keep

    def _probes(self, histories: list[RequestHistory], kept: list[int], base: int, budget: int) -> list[int]:
        """The refused requests (positions among the drafting requests) whose first draft this
        step verifies anyway, paid from the probe credit (drafting_gate.py)."""
        refused = [n for n, k in enumerate(kept) if not k]
        if not refused or not self.probe_credit.may_afford():
            return []
        waited = [histories[n].waited for n in refused]
        chosen = self.probe_credit.choose(refused, waited, base, budget, sum(k > 0 for k in kept), self.cost)
        self.stats.probes += len(chosen)
        return [refused[c] for c in chosen]

    def kept_slots(self, budget: int, slots: int) -> int:
        """How many of the ranked slots run through the forward: the B admitted (ngram, whose
        host scores are this step's own), else B and a little slack for the device to choose from.
        At B = 0 none: a kept draft would cost its row and the drafting for nothing but fresh
        scores, which probes buy within a bounded share of the time (drafting_gate.py)."""
        if self.exact_host_scores or budget == 0:
            return budget
        return min(slots, budget + max(1, budget // 4))

    def observe_step(self, num_tokens: int, seconds: float, drafting: float, num_drafts: int,
                     num_drafting: int, catch_up: float = 0.0) -> None:
        """One measured step: the cost model learns it, and it earns the probes their share. A
        model drafter's catch-up on the context of steps that did not draft (`catch_up`, part of
        `drafting`) is not what the next draft costs: the cost model leaves it out, and the probes'
        credit pays it, since a pause ends with a probe (on a 630-token prompt, DSpark's first draft
        writes the whole prompt's context). Under a given cost table the steps earn the table's
        cost, not their time: the same requests then make the same decisions (the golden digests)."""
        self.cost.observe(num_tokens, seconds - catch_up, drafting - catch_up, num_drafts, num_drafting)
        if not self.cost.learn:  # a given table: its own costs, so that the decisions never hang on timing
            seconds, catch_up = self.cost(num_tokens), 0.0
        self.probe_credit.earn(seconds)
        self.probe_credit.credit -= catch_up

    # ------------------------------------------------------------------ after the step
    def check_shadow(self, req) -> None:
        """A refused host draft against the tokens the request wrote since. Only one-hot drafts are
        kept (prompt lookup's, suffix decoding's greedy ones; not a draft drawn from q): a token
        plain decoding writes equals such a draft exactly as often as verification would have
        accepted it (greedy: the argmax; sampled: with chance p(draft) either way), so each written
        token is an outcome, free. Without it a refused request learnt only from probes: a copying
        prompt after open chat took dozens of tokens to be drafted for, and suffix decoding in an
        agent loop, its rows dear at four requests, refused drafts that landed 97 % of the time
        (its calibration held at the prior). Only the first positions the request has written are
        checked; a match renews the request's estimate: its per-position confidences (prompt
        lookup) or the calibration of the drafts' confidences (suffix decoding)."""
        history = self._history.get(req.request_id)
        if history is None or history.shadow is None:
            return
        start, tokens, confidence = history.shadow
        written = req.token_ids[start : start + len(tokens)]
        if not written:
            return
        history.shadow = None
        matched = 0
        while matched < len(written) and written[matched] == tokens[matched]:
            matched += 1
        conf = history.confidence
        mode = mode_row(req.params.greedy)
        for j in range(min(matched + 1, len(written))):
            if confidence is None:
                conf[j] += REQUEST_EMA * (float(j < matched) - conf[j])
            else:
                _learn(self.calibration[mode], self.calibration_counts[mode], q_bucket(confidence[j]),
                       float(j < matched))
        history.renewed = history.renewed or matched > 0

    def observe(self, req, capacity: int, num_accepted: int, q: list[float] | None) -> None:
        """One request's verified outcome: positions 0..capacity-1 were verified, the first
        num_accepted accepted; the one after them (if verified) rejected, later ones unseen.
        q: the q peak at each draft (a model drafter's, copied back with the step's outputs, or a
        host drafter's)."""
        self.stats.admitted_total += capacity
        self.stats.capacity_histogram[capacity] += 1
        mode = mode_row(req.params.greedy)
        history = self.history(req.request_id, req.params.greedy)
        history.renewed = True
        if not self.exact_host_scores and history.survival and capacity:
            _learn(self.persistence, self.persistence_counts, q_bucket(history.survival[0]), float(num_accepted > 0))
        conf = history.confidence
        table, counts = self.calibration[mode], self.calibration_counts[mode]
        for j in range(min(num_accepted + 1, capacity)):
            outcome = 1.0 if j < num_accepted else 0.0
            conf[j] += REQUEST_EMA * (outcome - conf[j])
            # Young, the prior counts as PRIOR_WEIGHT outcomes: a new request starts from it, and
            # from 0.8 a slot every new DSpark request of the first dozen verified 3-5 drafts of
            # open chat on its first step, and landed none.
            _learn(self.global_confidence[mode], self.global_counts[mode], j, outcome)
            if q is not None:
                tenth = self.stats.calibration[min(9, int(q[j] * 10))]
                tenth[0], tenth[1], tenth[2] = tenth[0] + 1, tenth[1] + q[j], tenth[2] + outcome
                _learn(table, counts, q_bucket(q[j]), outcome)
        if 0 < capacity == num_accepted and capacity < len(conf):
            # Everything verified was accepted, and the next position was not tried: move its
            # estimate toward the last one's, or a request capped early would never try more.
            conf[capacity] += REQUEST_EMA * (conf[capacity - 1] - conf[capacity])
        if q is not None:  # next step's estimate: this step's drafts, scored with the new table
            history.survival = self.calibrated_survival(q, req.params.greedy)
