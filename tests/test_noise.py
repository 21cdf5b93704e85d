"""Position-keyed noise: keys depend only on (seed, purpose, position), rows only on their own key."""

from __future__ import annotations

import math

import torch

from verispec.sample.noise import PURPOSES, RequestNoise, _splitmix64, uniform, uniform_values

CPU = torch.device("cpu")


def test_splitmix64_matches_the_reference_sequence():
    # SplitMix64 seeded with 0 (Steele, Lea and Flood; the generator Java's SplittableRandom uses):
    # its first three outputs are the mix of 1, 2 and 3 golden-ratio increments.
    gamma, mask = 0x9E3779B97F4A7C15, (1 << 64) - 1
    outputs = [_splitmix64((i * gamma) & mask) for i in range(3)]
    assert outputs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_keys_depend_on_seed_purpose_and_position_only():
    a, b = RequestNoise(7), RequestNoise(7)
    assert [a.key(p, t) for p in PURPOSES for t in range(50)] == [b.key(p, t) for p in PURPOSES for t in range(50)]
    keys = {RequestNoise(s).key(p, t) for s in (0, 1, -1, "7:1", 2**63 - 1, -(2**63)) for p in PURPOSES
            for t in range(500)}
    assert len(keys) == 6 * len(PURPOSES) * 500  # no collisions across seeds, purposes, positions
    assert all(0 <= k < 2**63 for k in keys)  # torch.Generator.manual_seed takes 63 bits


def test_a_row_is_drawn_from_its_own_key_whatever_the_other_rows():
    n = RequestNoise(3)
    k1, k2 = n.key("sample", 10), n.key("sample", 11)
    u = uniform_values([k2, None, k1], CPU)
    assert u[1] == 1.0 and u[0] == uniform_values([k2], CPU)[0] and 0.0 < u[2] < 1.0 and u[0] != u[2]
    assert u[0].item() == uniform(k2)  # the key alone decides it


def test_uniforms_are_never_zero_or_one():
    assert 0.0 < uniform(0) < uniform(2**63 - 1) < 1.0


def test_the_draws_have_their_distributions():
    n, count = RequestNoise(11), 20_000
    u = uniform_values([n.key("accept", t) for t in range(count)], CPU)
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / count)
    # Uniform in every tenth: a chi-square on 10 bins.
    bins = torch.bincount((u * 10).long(), minlength=10).double()
    assert ((bins - count / 10) ** 2 / (count / 10)).sum().item() < 9 + 10 * math.sqrt(18)
