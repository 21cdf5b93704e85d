"""Verification of draft tokens, entirely on the device.

Layout: R requests, K = the longest draft this step. Row j of request i is the target's processed
distribution p_j after the request's tokens plus drafts 1..j; drafts past num_drafts[i] are padding.

- **Greedy** rows accept draft x_j iff x_j == argmax p_j; the first mismatch emits argmax p_j; if
  every draft is accepted, the bonus is argmax of the row after the last draft.
- **Random rows, one-hot drafts** (ngram, greedy-path suffix drafts, or any drafter without
  probabilities): the row's *winner* is the draw from p_j with the uniform u_t that plain sampling
  uses at that position t (sample/sampler.py's inverse CDF, sample/noise.py's keys). Draft x_j is
  accepted iff it is the winner; the first rejection emits the winner, and so does the bonus row.
  This is the rejection rule of the design notes (accept x with probability p(x) for q one-hot; on
  rejection draw from p with x removed): the draw is x with probability p(x), and, given that it
  is not, it is distributed as p without x. One draw realises both the test and the residual draw,
  so the emitted token at every position is exactly the token non-speculative sampling would emit
  there: seeded output is the same with or without drafts, whatever the batch or preemption.
- **Random rows, drafts with probabilities q** (layer_skip, draft_model, suffix): accept x_j iff
  u_j * q_j(x_j) <= p_j(x_j), u ~ U(0,1) in float64 (a zero q(x) always rejects); the first
  rejection emits a draw from norm(max(p - q, 0)); the bonus is the row's winner. The test, the
  residual draw and the winner use independent keyed streams (accept / recover / sample).

The work is split in two so that verification can run in chunks of rows:
`row_outcomes` needs nothing but the row itself (its p, its draft, its q row and its noise), so any
cut of the rows, even one through a request, gives the same result; `assemble` then finds each
request's leading run of accepts over all rows at once. Rows are *compact*: request i owns rows
cu[i] .. cu[i+1]-1, row j verifying draft j and the last one being the bonus row, with the
boundaries possibly known only on the device (adaptive verification).

Nothing here reads a device value on the host: all candidates are computed up front and the outcome
is assembled with tensor ops.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from verispec.device_copy import to_device
from verispec.sample.metadata import RowSpec
from verispec.sample.noise import uniform_values
from verispec.sample.sampler import inverse_cdf


@dataclass(slots=True)
class VerifyOutput:
    sampled: torch.Tensor  # [R, K+1] int64 output tokens (accepted drafts, then one recovered or bonus), -1 padded
    num_sampled: torch.Tensor  # [R] int64, 1 + number of accepted drafts


@dataclass(slots=True)
class RowOutcome:
    accept: torch.Tensor  # [N] bool: the row's draft passes its test (False on bonus rows)
    emit: torch.Tensor  # [N] int64: the recovered or bonus token, if the row is its request's first non-accept
    selected: torch.Tensor  # [N] int64: the token the row emits, whichever way (its logprob's token)


@dataclass(slots=True)
class SparseQ:
    """A host drafter's q rows (suffix decoding: a branch's children and their shares) as each
    row's few (token, probability) pairs, [N, m] padded with probability 0 at token 0. The q rule
    then touches m entries a row instead of a dense [N, V] q: the same numbers, bitwise, as the
    dense rows (`residual_` and `at` say why), for a fraction of the work."""

    ids: torch.Tensor  # [N, m] int64
    probs: torch.Tensor  # [N, m] float32

    @classmethod
    def build(cls, rows: list[tuple[list[int], list[float]]], device: torch.device) -> "SparseQ":
        width = max(1, max(len(ids) for ids, _ in rows))
        ids = [list(i) + [0] * (width - len(i)) for i, _ in rows]
        probs = [list(p) + [0.0] * (width - len(p)) for _, p in rows]
        return cls(to_device(ids, dtype=torch.long, device=device), to_device(probs, dtype=torch.float32, device=device))

    def at(self, tokens: torch.Tensor) -> torch.Tensor:
        """q(token) per row, float64 ([N, 1] tokens): the one matching entry plus zeros, exact."""
        return torch.where(self.ids == tokens, self.probs, 0.0).sum(dim=-1).double()

    def dense(self, vocab: int) -> torch.Tensor:
        """The [N, V] rows (a step that also holds a model drafter's dense q)."""
        out = torch.zeros(self.ids.shape[0], vocab, device=self.ids.device)
        return out.scatter_add_(1, self.ids, self.probs)  # padding adds 0.0 to token 0

    def residual_(self, probs: torch.Tensor, recover: torch.Tensor) -> torch.Tensor:
        """`recovery_weights(probs, dense q, recover)` written into `probs`: p - q, then clamped at
        0, only where q has entries. p + (-q * r) is the dense p - q * r for r in {0, 1}, and the
        padding adds -0.0, so the result is the dense one bit for bit."""
        probs.scatter_add_(1, self.ids, self.probs * -recover[:, None].to(probs.dtype))
        return probs.scatter_(1, self.ids, probs.gather(1, self.ids).clamp_min_(0.0))

    def select(self, index: torch.Tensor) -> "SparseQ":
        return SparseQ(self.ids[index], self.probs[index])


@dataclass(slots=True)
class RowDraws:
    """What each candidate row's test and draws need beyond its logits, built on the host from
    the rows' noise keys (`RowSpec.noise_key`, the one place keys are made)."""

    greedy: torch.Tensor | None  # [N] bool; None: every row is greedy
    sample_u: torch.Tensor | None  # [N] float64 U(0,1) `sample` draws (1.0 on greedy rows); None: all greedy
    # [N, V] draft probabilities (zeros where unused), or a host drafter's sparse rows; None: all one-hot
    q: torch.Tensor | SparseQ | None = None
    uses_q: torch.Tensor | None = None  # [N] bool: the row verifies a q-draft of a random request
    accept_u: torch.Tensor | None = None  # [N] float64 U(0,1) `accept` draws
    recover_u: torch.Tensor | None = None  # [N] float64 U(0,1) `recover` draws
    # Host-side: some row is greedy (False lets verification skip the argmax over every row).
    any_greedy: bool = True

    @classmethod
    def build(cls, rows: list[list[RowSpec]], q: list[torch.Tensor | list[tuple[list[int], list[float]]] | None],
              vocab: int, device: torch.device) -> "RowDraws":
        """rows[i]: request i's candidate rows (one per draft, then the bonus); q[i]: its drafts'
        q rows, [d_i, V] on the device (a model drafter) or (token ids, probabilities) per draft
        (a host drafter), or None for one-hot drafts."""
        flat = [spec for group in rows for spec in group]
        greedy = [spec.params.greedy for spec in flat]
        if all(greedy):
            return cls(greedy=None, sample_u=None)  # greedy requests have no q rule either
        draws = cls(greedy=to_device(greedy, dtype=torch.bool, device=device),
                    sample_u=uniform_values([spec.noise_key("sample") for spec in flat], device),
                    any_greedy=any(greedy))
        with_q = [x is not None and not group[0].params.greedy for x, group in zip(q, rows)]
        if not any(with_q):
            return draws
        # Only a q-draft's own row draws `accept` and `recover`; bonus rows and one-hot requests do not.
        uses = [has and j < len(group) - 1 for has, group in zip(with_q, rows) for j in range(len(group))]
        draws.q = _q_rows(q, with_q, rows, vocab, device)
        draws.uses_q = to_device(uses, dtype=torch.bool, device=device)
        draws.accept_u = uniform_values([s.noise_key("accept") if u else None for s, u in zip(flat, uses)], device)
        draws.recover_u = uniform_values([s.noise_key("recover") if u else None for s, u in zip(flat, uses)], device)
        return draws

    def select(self, index: torch.Tensor) -> "RowDraws":
        """The draws of candidate rows `index` (a device tensor)."""
        pick = lambda t: None if t is None else t.select(index) if isinstance(t, SparseQ) else t[index]  # noqa: E731
        return replace(self, greedy=pick(self.greedy), sample_u=pick(self.sample_u), q=pick(self.q),
                       uses_q=pick(self.uses_q), accept_u=pick(self.accept_u), recover_u=pick(self.recover_u))


def _q_rows(q: list, with_q: list[bool], rows: list[list[RowSpec]], vocab: int,
            device: torch.device) -> torch.Tensor | SparseQ:
    """Every candidate row's q: sparse where every q is a host drafter's, else dense [N, V] (zeros
    on the bonus rows and on requests without q)."""
    if not any(isinstance(x, torch.Tensor) for x, has in zip(q, with_q) if has):
        none: tuple[list[int], list[float]] = ([], [])
        return SparseQ.build([pair for x, has, group in zip(q, with_q, rows)
                              for pair in ([*x, none] if has else [none] * len(group))], device)
    blocks = []
    for x, has, group in zip(q, with_q, rows):
        if has and not isinstance(x, torch.Tensor):  # host rows beside a model drafter's: one step never has both
            x = SparseQ.build(x, device).dense(vocab)
        blocks.append(torch.cat([x, x.new_zeros(1, vocab)]) if has else torch.zeros(len(group), vocab, device=device))
    return torch.cat(blocks)


def recovery_weights(probs: torch.Tensor, q: torch.Tensor, recover: torch.Tensor) -> torch.Tensor:
    """Unnormalised max(p - q, 0) on the rows that `recover` (a rejected q-draft's residual), p
    exactly elsewhere, in one pass over [N, V]: p - q * 0 is p."""
    return torch.addcmul(probs, q, recover[:, None].to(probs.dtype), value=-1.0).clamp_min_(0.0)


def row_outcomes(
    processed: torch.Tensor,  # [N, V] processed target logits
    drafts: torch.Tensor,  # [N] the draft each row verifies (PLACEHOLDER -1 on bonus rows past the drafts)
    is_bonus: torch.Tensor,  # [N] bool
    draws: RowDraws,  # the rows' own draws
) -> RowOutcome:
    """Per-row verification statistics; rows are independent of each other. A random row makes
    one draw: from the residual max(p - q, 0) where it tests a q-draft (its recovered token), from
    p otherwise (its sample: the one-hot test's winner, or its bonus token)."""
    if draws.sample_u is None:  # every row greedy (so no q rule either)
        winners = processed.argmax(dim=-1)
        return _outcome(drafts == winners, winners, drafts, is_bonus)
    probs = processed.softmax(dim=-1)
    if draws.q is None:
        winners = _with_greedy(processed, draws, inverse_cdf(probs, draws.sample_u))
        return _outcome(drafts == winners, winners, drafts, is_bonus)
    index = drafts.clamp_min(0)[:, None]  # a bonus row's placeholder is never tested
    recover = draws.uses_q & ~is_bonus
    p_draft = probs.gather(-1, index).squeeze(-1).double()  # before a sparse q's residual overwrites probs
    if isinstance(draws.q, SparseQ):
        q_draft, weights = draws.q.at(index), draws.q.residual_(probs, recover)
    else:
        q_draft, weights = draws.q.gather(-1, index).squeeze(-1).double(), recovery_weights(probs, draws.q, recover)
    drawn = inverse_cdf(weights, torch.where(recover, draws.recover_u, draws.sample_u))
    winners = _with_greedy(processed, draws, drawn)  # on a row that tests a q-draft, its recovered token
    accept_q = (draws.accept_u * q_draft <= p_draft) & (q_draft > 0)
    return _outcome(torch.where(draws.uses_q, accept_q, drafts == winners), winners, drafts, is_bonus)


def _with_greedy(processed: torch.Tensor, draws: RowDraws, drawn: torch.Tensor) -> torch.Tensor:
    """The greedy rows' argmax in place of their draw; no argmax at all where no row is greedy."""
    return torch.where(draws.greedy, processed.argmax(dim=-1), drawn) if draws.any_greedy else drawn


def _outcome(accept: torch.Tensor, emit: torch.Tensor, drafts: torch.Tensor, is_bonus: torch.Tensor) -> RowOutcome:
    accept = accept & ~is_bonus  # a bonus row has no draft to accept
    return RowOutcome(accept=accept, emit=emit, selected=torch.where(accept, drafts, emit))


def assemble(selected: torch.Tensor, accept: torch.Tensor, row_req: torch.Tensor, row_j: torch.Tensor,
             num_reqs: int, width: int) -> VerifyOutput:
    """Per-request outcome from per-row results: the leading run of accepts, the drafts it
    keeps, and the token of the first non-accepted row (a replacement or the bonus)."""
    if width == 1:  # no drafts in the step: row i is request i's bonus row
        return VerifyOutput(sampled=selected[:, None], num_sampled=torch.ones_like(selected))
    accepted = torch.zeros(num_reqs, width, dtype=torch.long, device=selected.device)
    accepted.index_put_((row_req, row_j), accept.long())
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)  # [R]; a bonus row is never accepted
    tokens = torch.full((num_reqs, width), -1, dtype=torch.long, device=selected.device)
    tokens.index_put_((row_req, row_j), selected)
    keep = torch.arange(width, device=selected.device)[None, :] <= num_accepted[:, None]
    sampled = torch.where(keep, tokens, torch.full_like(tokens, -1))
    return VerifyOutput(sampled=sampled, num_sampled=num_accepted + 1)
