"""Position-keyed random noise.

What a seeded request draws for the token at sequence position t depends only on
(its seed, the purpose of the draw, t), never on how many draws came before.

Why not one stateful generator per request: with speculation, how many rows a request samples in a
step depends on its drafts, and which drafts a step verifies depends on the batch (the token
budget cuts drafts short) and on preemption (a recomputed request samples its next token from a
prefill row, without drafts). A stateful stream would hand position t different noise in each
case, and a seeded request would change its output with its neighbours. Keyed noise gives position
t the same draw in all of them. The one-hot verifier (spec_decode/rejection.py) relies on it: its
acceptance test at position t is the very race plain sampling would run there.

Purposes are independent streams: `sample` (plain sampling, the one-hot verifier, bonus tokens),
`draft` (model drafters), `accept` and `recover` (the q-drafter rejection rule).
"""

from __future__ import annotations

import hashlib

import torch

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
        return _splitmix64(self.bases[purpose] ^ _splitmix64(position)) >> 1  # manual_seed takes 63 bits


# One scratch generator per device, re-seeded before every row: keyed draws need no per-row
# generator objects, and the engine draws rows one after another in a single thread.
_scratch: dict[str, torch.Generator] = {}


def _generator(device: torch.device, key: int) -> torch.Generator:
    name = str(device)
    gen = _scratch.get(name)
    if gen is None:
        gen = _scratch[name] = torch.Generator(device=device)
    gen.manual_seed(key)
    return gen


def exponential_rows(keys: list[int | None], width: int, device: torch.device) -> torch.Tensor:
    """[len(keys), width] Exp(1) noise, row i drawn from key i; a None key (a greedy row, or a
    row nobody samples) gets ones and costs no draw."""
    noise = torch.ones(len(keys), width, device=device)
    for i, key in enumerate(keys):
        if key is not None:
            noise[i].exponential_(generator=_generator(device, key))
    return noise


def uniform_values(keys: list[int | None], device: torch.device) -> torch.Tensor:
    """[len(keys)] U(0, 1) in float64, one per key; 1.0 for a None key."""
    out = torch.ones(len(keys), dtype=torch.float64, device=device)
    for i, key in enumerate(keys):
        if key is not None:
            out[i : i + 1].uniform_(generator=_generator(device, key))
    return out
