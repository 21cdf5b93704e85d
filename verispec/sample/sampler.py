"""Sampling from processed logits: greedy argmax, or a seeded draw per request.

A random row draws by the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. is an exact
sample from p. Each row's noise is keyed by its request's seed and the position it emits
(sample/noise.py), so a seeded request gets the same tokens whatever else shares the batch,
whatever drafts it verifies and however often it is preempted.
"""

from __future__ import annotations

import torch

from verispec.device_copy import to_device
from verispec.sample.metadata import SamplingMetadata
from verispec.sample.noise import exponential_rows


def sample(processed: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Token ids [R] (int64, on the device)."""
    tokens = processed.argmax(dim=-1)
    random_rows = [i for i, g in enumerate(md.greedy) if not g]
    if not random_rows:
        return tokens
    idx = to_device(random_rows, dtype=torch.long, device=processed.device)
    probs = processed[idx].softmax(dim=-1)
    noise = exponential_rows([md.rows[i].noise_key() for i in random_rows], processed.shape[1], processed.device)
    # Masked (-inf) entries have p = 0 and can never win the race.
    drawn = (probs / noise).argmax(dim=-1)
    return tokens.index_copy(0, idx, drawn)
