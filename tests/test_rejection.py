"""The verification rules of verispec/spec_decode/rejection.py on hand-built rows: the residual
distribution, each row's outcome under the greedy, one-hot and q rules (with its draws set by hand,
so the expected answer is computed here independently), and the assembly of per-row results into
each request's accepted run."""

from __future__ import annotations

import torch

from verispec.spec_decode.rejection import RowDraws, SparseQ, assemble, recovery_weights, row_outcomes

NO_BONUS = torch.tensor([False, False])


def test_recovery_weights_are_the_positive_part_of_p_minus_q_on_recovering_rows_and_p_bit_for_bit_elsewhere():
    p = torch.softmax(torch.randn(3, 7, generator=torch.Generator().manual_seed(0)), -1)
    q = torch.softmax(torch.randn(3, 7, generator=torch.Generator().manual_seed(1)), -1)
    out = recovery_weights(p.clone(), q, torch.tensor([True, False, True]))
    assert torch.equal(out[[0, 2]], (p[[0, 2]] - q[[0, 2]]).clamp_min(0.0))
    assert torch.equal(out[1], p[1])  # a bonus row or one-hot draft draws from p itself, unchanged


def test_greedy_rows_accept_the_argmax_and_emit_it_otherwise():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    out = row_outcomes(logits, torch.tensor([1, 2]), NO_BONUS, RowDraws(greedy=None, sample_u=None))
    assert out.accept.tolist() == [True, False] and out.emit.tolist() == [1, 0] and out.selected.tolist() == [1, 0]


def test_a_bonus_row_is_never_accepted():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    out = row_outcomes(logits, torch.tensor([1]), torch.tensor([True]), RowDraws(greedy=None, sample_u=None))
    assert out.accept.tolist() == [False] and out.selected.tolist() == [1]  # it emits its own winner


def test_one_hot_random_rows_accept_exactly_the_drawn_winner():
    logits = torch.zeros(2, 4)  # uniform p: u alone picks the winner, by inverse CDF
    u = torch.tensor([0.6, 0.1], dtype=torch.float64)  # winners: 2 (0.5 <= 0.6 < 0.75) and 0
    draws = RowDraws(greedy=torch.tensor([False, False]), sample_u=u)
    out = row_outcomes(logits, torch.tensor([2, 3]), NO_BONUS, draws)
    assert out.accept.tolist() == [True, False] and out.selected.tolist() == [2, 0]


def test_q_rows_accept_when_u_times_q_is_at_most_p_else_draw_from_the_residual():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.5, 0.25, 0.25]]))
    q = torch.tensor([[0.25, 0.5, 0.25], [0.25, 0.5, 0.25]])  # draft 1 in both rows: p/q = 0.5
    draws = RowDraws(greedy=torch.tensor([False, False]), sample_u=torch.full((2,), 0.5, dtype=torch.float64), q=q,
                     uses_q=torch.tensor([True, True]), accept_u=torch.tensor([0.4, 0.6], dtype=torch.float64),
                     recover_u=torch.full((2,), 0.5, dtype=torch.float64))
    out = row_outcomes(logits, torch.tensor([1, 1]), NO_BONUS, draws)
    assert out.accept.tolist() == [True, False]  # 0.4 * 0.5 <= 0.25 < 0.6 * 0.5
    assert out.selected[1].item() == 0  # max(p - q, 0) = [0.25, 0, 0]: only token 0 can be drawn


def test_a_zero_q_always_rejects():
    logits = torch.zeros(1, 3)
    draws = RowDraws(greedy=torch.tensor([False]), sample_u=torch.full((1,), 0.5, dtype=torch.float64), q=torch.tensor([[0.5, 0.0, 0.5]]),
                     uses_q=torch.tensor([True]), accept_u=torch.tensor([0.0], dtype=torch.float64),
                     recover_u=torch.full((1,), 0.5, dtype=torch.float64))
    assert row_outcomes(logits, torch.tensor([1]), torch.tensor([False]), draws).accept.tolist() == [False]


def test_assemble_keeps_the_leading_run_of_accepts_then_one_token():
    # Request 0: rows j=0..2 (two drafts + bonus), accepts [T, F]; request 1: rows j=0..1, accepts [T].
    selected = torch.tensor([10, 11, 12, 20, 21])
    accept = torch.tensor([True, False, False, True, False])
    row_req, row_j = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([0, 1, 2, 0, 1])
    out = assemble(selected, accept, row_req, row_j, num_reqs=2, width=3)
    assert out.num_sampled.tolist() == [2, 2]
    assert out.sampled.tolist() == [[10, 11, -1], [20, 21, -1]]


def test_a_later_accept_after_a_rejection_does_not_count():
    selected, accept = torch.tensor([1, 2, 3]), torch.tensor([False, True, False])
    out = assemble(selected, accept, torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2]), num_reqs=1, width=3)
    assert out.num_sampled.tolist() == [1] and out.sampled.tolist() == [[1, -1, -1]]


def test_without_drafts_every_row_is_its_requests_one_token():
    out = assemble(torch.tensor([4, 5]), torch.tensor([False, False]), torch.tensor([0, 1]), torch.tensor([0, 0]), 2, 1)
    assert out.sampled.tolist() == [[4], [5]] and out.num_sampled.tolist() == [1, 1]


def test_a_sparse_q_verifies_bit_for_bit_as_its_dense_rows():
    """A host drafter's q as (token, probability) pairs gives the dense q rule's residual, accepts
    and tokens exactly: rows with and without q, drafts inside and outside q's support, a bonus
    row, supports of different sizes (padding), token 0 inside one support."""
    gen = torch.Generator().manual_seed(3)
    vocab, n = 64, 40
    logits = torch.randn(n, vocab, generator=gen)
    ids, probs = [], []
    for r in range(n):
        size = r % 5  # 0: a row without q (a bonus row, or another request's)
        support = torch.randperm(vocab, generator=gen)[:size].tolist()
        if r % 7 == 1 and size:
            support[0] = 0  # token 0 is also the padding's token
        share = torch.rand(size, generator=gen)
        ids.append(support)
        probs.append((share / share.sum()).tolist() if size else [])
        logits[r, support] += 4.0  # p agrees with q often enough that some drafts pass
    sparse = SparseQ.build(list(zip(ids, probs)), torch.device("cpu"))
    dense = sparse.dense(vocab)
    assert torch.equal((dense > 0).sum(-1), torch.tensor([len(i) for i in ids]))
    uses = torch.tensor([len(i) > 0 for i in ids])
    is_bonus = torch.tensor([r % 11 == 10 for r in range(n)]) & ~uses
    drafts = torch.tensor([i[r % len(i)] if i and r % 3 else int(torch.randint(vocab, (1,), generator=gen))
                           for r, i in enumerate(ids)])
    u = lambda: torch.rand(n, dtype=torch.float64, generator=gen)  # noqa: E731
    kw = dict(greedy=torch.zeros(n, dtype=torch.bool), sample_u=u(), uses_q=uses, accept_u=u(), recover_u=u(),
              any_greedy=False)
    recover = uses & ~is_bonus
    p = logits.softmax(-1)
    assert torch.equal(sparse.residual_(p.clone(), recover), recovery_weights(p.clone(), dense, recover))
    assert torch.equal(sparse.at(drafts[:, None]), dense.gather(-1, drafts[:, None]).squeeze(-1).double())
    a = row_outcomes(logits, drafts, is_bonus, RowDraws(q=sparse, **kw))
    b = row_outcomes(logits, drafts, is_bonus, RowDraws(q=dense, **kw))
    assert torch.equal(a.accept, b.accept) and torch.equal(a.selected, b.selected)
    assert a.accept.any() and not a.accept.all()  # both outcomes occur: the comparison saw each
    half = torch.arange(0, n, 2)
    assert torch.equal(RowDraws(q=sparse, **kw).select(half).q.dense(vocab), dense[half])
