"""Logprob scores on the device: the sampled (or actual) token, top-k or custom ids, and ranks.

`compute_topk_scores` gathers first and casts after: the only [R, V]-sized work is the max, the
chunked log-sum-exp, the top-k selection and the rank comparison, all on the scores as they are,
never a full fp32 copy made just to gather from it.
"""

from __future__ import annotations

import torch

from verispec.outputs import LogprobsTensors

# Columns per chunk of the streaming log-sum-exp: keeps its temporaries to [R, 8192].
LSE_CHUNK = 8192


def streaming_logsumexp(scores: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(scores))) per row in fp32, one vocab chunk at a time."""
    m = scores.amax(dim=-1).float()
    # A row of all -inf has no mass; keep it -inf instead of producing NaN.
    safe_m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = torch.zeros_like(m)
    for c in range(0, scores.shape[1], LSE_CHUNK):
        total += (scores[:, c : c + LSE_CHUNK].float() - safe_m[:, None]).exp().sum(dim=-1)
    return safe_m + total.log()


def compute_topk_scores(
    scores: torch.Tensor,
    num_topk: int,
    selected: torch.Tensor,
    custom_ids: torch.Tensor | None = None,
    as_logprobs: bool = True,
) -> LogprobsTensors:
    """Scores for `selected` [R] plus the top `num_topk` (or `custom_ids` [R, C]) per row.

    as_logprobs=False returns the scores themselves (logits modes). Ranks count the vocab entries
    whose score is >= the selected token's score (1-based); log-softmax is monotone per row, so
    counting on the logits gives the rank of the returned logprobs.
    """
    selected = selected.long()[:, None]
    chosen = scores.gather(1, selected)
    ranks = (scores >= chosen).sum(dim=-1)
    if custom_ids is not None:
        ids = custom_ids.long()
        vals = scores.gather(1, ids)
    elif num_topk > 0:
        vals, ids = scores.topk(min(num_topk, scores.shape[1]), dim=-1)
    else:
        ids = selected[:, :0]
        vals = chosen[:, :0]
    token_ids = torch.cat([selected, ids], dim=1)
    values = torch.cat([chosen, vals], dim=1).float()
    if as_logprobs:
        values = values - streaming_logsumexp(scores)[:, None]
    return LogprobsTensors(logprob_token_ids=token_ids, logprobs=values, selected_token_ranks=ranks)
