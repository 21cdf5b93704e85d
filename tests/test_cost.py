"""The step cost model: interpolation, what measured steps teach it (the overhead, the drafting),
and the start-up profile."""

from __future__ import annotations

import pytest
import torch

from verispec import LLM
from verispec.spec_decode.cost import CostModel


def test_cost_model_interpolates_extrapolates_and_never_falls():
    cost = CostModel([4, 1, 8], [2.0, 1.0, 1.5])  # unsorted, and a noisy dip at 8
    assert cost.tokens == [1, 4, 8] and cost.seconds == [1.0, 2.0, 2.0]
    assert cost(2) == pytest.approx(1 + 1 / 3)
    assert cost(16) == pytest.approx(2.0)  # flat last segment extrapolates flat
    assert CostModel([1, 2], [1.0, 2.0])(4) == pytest.approx(4.0)


def test_a_profiled_cost_table_learns_the_steps_overhead_and_keeps_the_forwards_slope():
    """Real steps cost the forward plus what does not grow with the drafts (the host's work, a
    busy machine): the learnt model converges to it, and a draft row still costs what the
    profiled forward says; a given table stays as given."""
    profile = [0.01, 0.02, 0.1]
    true = lambda n: CostModel([1, 8, 64], profile)(n) + 0.015  # noqa: E731
    learnt = CostModel([1, 8, 64], profile, learn=True)
    fixed = CostModel([1, 8, 64], profile)
    g = torch.Generator().manual_seed(0)
    noise = torch.rand(400, generator=g).mul(0.004).sub(0.002).tolist()
    for n, e in zip(torch.randint(1, 80, (400,), generator=g).tolist(), noise):
        learnt.observe(n, true(n) + e)
        fixed.observe(n, true(n) + e)
    for n in (1, 4, 8, 30, 64, 100):
        assert learnt(n) == pytest.approx(true(n), rel=0.1)
    assert learnt(30) - learnt(20) == pytest.approx(fixed(30) - fixed(20))  # the forward's slope
    assert fixed.seconds == profile and fixed.overhead == 0.0
    learnt.observe(8, 1e-6)  # a step far cheaper than the table: the cost stays positive
    assert learnt(1) > 0


def test_one_outlier_step_moves_the_overhead_by_at_most_its_tables_cost():
    """A step that took a second (a graph compiled for a new shape) must not price the next
    steps' draft rows as free: its excess counts at most the table's own cost."""
    learnt = CostModel([1, 8, 64], [0.01, 0.02, 0.1], learn=True)
    for _ in range(50):
        learnt.observe(8, 0.025)
    before = learnt.overhead
    learnt.observe(8, 1.0)
    assert learnt.overhead <= before + 0.2 * (0.02 - before) + 1e-12
    assert learnt.overhead < 0.01


def test_profile_times_every_grid_size_and_keeps_the_fastest_run(tiny_llama, monkeypatch):
    """A fake clock: a forward over n tokens costs 1 ms per token, plus 1 s on the first run of each
    size (a cold cache). The profile must time each size of its grid and keep its best run."""
    from types import SimpleNamespace

    from verispec.spec_decode import cost as cost_mod

    model = LLM(tiny_llama).engine.runner.model
    clock, seen = [0.0], set()

    class Timed:
        cfg, dtype = model.cfg, model.dtype

        def __call__(self, ids, *args):
            clock[0] += 1e-3 * len(ids) + (0.0 if len(ids) in seen else 1.0)
            seen.add(len(ids))
            return model(ids, *args)

        compute_logits = staticmethod(model.compute_logits)
        new_kv_cache = staticmethod(model.new_kv_cache)

    monkeypatch.setattr(cost_mod, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    cost = CostModel.profile(Timed(), block_size=16, max_tokens=40, device=torch.device("cpu"))
    # The doubling grid, and one past each power of two from 4: the first row of a new tile.
    assert cost.tokens == [1, 2, 4, 5, 8, 9, 16, 17, 32, 33, 40] and cost.learn
    assert cost.seconds == pytest.approx([1e-3 * n for n in cost.tokens])


def test_the_drafting_is_learnt_apart_from_the_overhead_and_charged_to_every_budget_but_none():
    """A drafter that costs 3 ms a step where a draft row costs 0.1 ms: the learnt model holds
    both, and a draft worth 0.3 tokens (10% of a 10 ms step would repay 0.1 tokens) no longer
    pays once drafting is counted."""
    from verispec.spec_decode.budget import best_prefix

    learnt = CostModel([1, 2, 8], [0.010, 0.0101, 0.0106], learn=True)
    assert best_prefix([0.3], 1, 1, learnt) == 1  # nothing known of the drafting yet
    learnt.observe(2, 0.0101 + 0.001 + 0.003, drafting=0.003)  # the first measure stands alone
    assert learnt.drafting == pytest.approx(0.003)
    for _ in range(30):
        learnt.observe(1, 0.011)  # steps that did not draft leave it as it was
        learnt.observe(2, 0.0101 + 0.001 + 0.004, drafting=0.004)
    assert learnt.drafting == pytest.approx(0.004, rel=0.01)
    assert learnt.overhead == pytest.approx(0.001, rel=0.05)  # the drafting is not overhead
    assert best_prefix([0.3], 1, 1, learnt) == 0  # 1.3 / 16.1 ms < 1 / 11 ms
    assert best_prefix([0.9, 0.8], 1, 1, learnt) == 2  # 2.7 / 16.2 ms > 1 / 11 ms
    given = CostModel([1, 2, 8], [0.010, 0.0101, 0.0106])
    given.observe(2, 0.02, drafting=0.004)  # a table the user gives is kept as given
    assert given.drafting == 0 and best_prefix([0.3], 1, 1, given) == 1


def test_draft_rows_are_priced_against_a_base_measured_lately():
    """A step's cost grows with its contexts: an extra is learnt only within RECENT_BASE steps of a
    measure of its base, so a long drafting streak does not price rows by an old, cheaper base."""
    from verispec.spec_decode.cost import RECENT_BASE

    learnt = CostModel([1, 2, 8], [0.010, 0.012, 0.024], learn=True)
    learnt.observe(1, 0.010)  # a one-token step, no drafts
    learnt.observe(3, 0.015, num_drafts=2)  # soon after: 5 ms for two rows
    assert float(learnt.step_costs(1, [2])[0]) == pytest.approx(0.015)
    for _ in range(3 * RECENT_BASE):
        learnt.observe(3, 0.030, num_drafts=2)  # longer contexts, drafting all along
    # Only the drafting steps within RECENT_BASE steps of the base taught the extra.
    assert learnt._extras[(1, 2)][1] == RECENT_BASE - 1
    learnt.observe(1, 0.025)  # the base again, at the long context
    learnt.observe(3, 0.030, num_drafts=2)
    assert learnt._extras[(1, 2)][1] == RECENT_BASE  # learnt again against it
