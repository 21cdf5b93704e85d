"""Verification of draft tokens, entirely on the device.

Layout: R requests, K = the longest draft this step. Row j of request i is the target's processed
distribution p_j after the request's tokens plus drafts 1..j; drafts past num_drafts[i] are padding.

- **Greedy** rows accept draft x_j iff x_j == argmax p_j; the first mismatch emits argmax p_j; if
  every draft is accepted, the bonus is argmax of the row after the last draft.
- **Random rows, one-hot drafts** (ngram, or any drafter without probabilities): the row's
  *winner* is the exponential race argmax(p_j / E_t) with the noise E_t that plain sampling uses at
  that position t (sample/noise.py). Draft x_j is accepted iff it is the winner; the first
  rejection emits the winner, and so does the bonus row. This is the rejection rule of the design
  notes (accept x with probability p(x), u <= p(x) for q one-hot; on rejection draw from p with x
  removed): the race wins with x with probability p(x), and, given that it did not, its winner is
  distributed as p without x. One race realises both the test and the residual draw, so the
  emitted token at every position is exactly the token non-speculative sampling would emit there:
  seeded output is the same with or without drafts, whatever the batch or preemption.
- **Random rows, drafts with probabilities q** (layer_skip, draft_model): accept x_j iff
  u_j * q_j(x_j) <= p_j(x_j), u ~ U(0,1) in float64 (a zero q(x) always rejects); the first
  rejection emits a draw from norm(max(p - q, 0)); the bonus is the row's race winner. u, the
  residual draw and the race use independent keyed streams (accept / recover / sample).

Nothing here reads a device value on the host: all candidates are computed up front and the outcome
is assembled with tensor ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.sample.noise import RequestNoise, exponential_rows, uniform_values


@dataclass(slots=True)
class VerifyOutput:
    sampled: torch.Tensor  # [R, K+1] int64 emitted tokens, -1 padded
    num_sampled: torch.Tensor  # [R] int64, 1 + number of accepted drafts
    num_accepted: torch.Tensor  # [R] int64


def residual_distribution(
    probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None
) -> torch.Tensor:
    """Unnormalised max(p - q, 0); for one-hot q that is p with the draft token removed."""
    if draft_probs is None:
        return probs.scatter(-1, draft_tokens[..., None], 0.0)
    return (probs - draft_probs).clamp_min(0.0)


def _keys(noise: list[RequestNoise | None], first_pos: list[int], counts: list[int], purpose: str,
          width: int) -> list[int | None]:
    """Row-major [R, width] keys: row i, column j is position first_pos[i] + j; None past counts[i]
    (padding) and for greedy requests."""
    keys: list[int | None] = []
    for n, pos, c in zip(noise, first_pos, counts):
        keys.extend(n.key(purpose, pos + j) if n is not None and j < c else None for j in range(width))
    return keys


def verify(
    target_logits: torch.Tensor,  # [R, K+1, V] processed target logits
    draft_tokens: torch.Tensor,  # [R, K] int64 (padding: any valid id)
    num_drafts: list[int],  # [R] host counts
    draft_probs: torch.Tensor | None,  # [R, K, V] processed draft probabilities; None = all one-hot
    has_q: list[bool],  # [R] whether request i's drafts come with q rows
    noise: list[RequestNoise | None],  # [R] None for greedy requests
    first_pos: list[int],  # [R] sequence position that row 0 emits
) -> VerifyOutput:
    r, k1, vocab = target_logits.shape
    k = k1 - 1
    device = target_logits.device
    num_drafts_t = torch.tensor(num_drafts, dtype=torch.long, device=device)
    in_draft = torch.arange(k, device=device)[None, :] < num_drafts_t[:, None]  # [R, K]
    greedy_t = torch.tensor([n is None for n in noise], dtype=torch.bool, device=device)

    # Every real row's winner: argmax for greedy rows, the keyed race for random ones.
    probs = target_logits.softmax(dim=-1)  # [R, K+1, V]
    race = exponential_rows(_keys(noise, first_pos, [c + 1 for c in num_drafts], "sample", k1), vocab, device)
    winners = torch.where(
        greedy_t[:, None], target_logits.argmax(dim=-1), (probs / race.view(r, k1, vocab)).argmax(dim=-1)
    )  # [R, K+1]
    accept = draft_tokens == winners[:, :k]
    emit_at_reject = winners[:, :k]

    if any(has_q) and k:
        q_noise = [n if q else None for n, q in zip(noise, has_q)]
        p_draft = probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1).double()
        q_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1).double()
        u = uniform_values(_keys(q_noise, first_pos, num_drafts, "accept", k), device).view(r, k)
        accept_q = (u * q_draft <= p_draft) & (q_draft > 0)
        residual = residual_distribution(probs[:, :k], draft_tokens, draft_probs)
        recover_noise = exponential_rows(_keys(q_noise, first_pos, num_drafts, "recover", k), vocab, device)
        recovered = (residual / recover_noise.view(r, k, vocab)).argmax(dim=-1)
        uses_q = torch.tensor(has_q, dtype=torch.bool, device=device)[:, None] & ~greedy_t[:, None]
        accept = torch.where(uses_q, accept_q, accept)
        emit_at_reject = torch.where(uses_q, recovered, emit_at_reject)

    accept &= in_draft
    # Accepted drafts form a prefix: count the leading run of accepts.
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [R]
    # The token at the first non-accepted position: a rejected draft's replacement, or the bonus.
    bonus = winners.gather(1, num_accepted[:, None]).squeeze(1)
    if k:
        replaced = emit_at_reject.gather(1, num_accepted.clamp(max=k - 1)[:, None]).squeeze(1)
        final = torch.where(num_accepted < num_drafts_t, replaced, bonus)
    else:
        final = bonus

    out_pos = torch.arange(k1, device=device)[None, :]
    padded_drafts = torch.cat([draft_tokens, draft_tokens.new_zeros(r, 1)], dim=1)
    sampled = torch.where(out_pos < num_accepted[:, None], padded_drafts, torch.full_like(padded_drafts, -1))
    sampled = torch.where(out_pos == num_accepted[:, None], final[:, None], sampled)
    return VerifyOutput(sampled=sampled, num_sampled=num_accepted + 1, num_accepted=num_accepted)
