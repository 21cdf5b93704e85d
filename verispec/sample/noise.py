"""Position-keyed random noise.

What a seeded request draws for the token at sequence position t depends only on
(its seed, the purpose of the draw, t), never on how many draws came before.

Why not one stateful generator per request: with speculation, how many rows a request samples in a
step depends on its drafts, and which drafts a step verifies depends on the batch (the token
budget cuts drafts short) and on preemption (a recomputed request samples its next token from a
prefill row, without drafts). A stateful stream would hand position t different noise in each
case, and a seeded request would change its output with its neighbours. Keyed noise gives position
t the same draw in all of them. The one-hot verifier (spec_decode/rejection.py) relies on it: its
acceptance test at position t is the very draw plain sampling would make there.

A draw is one uniform per row, made on the host from the key alone: a token is drawn from a row's
distribution by inverse CDF (sample/sampler.py), so no row needs a vocabulary's worth of noise.

Purposes are independent streams: `sample` (plain sampling, the one-hot verifier, bonus tokens),
`draft` (model drafters), `accept` and `recover` (the q-drafter rejection rule).
"""

from __future__ import annotations

import hashlib

import torch

from verispec.device_copy import to_device

_M64 = (1 << 64) - 1
PURPOSES = ("sample", "draft", "accept", "recover")


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class RequestNoise:
    """One request's noise keys: a 64-bit base per purpose, mixed with the position."""

    __slots__ = ("bases",)

    def __init__(self, seed: int | str):
        self.bases = {
            p: int.from_bytes(hashlib.sha256(f"{seed}:{p}".encode()).digest()[:8], "little") for p in PURPOSES
        }

    def key(self, purpose: str, position: int) -> int:
        return _splitmix64(self.bases[purpose] ^ _splitmix64(position)) >> 1  # 63 bits: uniform() below


_TWO_52 = float(1 << 52)


def uniform(key: int) -> float:
    """U(0, 1) from a key: the key is already a splitmix64 output (63 well-mixed bits), so it
    needs no generator. Its top 52 bits, centred in their cell, are exact in a float64, so 0 and 1
    are never drawn."""
    return ((key >> 11) + 0.5) / _TWO_52


def uniform_values(keys: list[int | None], device: torch.device) -> torch.Tensor:
    """[len(keys)] U(0, 1) in float64, one per key (1.0 for a None key), in one copy."""
    return to_device([1.0 if key is None else uniform(key) for key in keys], dtype=torch.float64, device=device)
