"""Sampling from processed logits: greedy argmax, or a seeded draw per request.

A random row draws by inverse CDF: the first token whose cumulative probability (float64 sums, in
vocabulary order) exceeds u times the row's total, u ~ U(0, 1) from the row's key. Each row's u is
keyed by its request's seed and the position it emits (sample/noise.py), so a seeded request gets
the same tokens whatever else shares the batch, whatever drafts it verifies and however often it
is preempted. One uniform per row: an exponential race (argmax p / E) needs a vocabulary's worth
of Exp(1) noise per row, which cost 1 ms a row on a CPU (49152 entries), more than the row's logits.
"""

from __future__ import annotations

import torch

from verispec.device_copy import to_device
from verispec.sample.metadata import SamplingMetadata
from verispec.sample.noise import uniform_values


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[N] int64: a draw from each row of non-negative `weights` [N, V] (unnormalised; zeros are
    never drawn) by its own u [N] (float64, in (0, 1))."""
    cdf = weights.double().cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_max(weights.shape[-1] - 1)


def sample(processed: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Token ids [R] (int64, on the device)."""
    tokens = processed.argmax(dim=-1)
    random_rows = [i for i, g in enumerate(md.greedy) if not g]
    if not random_rows:
        return tokens
    idx = to_device(random_rows, dtype=torch.long, device=processed.device)
    probs = processed[idx].softmax(dim=-1)  # masked (-inf) entries have p = 0: never drawn
    drawn = inverse_cdf(probs, uniform_values([md.rows[i].noise_key() for i in random_rows], processed.device))
    return tokens.index_copy(0, idx, drawn)
