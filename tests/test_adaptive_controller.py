"""The adaptive controller's own state between steps: the calibration buckets (the prior's
pseudo-outcomes, then an EMA), a draft's calibrated survival in one lookup, and the refusal streak
that spaces out the drafter's proposals."""

from __future__ import annotations

import pytest

from adaptive_entries import entry, plan_counts_of, uniform_history
from verispec.spec_decode.adaptive import GLOBAL_EMA, PRIOR_CONFIDENCE, AdaptiveController, q_bucket
from verispec.spec_decode.cost import CostModel


def calibrated(ctl: AdaptiveController, q: float, greedy: bool) -> float:
    return ctl.calibration[0 if greedy else 1][q_bucket(q)]


def test_a_calibration_bucket_averages_its_first_outcomes_with_the_prior_then_moves_as_an_ema():
    """The prior counts as PRIOR_WEIGHT outcomes while a bucket is young: after n outcomes the
    estimate is their mean with the prior's pseudo-outcomes, not 0.8 faded by 0.95 ** n."""
    from types import SimpleNamespace

    from verispec.spec_decode import adaptive as adaptive_mod

    ctl = AdaptiveController(4, CostModel([1, 8], [0.01, 0.02]), exact_host_scores=True)
    req = SimpleNamespace(request_id="r", params=SimpleNamespace(greedy=False))
    outcomes = [1, 0, 0, 1, 0, 0, 0, 1, 0, 0]  # 30 % of first drafts land, in bucket 0.5
    for accepted in outcomes:
        ctl.observe(req, 1, accepted, [0.55])
    w = adaptive_mod.PRIOR_WEIGHT
    assert calibrated(ctl, 0.55, greedy=False) == pytest.approx((w * PRIOR_CONFIDENCE + sum(outcomes)) / (w + len(outcomes)))
    assert calibrated(ctl, 0.55, greedy=True) == PRIOR_CONFIDENCE  # greedy requests keep their own table
    for _ in range(200):  # an old bucket: each outcome moves it by GLOBAL_EMA of the gap
        ctl.observe(req, 1, 0, [0.55])
    before = calibrated(ctl, 0.55, greedy=False)
    ctl.observe(req, 1, 1, [0.55])
    assert calibrated(ctl, 0.55, greedy=False) == pytest.approx(before + GLOBAL_EMA * (1 - before))


def test_a_new_request_starts_from_the_outcomes_of_requests_of_its_own_mode():
    """Prompt lookup's drafts land far more often for greedy requests than for sampled ones: the
    per-position prior a new request starts from is learnt per mode, so an engine that answered
    greedy chat does not start its T = 0.8 requests at the greedy rates."""
    from types import SimpleNamespace

    ctl = AdaptiveController(3, CostModel([1, 8], [0.01, 0.02]), exact_host_scores=True)
    greedy = SimpleNamespace(request_id="g", params=SimpleNamespace(greedy=True))
    for _ in range(20):
        ctl.observe(greedy, 3, 3, None)  # every greedy draft lands
    sampled = SimpleNamespace(request_id="s", params=SimpleNamespace(greedy=False))
    for _ in range(20):
        ctl.observe(sampled, 3, 0, None)  # no sampled first draft does
    assert ctl.history("new greedy", greedy=True).confidence[0] > 0.9
    assert ctl.history("new sampled", greedy=False).confidence[0] < 0.2
    assert ctl.history("new sampled", greedy=False).confidence[1:] == [PRIOR_CONFIDENCE] * 2  # never tried


def test_a_drafts_calibrated_survival_is_the_running_product_of_its_buckets():
    """One lookup for a whole draft gives what a lookup per position does, bucket edges included."""
    from types import SimpleNamespace

    ctl = AdaptiveController(8, CostModel([1, 8], [0.01, 0.02]), exact_host_scores=True)
    req = SimpleNamespace(request_id="r", params=SimpleNamespace(greedy=False))
    for accepted, peak in [(1, 0.55), (0, 0.95), (0, 0.0), (1, 0.3), (0, 0.98)]:
        ctl.observe(req, 1, accepted, [peak])
    peaks = [1.0, 0.98, 0.95, 0.55, 0.5, 0.3, 0.01, 0.0]
    for greedy in (False, True):
        expected, running = [], 1.0
        for peak in peaks:
            running *= calibrated(ctl, peak, greedy)
            expected.append(running)
        assert ctl.calibrated_survival(peaks, greedy) == pytest.approx(expected, rel=1e-15)
    assert ctl.calibrated_survival([], greedy=False) == []


def test_a_streak_of_refused_steps_spaces_out_the_drafters_proposals_and_one_admitted_draft_ends_it():
    """The drafter proposes every step until REFUSAL_STREAK planned steps in a row verify no
    draft; then every n-th step, n growing with the streak up to MAX_DRAFT_INTERVAL; a step whose
    budget admits a draft restores every step."""
    from verispec.spec_decode.adaptive import MAX_DRAFT_INTERVAL, REFUSAL_STREAK

    # A step of 4 tokens costs 1 s and each draft row 1 s more: no draft ever pays.
    ctl = AdaptiveController(2, CostModel([4, 8], [1.0, 5.0]), exact_host_scores=True)

    def step(score: float) -> list[int]:
        entries = [entry(f"r{i}", [7, 8]) for i in range(4)]
        for e in entries:
            uniform_history(ctl, e, score)
        return plan_counts_of(ctl, entries)

    def proposals(steps: int) -> list[bool]:
        out = []
        for _ in range(steps):
            drafts = ctl.should_draft()
            out.append(drafts)
            if drafts:
                assert step(0.5) == [0, 0, 0, 0]  # refused: every draft trimmed away
        return out

    assert proposals(REFUSAL_STREAK) == [True] * REFUSAL_STREAK
    assert ctl.refused == REFUSAL_STREAK
    assert proposals(4) == [False, True, False, True]  # every other step
    long = proposals(400)
    gaps = [b - a for a, b in zip([i for i, x in enumerate(long) if x], [i for i, x in enumerate(long) if x][1:])]
    assert max(gaps) == MAX_DRAFT_INTERVAL and gaps == sorted(gaps)  # widening, then capped
    ctl.cost = CostModel([4, 8], [1.0, 1.0])  # draft rows now free: the next proposal is admitted
    while not ctl.should_draft():
        pass
    assert step(0.9) == [2, 2, 2, 2] and ctl.refused == 0
    assert [ctl.should_draft() for _ in range(3)] == [True] * 3


def test_calibration_stats_count_each_tested_draft_in_its_tenth():
    """Drafts after the first rejection were never tested and are not counted; a drafter whose
    confidences are chances (DSpark's head) starts each bucket at its middle."""
    from types import SimpleNamespace

    ctl = AdaptiveController(4, CostModel([1, 8], [0.01, 0.02]), exact_host_scores=False, calibrated=True)
    req = SimpleNamespace(request_id="r", params=SimpleNamespace(greedy=True))
    ctl.observe(req, 4, 1, [0.95, 0.42, 0.48, 0.9])  # 0.95 accepted, 0.42 rejected, the rest untested
    ctl.observe(req, 2, 2, [0.91, 0.05])
    tenths = ctl.stats.calibration
    assert tenths[9] == [2, pytest.approx(1.86), 2] and tenths[4] == [1, pytest.approx(0.42), 0]
    assert tenths[0] == [1, pytest.approx(0.05), 1] and sum(t[0] for t in tenths) == 4
    fresh = AdaptiveController(4, CostModel([1, 8], [0.01, 0.02]), exact_host_scores=False, calibrated=True)
    assert calibrated(fresh, 0.03, greedy=True) == pytest.approx(0.035)
    assert calibrated(fresh, 0.99, greedy=False) == pytest.approx(0.99)


def test_a_refused_request_drafts_only_when_probed_and_probes_take_their_share_of_the_time():
    """At B = 0 a model drafter's kept draft would run its drafting and a row for fresh scores
    alone: a refused request keeps none and the step has no plan, until the steps have earned
    the cost of a probe (PROBE_SHARE of their time). A probe verifies its first draft (a plan of
    budget 1); over many steps probes cost at most their share."""
    from verispec.spec_decode.drafting_gate import PROBE_SHARE

    ctl = AdaptiveController(4, CostModel([1, 8], [1.0, 8.0]), exact_host_scores=False, calibrated=True)
    kept, budgets = [], []
    for _ in range(400):
        e = entry("r", [0, 0, 0, 0])
        ctl.history(e.request.request_id).survival = [0.3, 0.09, 0.03, 0.01]  # never worth a row
        counts, plan = ctl.plan([e], [e.drafts])
        kept.append(counts[0])
        budgets.append(None if plan is None else plan.budget)
        ctl.observe_step(1, 1.0, 0.0, counts[0], int(counts[0] > 0))  # each step took a second
    probes = [n for n, k in enumerate(kept) if k]
    assert kept[:40] == [0] * 40 and budgets[:40] == [None] * 40  # a probe costs a row: 1 s, 50 steps' share
    assert probes and all(kept[n] == 1 and budgets[n] == 1 for n in probes)
    assert len(probes) * 1.0 <= PROBE_SHARE * 400 * 1.0 + 1e-9 and len(probes) >= 6
    assert ctl.stats.probes == len(probes) and ctl.stats.budget_total == len(probes)
    ctl.cost = CostModel([1, 8], [1.0, 2.4])  # a row costs a fifth of the step: two drafts pay
    e = entry("r", [0, 0, 0, 0])
    ctl.history(e.request.request_id).survival = [0.9, 0.8, 0.05, 0.01]
    counts, plan = ctl.plan([e], [e.drafts])
    assert plan.budget == 2 and counts == [3]  # B and one slack draft for the device


def test_a_refused_prompt_lookup_draft_is_checked_against_what_the_request_wrote():
    """A refused host draft costs nothing to score: the token plain decoding wrote equals the
    draft as often as verification would accept it. A match raises the request's estimate and
    has it weighed again; a miss lowers it; nothing written yet keeps the draft for later."""
    from types import SimpleNamespace

    from verispec.core.step_types import Drafts
    from verispec.spec_decode.adaptive import REQUEST_EMA

    ctl = AdaptiveController(4, CostModel([1, 8], [1.0, 8.0]), exact_host_scores=True)  # rows never pay
    req = SimpleNamespace(request_id="r", params=SimpleNamespace(greedy=True), group="r", max_tokens=64,
                          num_output_tokens=0, token_ids=[5, 6, 7])
    req.num_tokens = 3
    e = SimpleNamespace(request=req, drafts=Drafts((8, 9, 10)), samples=True, num_new_tokens=1)
    history = ctl.history("r")
    before = history.confidence[0]
    assert ctl.plan([e], [e.drafts])[0] == [0] and history.shadow == (3, (8, 9, 10), None)
    ctl.check_shadow(req)  # nothing written yet
    assert history.shadow is not None and history.confidence[0] == before
    req.token_ids.append(8)  # the step wrote the draft's first token
    ctl.check_shadow(req)
    assert history.confidence[0] == pytest.approx(before + REQUEST_EMA * (1 - before))
    assert history.renewed and history.shadow is None
    history.renewed, req.num_tokens = False, 4
    ctl.plan([e], [e.drafts])  # refused again, from position 4
    req.token_ids.append(3)  # a miss
    high = history.confidence[0]
    ctl.check_shadow(req)
    assert history.confidence[0] == pytest.approx(high - REQUEST_EMA * high) and not history.renewed


def test_a_refused_one_hot_suffix_draft_teaches_the_calibration_and_a_drawn_one_is_not_kept():
    """Suffix decoding's greedy drafts are one-hot: the token written equals the draft as often as
    verification would accept it, so a refused draft's outcome moves the calibration of its
    confidence's bucket. A draft drawn from q (a random request's) would be accepted with chance
    sum min(p, q), not sum p q: it is never checked."""
    from types import SimpleNamespace

    from verispec.core.step_types import Drafts
    from verispec.spec_decode.adaptive import q_bucket

    ctl = AdaptiveController(4, CostModel([1, 8], [1.0, 8.0]), exact_host_scores=True)  # rows never pay

    def suffix_entry(rid, greedy, q):
        req = SimpleNamespace(request_id=rid, params=SimpleNamespace(greedy=greedy), group=rid, max_tokens=64,
                              num_output_tokens=0, token_ids=[5, 6, 7], num_tokens=3)
        drafts = Drafts((8, 9), q, (0.55, 0.99))
        return SimpleNamespace(request=req, drafts=drafts, samples=True, num_new_tokens=1)

    greedy, drawn = suffix_entry("g", True, None), suffix_entry("s", False, (([8], [1.0]), ([9], [1.0])))
    counts, _ = ctl.plan([greedy, drawn], [greedy.drafts, drawn.drafts])
    assert counts == [0, 0]
    assert ctl.history("g").shadow == (3, (8, 9), (0.55, 0.99)) and ctl.history("s").shadow is None
    table, per_position = [list(row) for row in ctl.calibration], list(ctl.history("g").confidence)
    greedy.request.token_ids += [8, 9]  # both drafts would have landed
    ctl.check_shadow(greedy.request)
    first, second = q_bucket(0.55), q_bucket(0.99)
    assert ctl.calibration[0][first] > table[0][first] and ctl.calibration[0][second] > table[0][second]
    assert ctl.calibration[1] == table[1] and ctl.history("g").renewed
    assert ctl.history("g").confidence == per_position  # suffix ranks by its calibrated confidences
