"""The admission of drafted slots: capacities are prefixes of each request's drafts that fill the
budget with its best scores, and the host twin ranks as the device does."""

from __future__ import annotations

import pytest
import torch

from verispec.spec_decode.admission import admission_order, admit, slot_counts


def survival_rows(rows: int, width: int, seed: int) -> tuple[torch.Tensor, list[list[float]]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (rows,), generator=g).tolist()
    conf = torch.rand(rows, width, generator=g)
    conf[conf < 0.2] = 1.0  # repeated scores along a request: ties
    scores = torch.full((rows, width), float("-inf"))
    host = []
    for i, n in enumerate(lengths):
        scores[i, :n] = conf[i, :n].cumprod(0)
        host.append(scores[i, :n].tolist())
    return scores, host


@pytest.mark.parametrize("seed", range(6))
def test_admission_gives_prefix_capacities_that_fill_the_budget(seed):
    scores, host = survival_rows(9, 6, seed)
    total = sum(len(h) for h in host)
    for budget in range(total + 1):
        caps = admit(scores, budget)
        assert caps.sum().item() == budget
        assert caps.tolist() == slot_counts(admission_order(host), len(host), budget)
        # The admitted slots are exactly the `budget` best scores (up to ties at the threshold).
        admitted = sorted((s for h, c in zip(host, caps.tolist()) for s in h[:c]), reverse=True)
        assert admitted == sorted((s for h in host for s in h), reverse=True)[:budget]


def test_admission_never_admits_a_later_slot_of_a_tied_request_first():
    # All scores 1.0: ties everywhere; capacities must still be prefixes of the drafts present.
    scores = torch.tensor([[1.0, 1.0, float("-inf")], [1.0, 1.0, 1.0]])
    for budget in range(6):
        caps = admit(scores, budget).tolist()
        assert sum(caps) == budget and caps[0] <= 2
