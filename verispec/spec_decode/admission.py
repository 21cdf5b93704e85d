"""Which drafted slots a step verifies: the ranking of slots by survival score, on the device
(`admit`, from this step's scores) and its host twin (`admission_order`, `slot_counts`), which rank
alike. Adaptive verification's budget says how many (spec_decode/adaptive.py, docs/adaptive.md)."""

from __future__ import annotations

import numpy as np
import torch


def admission_keys(scores: torch.Tensor) -> torch.Tensor:
    """[R, K] float64 keys that order the slots: the score, less a tiny penalty per position and a
    tinier one per request. Scores never rise along a request, so keys strictly fall: whether
    slot j is admitted depends on its own score and other requests' slots, never on this
    request's later slots (whose scores depend on draft j). No two keys tie, so the host twin
    and the device agree."""
    r, k = scores.shape
    j = torch.arange(k, dtype=torch.float64, device=scores.device)[None, :]
    i = torch.arange(r, dtype=torch.float64, device=scores.device)[:, None]
    return scores.double() - 1e-9 * j - 1e-13 * i


def admission_order(scores: list[list[float]]) -> list[int]:
    """Host twin of `admit`'s ranking: the request of every slot, best key first (a request's
    slots come in draft order). The keys are `admission_keys`' own arithmetic in Python floats
    (the score rounded to float32, then the same two float64 subtractions), so host and device
    rank alike without building a tensor."""
    keys = [(-((x - 1e-9 * j) - 1e-13 * i), i) for i, row in enumerate(scores)
            for j, x in enumerate(np.asarray(row, dtype=np.float32).tolist())]
    return [i for _, i in sorted(keys)]


def slot_counts(order: list[int], num_requests: int, budget: int) -> list[int]:
    """How many of each request's slots the first `budget` of `order` hold: its capacity (in
    `admission_order`, what `admit` gives)."""
    counts = [0] * num_requests
    for i in order[:budget]:
        counts[i] += 1
    return counts


def admit(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """Per-request capacities [R] (device int64) from survival scores [R, K] (-inf past a
    request's drafts): the `budget` slots with the highest keys (`admission_keys`). Keys fall
    along a request, so the admitted slots of each request are a prefix of its drafts and the
    count of them is its capacity."""
    r, k = scores.shape
    if budget <= 0 or k == 0:
        return torch.zeros(r, dtype=torch.long, device=scores.device)
    top = admission_keys(scores).reshape(-1).topk(budget).indices
    return torch.zeros(r * k, dtype=torch.long, device=scores.device).index_fill_(0, top, 1).view(r, k).sum(dim=1)
