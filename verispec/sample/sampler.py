"""Sampling from processed logits: greedy argmax, or a seeded draw per request.

A random row draws by the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. is an exact
sample from p, and each row's noise comes from its own request's generator, so a seeded request
gets the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import torch

from verispec.sample.metadata import SamplingMetadata


def exponential_noise(shape_row: int, generators: list[torch.Generator | None], device) -> torch.Tensor:
    """[len(generators), shape_row] Exp(1) noise, row i from generators[i].

    A None generator marks a row that is never sampled (a greedy row): it gets ones, and no
    stream is advanced for it."""
    noise = torch.empty(len(generators), shape_row, device=device)
    for i, gen in enumerate(generators):
        if gen is None:
            noise[i].fill_(1.0)
        else:
            noise[i].exponential_(generator=gen)
    return noise


def sample(processed: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Token ids [R] (int64, on the device)."""
    tokens = processed.argmax(dim=-1)
    random_rows = [i for i, g in enumerate(md.greedy) if not g]
    if not random_rows:
        return tokens
    idx = torch.tensor(random_rows, dtype=torch.long, device=processed.device)
    probs = processed[idx].softmax(dim=-1)
    noise = exponential_noise(processed.shape[1], [md.rows[i].generator for i in random_rows], processed.device)
    # Masked (-inf) entries have p = 0 and can never win the race.
    drawn = (probs / noise).argmax(dim=-1)
    return tokens.index_copy(0, idx, drawn)
