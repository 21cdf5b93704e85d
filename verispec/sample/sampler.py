"""Sampling from processed logits: greedy argmax, or a seeded draw per request.

A random row draws by inverse CDF: the first token whose cumulative probability (float64 sums, in
vocabulary order, in two levels of blocks) exceeds u times the row's total, u ~ U(0, 1) from the
row's key. Each row's u is keyed by its request's seed and the position it emits (sample/noise.py),
so a seeded request gets the same tokens whatever else shares the batch, whatever drafts it verifies
and however often it is preempted. One uniform per row: an exponential race (argmax p / E) needs a
vocabulary's worth of Exp(1) noise per row, which cost 1 ms a row on a CPU (49152 entries), more
than the row's logits.
"""

from __future__ import annotations

import torch

from verispec.device_copy import to_device
from verispec.sample.metadata import SamplingMetadata
from verispec.sample.noise import uniform_values


# Columns per block of the two-level inverse CDF: 48 blocks for a 49152-token vocabulary.
CDF_BLOCK = 1024
# A block's sum is taken in float32 over parts of this many columns (vectorised; a sum with a
# float64 accumulator is not, and took 10x as long), then in float64 over the parts.
CDF_PART = 64


def _block_sums(weights: torch.Tensor) -> torch.Tensor:
    """[N, ceil(V / CDF_BLOCK)] float64 sums of each block of columns (the last one may be short)."""
    n, v = weights.shape
    full = v - v % CDF_BLOCK
    sums = []
    if full:
        parts = weights[:, :full].reshape(n, -1, CDF_PART).sum(dim=-1).double()
        sums.append(parts.reshape(n, -1, CDF_BLOCK // CDF_PART).sum(dim=-1))
    if full < v:
        sums.append(weights[:, full:].double().sum(dim=-1, keepdim=True))
    return torch.cat(sums, dim=1)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[N] int64: a draw from each row of non-negative `weights` [N, V] (unnormalised; zeros are
    never drawn) by its own u [N] (float64, in (0, 1)).

    In two levels, so no [N, V] float64 array is made (a step of 32 rows spent 3-10 ms building
    and summing one, mostly in fresh pages): u picks a block of CDF_BLOCK columns by the blocks'
    sums (float32 over parts of CDF_PART columns: a part's relative error is about 4e-7, the
    order of the float32 probabilities' own), and what is left of u within that block picks the
    column by the block's float64 cumulative sums. The block's share of u is clamped below 1, so
    a rounding difference between a block's sum and its cumulative sums can never step past its
    last non-zero weight."""
    v = weights.shape[1]
    block_cdf = _block_sums(weights).cumsum(dim=1)  # [N, blocks]
    target = u * block_cdf[:, -1]
    block = torch.searchsorted(block_cdf, target[:, None], right=True).clamp_max(block_cdf.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_min(0)), 0.0)[:, 0]
    mass = block_cdf.gather(1, block)[:, 0] - before
    share = ((target - before) / mass).clamp(0.0, 1.0 - 2.0**-53)
    cols = block * CDF_BLOCK + torch.arange(CDF_BLOCK, device=weights.device)  # [N, CDF_BLOCK]
    inner = weights.gather(1, cols.clamp_max(v - 1)).double().masked_fill(cols >= v, 0.0).cumsum(dim=1)
    pos = torch.searchsorted(inner, (share * inner[:, -1])[:, None], right=True).clamp_max(CDF_BLOCK - 1)
    return (block * CDF_BLOCK + pos)[:, 0]


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
