"""Probes of refused requests (spec_decode/drafting_gate.py): paid from a bounded share of the
steps' time, longest refused first; a request whose text turns to copying drafts again soon."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from verispec.core.step_types import Drafts
from verispec.spec_decode.adaptive import AdaptiveController
from verispec.spec_decode.cost import CostModel
from verispec.spec_decode.drafting_gate import MAX_SAVED_PROBES, PROBE_SHARE, ProbeCredit

# SmolLM2-135M's fast tier at two threads, measured: a one-row step 12 ms, each row 3.3 ms more.
TABLE = ([1, 2, 4, 8, 16], [0.012, 0.0153, 0.0219, 0.0351, 0.0615])
DRAFTING = 0.0038  # a DSpark block forward for one request


def test_probes_go_to_the_longest_refused_first_while_the_credit_lasts():
    cost = CostModel([1, 8], [0.010, 0.017])  # a row costs 1 ms
    credit = ProbeCredit()
    for _ in range(100):
        credit.earn(0.010)  # 100 steps of 10 ms earn 20 ms, of which 2 probes' worth are kept
    chosen = credit.choose([0, 1, 2, 3], waited=[3, 9, 1, 5], base=1, budget=0, num_drafting=0, cost=cost)
    assert chosen == [1, 3]  # waited 9, then 5
    assert credit.credit == pytest.approx(0.0, abs=1e-12)
    assert credit.choose([0], waited=[1], base=1, budget=0, num_drafting=0, cost=cost) == []
    assert MAX_SAVED_PROBES == 2 and not credit.may_afford()


def test_a_probe_counts_at_least_a_share_of_its_step():
    """A measured extra row near zero (noise) must not make every step a probe."""
    cost = CostModel([1, 8], [0.010, 0.010])  # rows look free
    credit = ProbeCredit()
    probes = 0
    for _ in range(1000):
        credit.earn(0.010)
        probes += len(credit.choose([0], waited=[1], base=1, budget=0, num_drafting=0, cost=cost))
    assert probes <= 1000 * PROBE_SHARE / 0.05 + 1


def _simulate(ctl: AdaptiveController, steps: int, turn: int, model_drafter: bool, seed: int = 0):
    """One greedy request with 8 drafts on offer every step. Before step `turn` its text is open
    chat (a first draft lands 30 % of the time, the drafter's confidence 0.3); from `turn` on it
    copies (every draft lands, confidence 0.97). Each step's time is the table's plus the drafting
    for a request that drafted. Returns per step: drafts verified, tokens emitted, seconds."""
    rng = random.Random(seed)
    req = SimpleNamespace(request_id="r", params=SimpleNamespace(greedy=True), group="r", max_tokens=10**6,
                          num_output_tokens=0, token_ids=[], num_tokens=0)
    out = []
    for step in range(steps):
        copying = step >= turn
        entry = SimpleNamespace(request=req, drafts=Drafts((0,) * 8), samples=True, num_new_tokens=1)
        counts, plan = ctl.plan([entry], [entry.drafts])
        kept = counts[0]
        verified = kept if plan is None else min(kept, plan.budget)
        accepted = 0
        while accepted < verified and (copying or rng.random() < 0.3 / (accepted + 1)):
            accepted += 1
        if kept:
            peaks = [0.97 if copying else 0.3] * kept if model_drafter else None
            ctl.observe(req, verified, accepted, peaks)
        drafting = DRAFTING if kept and model_drafter else 0.0
        seconds = float(np.interp(1 + kept, *TABLE)) + drafting
        ctl.observe_step(1 + kept, seconds, drafting, kept, int(kept > 0))
        req.num_output_tokens += 1 + accepted
        out.append((verified, 1 + accepted, seconds))
    return out


@pytest.mark.parametrize("model_drafter", [True, False], ids=["dspark-like", "prompt-lookup-like"])
def test_a_refused_request_costs_at_most_its_probes_share_and_drafts_again_soon_after_its_text_turns(model_drafter):
    """Open chat for 600 steps: the drafts do not pay (a row costs over a quarter of the step and
    lands 30 % of the time), so the request drafts only when probed, and the whole run costs at
    most a few percent over plain steps. Then the text turns to copying: drafting resumes within
    32 tokens."""
    ctl = AdaptiveController(8, CostModel(*TABLE, learn=True), exact_host_scores=not model_drafter,
                             calibrated=model_drafter)
    turn = 600
    run = _simulate(ctl, 900, turn, model_drafter)
    before = run[50:turn]  # after the first estimates
    plain = sum(float(np.interp(1, *TABLE)) for _ in before)
    tokens = sum(t for _, t, _ in before)
    spent = sum(s for _, _, s in before)
    assert (spent / tokens) / (plain / len(before)) <= 1.0 + 2 * PROBE_SHARE  # tokens per second within 4 %
    drafted = sum(1 for v, _, _ in before if v)
    # Probes, and for prompt lookup (its estimate an average of outcomes) a step or two on its
    # merits after a probe that landed.
    assert drafted <= 0.15 * len(before)
    emitted, resumed = 0, None
    for n, (verified, toks, _) in enumerate(run[turn:]):
        if verified >= 2 and all(v for v, _, _ in run[turn + n : turn + n + 4]):  # drafting on its merits again
            resumed = emitted
            break
        emitted += toks
    assert resumed is not None and resumed <= 32
    after = run[turn + 100 :]
    assert sum(t for _, t, _ in after) / len(after) > 3  # and it keeps drafting while the drafts land
