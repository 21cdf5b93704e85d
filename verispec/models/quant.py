"""Group-wise quantized weights: what the loader hands over when a matrix stays quantized.

A `QuantizedWeight` is an [N, K] matrix stored as integer codes in groups of `group_size` along K:

- 4 bits: codes 0..15, w = scale * q + offset (one scale and one offset per group). GGUF's Q4_1
  is exactly this (offset = m); Q4_0 is offset = -8 * scale; round-to-nearest for HF checkpoints
  is the asymmetric form (offset = the group's minimum).
- 8 bits: codes -128..127, w = scale * q. GGUF's Q8_0 is exactly this; so is the symmetric
  round-to-nearest form for HF checkpoints.

The record is kernel-agnostic: `verispec.models.linear` decides how a kernel consumes it. Scales
stay in fp32 here, so `dequantize()` reproduces the file's values exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

GROUP_SIZE = 32  # GGUF's block size; also torch's smallest int4 kernel group


@dataclass(slots=True)
class QuantizedWeight:
    bits: int  # 4 or 8
    codes: torch.Tensor  # [N, K] uint8 (4 bits, values 0..15) or int8 (8 bits)
    scale: torch.Tensor  # [N, K // group_size] float32
    offset: torch.Tensor | None  # [N, K // group_size] float32; None for 8 bits
    group_size: int = GROUP_SIZE
    kind: str | None = None  # a GGUF file's block type ("Q4_0", "Q4_1", "Q8_0"); None: round to nearest
    source: str | None = None  # a GGUF type these round-to-nearest codes were made from (one not kept)
    exact_source: bool = False  # the codes are `source`'s own values, widened (IQ4_NL, IQ4_XS), not rounded

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """The exact fp32 matrix the codes stand for."""
        n, k = self.codes.shape
        q = self.codes.float().view(n, k // self.group_size, self.group_size)
        w = q * self.scale[..., None]
        if self.offset is not None:
            w = w + self.offset[..., None]
        return w.view(n, k)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "QuantizedWeight":
        """Apply a row selection or permutation (the same for codes, scales and offsets)."""
        return replace(self, codes=fn(self.codes), scale=fn(self.scale),
                       offset=None if self.offset is None else fn(self.offset))


def concat_rows(parts: list) -> "torch.Tensor | QuantizedWeight":
    """Stack matrices along N (q|k|v, gate|up): one weight read per layer instead of several.

    Parts of one quantized format stay quantized; a mix falls back to the dense fp32 values."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    first = parts[0]
    same = all(
        isinstance(p, QuantizedWeight) and (p.bits, p.group_size, p.kind) == (first.bits, first.group_size, first.kind)
        for p in parts
    )
    if not same:
        return torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p.float() for p in parts])
    return QuantizedWeight(
        first.bits,
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scale for p in parts]),
        None if first.offset is None else torch.cat([p.offset for p in parts]),
        first.group_size,
        first.kind,
    )


# ------------------------------------------------------------------------------------ from GGUF
def _halves(raw: np.ndarray, start: int, count: int = 1) -> np.ndarray:
    """`count` float16 values at byte `start` of every block, as float32 [blocks, count]."""
    return raw[:, start : start + 2 * count].copy().view(np.float16).astype(np.float32)


def from_gguf_blocks(data: np.ndarray, kind: str, shape: tuple[int, int]) -> QuantizedWeight:
    """Q4_0, Q4_1 or Q8_0 blocks of 32 weights, decoded without rounding anything.

    Layouts: Q4_0 = f16 d + 16 bytes of nibbles; Q4_1 = f16 d, f16 m + 16 bytes; Q8_0 = f16 d +
    32 int8. In a 4-bit block the low nibbles are weights 0..15 and the high nibbles 16..31."""
    n, k = shape
    head = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}[kind]
    raw = np.ascontiguousarray(data).reshape(n * k // GROUP_SIZE, -1)
    d = torch.from_numpy(_halves(raw, 0)[:, 0]).view(n, k // GROUP_SIZE)
    if kind == "Q8_0":
        codes = torch.from_numpy(raw[:, head:].copy().view(np.int8)).view(n, k)
        return QuantizedWeight(8, codes, d, None, kind=kind)
    packed = raw[:, head:]
    codes = torch.from_numpy(np.concatenate([packed & 0x0F, packed >> 4], axis=1)).view(n, k)
    if kind == "Q4_0":
        offset = -8.0 * d
    else:
        offset = torch.from_numpy(_halves(raw, 2)[:, 0]).view(n, k // GROUP_SIZE)
    return QuantizedWeight(4, codes, d, offset, kind=kind)


# ------------------------------------------------------------------------- round to nearest
def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int = GROUP_SIZE,
                 source: str | None = None) -> QuantizedWeight:
    """Round-to-nearest group-wise quantization of a dense [N, K] matrix (K % group_size == 0).

    4 bits is asymmetric (the group's min..max onto 0..15), 8 bits symmetric (max |w| onto 127),
    the forms of GGUF's Q4_1 and Q8_0, with fp16 scales and offsets as a GGUF file has them (so
    the fast tier's packed kernel takes them as they are): the offset rounded down and the scale
    up, so the group's range still fits the codes. A matrix past fp16's range keeps fp32 ones."""
    n, k = weight.shape
    w = weight.float().view(n, k // group_size, group_size)
    if bits == 4:
        lo, hi = w.amin(-1), w.amax(-1)
        lo16 = _fp16_toward(lo, -1)
        scale16 = _fp16_toward((hi - lo16) / 15, 1)
        if torch.isfinite(lo16).all() and torch.isfinite(scale16).all():
            lo, scale = lo16, scale16
        else:
            scale = (hi - lo) / 15
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round((w - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
        return QuantizedWeight(4, codes.view(n, k), scale, lo, group_size)
    if bits == 8:
        scale = w.abs().amax(-1) / 127
        scale16 = _fp16_toward(scale, 1)
        scale = scale16 if torch.isfinite(scale16).all() else scale
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(w / safe[..., None]).clamp_(-127, 127).to(torch.int8)
        return QuantizedWeight(8, codes.view(n, k), scale, None, group_size, source=source)
    raise ValueError(f"bits must be 4 or 8; got {bits}")


def _fp16_toward(t: torch.Tensor, direction: int) -> torch.Tensor:
    """The fp16 value nearest `t` on the side `direction` (-1: not above t, +1: not below), as fp32."""
    h = t.half()
    wrong = h.float() > t if direction < 0 else h.float() < t
    step = torch.nextafter(h, torch.full_like(h, float("-inf") if direction < 0 else float("inf")))
    return torch.where(wrong, step, h).float()


def requantize(values: torch.Tensor, like: QuantizedWeight) -> QuantizedWeight:
    """New dense [N, K] values quantized the way `like` was loaded: a GGUF file's blocks as
    llama.cpp's reference quantizer makes them (`quantize_gguf`), else round-to-nearest."""
    if like.kind is None:
        return quantize_rtn(values, like.bits, like.group_size)
    return quantize_gguf(values, like.kind)


TORCH_QUANTIZER = ("Q4_0", "Q4_1", "Q8_0")  # the GGUF types `quantize_gguf` writes


def quantize_gguf(values: torch.Tensor, kind: str) -> QuantizedWeight:
    """Q4_0, Q4_1 or Q8_0 blocks of a dense [N, K] matrix, bit for bit what gguf's quantizer (the
    reference rounding of llama.cpp's ggml-quants.c) writes, in torch's threads: each step is
    its fp32 operation in its order, the scale rounded to fp16 only once the codes are made."""
    if kind not in TORCH_QUANTIZER:
        raise ValueError(f"no quantizer for GGUF type {kind}")
    n, k = values.shape
    # In slices of blocks: the temporaries stay a few MB (fresh pages for a whole 28M-value
    # embedding cost more than the arithmetic).
    parts = [_gguf_blocks(x, kind) for x in values.detach().reshape(-1, GROUP_SIZE).split(1 << 15)]
    codes, scale, offset = (torch.cat(t) if t[0] is not None else None for t in zip(*parts))
    return QuantizedWeight(8 if kind == "Q8_0" else 4, codes.view(n, k), scale.view(n, -1),
                           None if offset is None else offset.view(n, -1), kind=kind)


def _gguf_blocks(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes, fp16-exact scales, offsets) of [B, 32] blocks."""
    x = x.float()
    if kind == "Q8_0":
        d = x.abs().amax(1, keepdim=True) / 127
        return _round_half_away(x * _inverse(d)).to(torch.int8), d.half().float(), None
    if kind == "Q4_0":
        d = x.gather(1, x.abs().argmax(1, keepdim=True)) / -8  # the first of the largest magnitudes
        scale = d.half().float()
        return torch.trunc(x * _inverse(d) + 8.5).clamp_(0, 15).to(torch.uint8), scale, -8.0 * scale
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    d = (hi - lo) / 15
    codes = torch.trunc((x - lo) * _inverse(d) + 0.5).clamp_(0, 15).to(torch.uint8)
    return codes, d.half().float(), lo.half().float()


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _round_half_away(t: torch.Tensor) -> torch.Tensor:
    """C's roundf, as gguf spells it: |t|'s floor plus one where its fraction is at least a half."""
    a = t.abs()
    floored = a.floor()
    return a.sub_(floored).mul_(2).floor_().add_(floored).copysign_(t)
