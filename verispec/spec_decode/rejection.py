"""Verification of draft tokens (rejection sampling), entirely on the device.

Layout: R requests, K = the longest draft this step. Row j of request i is the target's processed
distribution after the request's tokens plus drafts 1..j; drafts past num_drafts[i] are padding.

- Greedy rows accept draft x_j iff x_j == argmax p_{j-1}; the first mismatch emits argmax.
- Random rows accept x_j iff u_j * q_j(x_j) <= p_{j-1}(x_j), u ~ U(0,1) in float64 (q = one-hot
  when the drafter has no probabilities, so that is u <= p(x)); a zero q(x) always rejects. The
  first rejection emits a draw from norm(max(p - q, 0)).
- If every draft is accepted, the bonus token comes from the row after the last draft.

Every candidate (recovered token at each position, bonus) is drawn up front from the request's
own streams (accept / recover / sample), and the outcome is assembled with tensor ops: nothing
here reads a device value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.sample.sampler import exponential_noise


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


def verify(
    target_logits: torch.Tensor,  # [R, K+1, V] processed target logits
    draft_tokens: torch.Tensor,  # [R, K] int64 (padding: any valid id)
    num_drafts: torch.Tensor,  # [R] int64
    draft_probs: torch.Tensor | None,  # [R, K, V] processed draft probabilities; None = one-hot
    greedy: list[bool],
    accept_gens: list[torch.Generator | None],
    recover_gens: list[torch.Generator | None],
    bonus_gens: list[torch.Generator | None],
) -> VerifyOutput:
    """Generators are per request; pass None for greedy requests (no stream is advanced)."""
    r, k1, vocab = target_logits.shape
    k = k1 - 1
    device = target_logits.device
    positions = torch.arange(k, device=device)[None, :]
    in_draft = positions < num_drafts[:, None]  # [R, K]
    greedy_t = torch.tensor(greedy, dtype=torch.bool, device=device)

    target_argmax = target_logits.argmax(dim=-1)  # [R, K+1]
    probs = target_logits.softmax(dim=-1)  # [R, K+1, V]
    p_draft = probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1).double()  # [R, K]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1).double()

    uniform = torch.ones(r, k, dtype=torch.float64, device=device)
    for i, g in enumerate(accept_gens):
        if g is not None and k:
            uniform[i] = torch.rand(k, dtype=torch.float64, generator=g, device=device)
    accept_random = (uniform * q_draft <= p_draft) & (q_draft > 0)
    accept_greedy = draft_tokens == target_argmax[:, :k]
    accept = torch.where(greedy_t[:, None], accept_greedy, accept_random) & in_draft
    # Accepted drafts form a prefix: count the leading run of accepts.
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [R]

    # Recovered candidates at every draft position: the residual max(p - q, 0), renormalised
    # implicitly by the exponential race (argmax(r / E) samples from r / sum(r)).
    residual = residual_distribution(probs[:, :k], draft_tokens, draft_probs)
    recover_noise = torch.ones_like(residual)
    for i, g in enumerate(recover_gens):
        if g is not None and k:
            recover_noise[i] = exponential_noise(vocab, [g] * k, device)
    recovered = torch.where(
        greedy_t[:, None], target_argmax[:, :k], (residual / recover_noise).argmax(dim=-1)
    )  # [R, K]

    # Bonus candidate from the row after the last draft of each request.
    bonus_rows = probs.gather(1, num_drafts[:, None, None].expand(r, 1, vocab)).squeeze(1)  # [R, V]
    bonus_noise = exponential_noise(vocab, list(bonus_gens), device)
    bonus_random = (bonus_rows / bonus_noise).argmax(dim=-1)
    bonus = torch.where(greedy_t, target_argmax.gather(1, num_drafts[:, None]).squeeze(1), bonus_random)

    # Token at the first non-accepted position: recovered if it is a rejected draft, else bonus.
    rejected_at = num_accepted.clamp(max=max(k - 1, 0))
    recovered_pick = recovered.gather(1, rejected_at[:, None]).squeeze(1) if k else bonus
    final = torch.where(num_accepted < num_drafts, recovered_pick, bonus)

    out_pos = torch.arange(k1, device=device)[None, :]
    padded_drafts = torch.cat([draft_tokens, draft_tokens.new_zeros(r, 1)], dim=1)
    sampled = torch.where(out_pos < num_accepted[:, None], padded_drafts, torch.full_like(padded_drafts, -1))
    sampled = torch.where(out_pos == num_accepted[:, None], final[:, None], sampled)
    return VerifyOutput(sampled=sampled, num_sampled=num_accepted + 1, num_accepted=num_accepted)
